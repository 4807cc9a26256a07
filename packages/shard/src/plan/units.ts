import { InvalidArgumentError } from "@moeswarm/core";

/** A byte count: a number or bigint of bytes, or text such as `64GiB`, `64 GB`, `1.5G`, `512MiB`. */
export type ByteSize = number | bigint | string;

const GIB = 1024n ** 3n;

// Binary units as llama.cpp and nvidia-smi print them; SI units for what vendors put on the box.
const UNITS: Readonly<Record<string, bigint>> = {
  b: 1n,
  k: 1024n,
  kb: 1000n,
  kib: 1024n,
  m: 1024n ** 2n,
  mb: 1000n ** 2n,
  mib: 1024n ** 2n,
  g: GIB,
  gb: 1000n ** 3n,
  gib: GIB,
  t: 1024n ** 4n,
  tb: 1000n ** 4n,
  tib: 1024n ** 4n,
};

const SIZE = /^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$/i;
// 2^60 bytes: far above any machine, far below where bigint arithmetic would matter.
const MAX_BYTES = 1n << 60n;

/** The error for a size that is not a byte count, naming the option it came from. */
function badSize(what: string, value: unknown): InvalidArgumentError {
  return new InvalidArgumentError(
    `${what} must be a byte count such as 68719476736, "64GiB" or "64GB", got ${JSON.stringify(String(value))}`,
    { details: { [what]: String(value) } },
  );
}

/**
 * Bytes of a size given as a number, bigint or text. Bare letters (`G`, `M`) are binary, as in
 * llama.cpp's MiB/GiB figures; `GB`/`MB` are decimal (a "64 GB" card box). Fractions round down
 * to whole bytes.
 */
export function parseByteSize(value: ByteSize, what = "size"): bigint {
  let bytes: bigint;
  if (typeof value === "bigint") bytes = value;
  else if (typeof value === "number") {
    if (!Number.isSafeInteger(value)) throw badSize(what, value);
    bytes = BigInt(value);
  } else if (typeof value === "string") {
    const m = SIZE.exec(value);
    const unit = m ? UNITS[(m[2] ?? "").toLowerCase() || "b"] : undefined;
    if (!m || unit === undefined) throw badSize(what, value);
    const [whole, frac = ""] = m[1]!.split(".");
    if (whole!.length > 20 || frac.length > 12) throw badSize(what, value);
    const scale = 10n ** BigInt(frac.length);
    bytes = ((BigInt(whole!) * scale + BigInt(frac || "0")) * unit) / scale;
  } else throw badSize(what, value);
  if (bytes < 0n || bytes > MAX_BYTES) throw badSize(what, value);
  return bytes;
}

/** GiB with `digits` decimals (llama.cpp and the reference figures use GiB). */
export function toGiB(bytes: bigint, digits = 1): string {
  // Exact decimal rounding in bigint: a float division of a 70 GB figure is fine, but this keeps
  // the printed value identical on every platform.
  const scale = 10n ** BigInt(digits);
  const scaled = (bytes * scale * 2n + GIB) / (2n * GIB);
  const s = scaled.toString().padStart(digits + 1, "0");
  return digits === 0 ? s : `${s.slice(0, -digits)}.${s.slice(-digits)}`;
}
