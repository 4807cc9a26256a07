// A second, independent reference: gguf-py's numpy quants (gguf/quants.py of the pinned llama.cpp
// release) must decode the same blocks to the same f32 bits, and its quantisers (where it has them)
// must write our bytes.

import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";
import { dequantize, GgmlType, ggmlTypeTraits, QUANTIZABLE_TYPES, quantize } from "../src/index.js";
import { ALLOW_MISSING_ENV, llamaSourceDir } from "./ggml-ref/ggml-ref.js";
import { quantInputs, rng } from "./quant-inputs.js";

interface Job {
  op: 0 | 1;
  type: GgmlType;
  n: number;
  payload: Uint8Array;
}

const here = dirname(fileURLToPath(import.meta.url));

async function runGgufPy(jobs: Job[]): Promise<(Uint8Array | undefined)[] | string> {
  const parts: Uint8Array[] = [];
  for (const j of jobs) {
    const name = Buffer.from(GgmlType[j.type]!);
    const head = Buffer.alloc(8);
    head.writeUInt32LE(j.op, 0);
    head.writeUInt32LE(name.length, 4);
    const sizes = Buffer.alloc(8);
    sizes.writeUInt32LE(j.n, 0);
    sizes.writeUInt32LE(j.payload.length, 4);
    parts.push(head, name, sizes, j.payload);
  }
  const r = spawnSync("python3", [join(here, "ggml-ref", "gguf_py_quants.py")], {
    input: Buffer.concat(parts),
    env: { ...process.env, PYTHONPATH: join(await llamaSourceDir(), "gguf-py") },
    maxBuffer: 1 << 30,
  });
  if (r.error || r.status !== 0) {
    const reason = `gguf-py reference failed: ${r.error?.message ?? r.stderr.toString().trim()}`;
    if (process.env[ALLOW_MISSING_ENV] === "1") {
      console.warn(`${reason} (skipped: ${ALLOW_MISSING_ENV}=1)`);
      return reason;
    }
    throw new Error(reason);
  }
  const out: (Uint8Array | undefined)[] = [];
  let off = 0;
  for (let i = 0; i < jobs.length; i++) {
    const status = r.stdout.readUInt32LE(off);
    const len = r.stdout.readUInt32LE(off + 4);
    out.push(status === 0 ? Uint8Array.from(r.stdout.subarray(off + 8, off + 8 + len)) : undefined);
    off += 8 + len;
  }
  return out;
}

const NE0 = 512;
const { values } = quantInputs(NE0, 0x9915);
const types = QUANTIZABLE_TYPES;
const dequantJobs: Job[] = types.flatMap((type) => {
  const { blockSize, typeSize } = ggmlTypeTraits(type);
  const next = rng(0x6f + type);
  const random = Uint8Array.from({ length: 64 * typeSize }, () => Math.floor(next() * 256));
  return [
    // our blocks are ggml's (quant-ggml.test.ts), so this needs no compiler
    { op: 0, type, n: values.length, payload: quantize(type, values, NE0) },
    { op: 0, type, n: 64 * blockSize, payload: random },
  ];
});
// gguf-py quantises whole arrays; one row keeps its per-row logic out of the comparison
const row = values.subarray(0, 4 * NE0);
const quantJobs: Job[] = types.map((type) => ({
  op: 1,
  type,
  n: row.length,
  payload: new Uint8Array(row.buffer, row.byteOffset, row.byteLength),
}));
const results = await runGgufPy([...dequantJobs, ...quantJobs]);

function sameBitsOrBothNaN(a: Float32Array, b: Float32Array): number {
  const x = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const y = new Uint32Array(b.buffer, b.byteOffset, b.length);
  if (x.length !== y.length) return 0;
  for (let i = 0; i < x.length; i++) {
    // numpy's f16 -> f32 keeps a signalling NaN signalling; ggml (and we) return it quiet
    if (x[i] !== y[i] && !(Number.isNaN(a[i]) && Number.isNaN(b[i]))) return i;
  }
  return -1;
}

describe.skipIf(typeof results === "string")("bit-exact against gguf-py", () => {
  const res = results as (Uint8Array | undefined)[];

  it("dequantises every type gguf-py implements to the same f32 bits", () => {
    const checked: string[] = [];
    dequantJobs.forEach((job, i) => {
      const theirs = res[i];
      if (!theirs) return;
      const b = new Float32Array(theirs.buffer, theirs.byteOffset, theirs.byteLength / 4);
      const at = sameBitsOrBothNaN(dequantize(job.type, job.payload, job.n), b);
      expect(at, `${GgmlType[job.type]} job ${i}: first difference at ${at}`).toBe(-1);
      checked.push(GgmlType[job.type]!);
    });
    // the K-quants, the legacy quants and the float types at least are in gguf-py
    for (const t of [
      "F16",
      "BF16",
      "Q4_0",
      "Q4_1",
      "Q5_0",
      "Q5_1",
      "Q8_0",
      "Q2_K",
      "Q3_K",
      "Q4_K",
      "Q5_K",
      "Q6_K",
    ]) {
      expect(checked).toContain(t);
    }
  });

  it("quantises to the same bytes where gguf-py has a quantiser", () => {
    const checked: string[] = [];
    quantJobs.forEach((job, i) => {
      const theirs = res[dequantJobs.length + i];
      if (!theirs) return;
      expect(Buffer.from(quantize(job.type, row)).equals(Buffer.from(theirs)), GgmlType[job.type]).toBe(true);
      checked.push(GgmlType[job.type]!);
    });
    for (const t of ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4"])
      expect(checked).toContain(t);
  });
});
