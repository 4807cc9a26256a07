// Deterministic pseudo-random numbers for synthetic models. Only integer operations, additions,
// multiplications and square roots (all exactly rounded in IEEE 754), so the same seed gives the
// same bits on every platform and Node version, unlike Math.random or libm's log/cos.

/** FNV-1a over the UTF-16 code units of `text`, mixed into `seed`. */
export function hashString(text: string, seed = 0x811c9dc5): number {
  let h = (seed ^ 0x811c9dc5) >>> 0;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return mix32(h);
}

/** murmur3's 32-bit finaliser: spreads every input bit over the output. */
export function mix32(x: number): number {
  let h = x >>> 0;
  h ^= h >>> 16;
  h = Math.imul(h, 0x85ebca6b) >>> 0;
  h ^= h >>> 13;
  h = Math.imul(h, 0xc2b2ae35) >>> 0;
  h ^= h >>> 16;
  return h >>> 0;
}

/**
 * sfc32 (Chris Doty-Humphrey's Small Fast Counting generator): 128 bits of state, passes
 * PractRand, and needs only 32-bit integer operations.
 */
export class Sfc32 {
  private a: number;
  private b: number;
  private c: number;
  private d = 1;

  constructor(seed: number, stream = 0) {
    this.a = mix32(seed ^ 0x9e3779b9);
    this.b = mix32(stream ^ 0x7f4a7c15);
    this.c = mix32((seed + stream) ^ 0x6a09e667);
    for (let i = 0; i < 12; i++) this.nextU32();
  }

  nextU32(): number {
    const t = (((this.a + this.b) >>> 0) + this.d) >>> 0;
    this.d = (this.d + 1) >>> 0;
    this.a = this.b ^ (this.b >>> 9);
    this.b = (this.c + (this.c << 3)) >>> 0;
    this.c = ((this.c << 21) | (this.c >>> 11)) >>> 0;
    this.c = (this.c + t) >>> 0;
    return t;
  }

  /** Uniform in [0, 1) with 32 random bits. */
  nextFloat(): number {
    return this.nextU32() / 4294967296;
  }

  /** Fills `out` with successive nextU32() words. */
  fillU32(out: Uint32Array): void {
    let { a, b, c, d } = this;
    for (let i = 0; i < out.length; i++) {
      const t = (((a + b) >>> 0) + d) >>> 0;
      d = (d + 1) >>> 0;
      a = b ^ (b >>> 9);
      b = (c + (c << 3)) >>> 0;
      c = (((c << 21) | (c >>> 11)) + t) >>> 0;
      out[i] = t;
    }
    this.a = a;
    this.b = b;
    this.c = c;
    this.d = d;
  }

  /**
   * Fills `out` with values of mean `mean` and standard deviation `std`: the sum of two 16-bit
   * uniforms from one draw (a triangular distribution), bell-shaped enough for weights and exact
   * everywhere.
   */
  fillTriangular(out: Float32Array, std: number, mean = 0): void {
    // (hi + lo) / 2^16 - 1 on [-1, 1) has variance 1/6 (up to 2^-32).
    const scale = (std * Math.sqrt(6)) / 65536;
    const offset = mean - std * Math.sqrt(6);
    let { a, b, c, d } = this;
    for (let i = 0; i < out.length; i++) {
      const t = (((a + b) >>> 0) + d) >>> 0;
      d = (d + 1) >>> 0;
      a = b ^ (b >>> 9);
      b = (c + (c << 3)) >>> 0;
      c = (((c << 21) | (c >>> 11)) + t) >>> 0;
      out[i] = offset + ((t >>> 16) + (t & 0xffff)) * scale;
    }
    this.a = a;
    this.b = b;
    this.c = c;
    this.d = d;
  }
}

/** A generator for one named piece of a model (a tensor, or one expert's slab of it). */
export function streamFor(seed: number, name: string, index = 0): Sfc32 {
  return new Sfc32(hashString(name, seed >>> 0), mix32(index + 0x51ed27));
}
