// Shared inputs for the GGUF tests: one file with every value type, nested arrays and several
// tensor types, built deterministically.
import { spawnSync } from "node:child_process";
import { dirname, join } from "node:path";
import { fileURLToPath, pathToFileURL } from "node:url";
import { GgmlType, ggmlTensorBytes } from "../src/ggml-type.js";
import { GgufValueType } from "../src/gguf-constants.js";
import { type GgufMetadataValue, ggufValue } from "../src/gguf-metadata.js";
import type { GgufWriteInput, GgufWriteTensor } from "../src/gguf-writer.js";

/** Deterministic bytes (xorshift32), so every run writes the same file. */
export function pseudoBytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let x = seed >>> 0 || 1;
  for (let i = 0; i < n; i++) {
    x ^= x << 13;
    x >>>= 0;
    x ^= x >>> 17;
    x ^= x << 5;
    x >>>= 0;
    out[i] = x & 0xff;
  }
  return out;
}

export function tensor(name: string, type: GgmlType, shape: number[], seed: number): GgufWriteTensor {
  return { name, type, shape, data: pseudoBytes(Number(ggmlTensorBytes(type, shape)), seed) };
}

/** Every scalar type, strings with multi-byte UTF-8 and a leading BOM, every array kind. */
export function kitchenSinkMetadata(): Map<string, GgufMetadataValue> {
  const v = ggufValue;
  return new Map<string, GgufMetadataValue>([
    ["general.architecture", v.str("qwen3moe")],
    ["general.name", v.str("kitchen sink ✓ — 日本語 \u{1F600}")],
    ["test.bom", v.str("\uFEFFstarts with a BOM")],
    ["test.empty", v.str("")],
    ["test.u8", v.u8(255)],
    ["test.i8", v.i8(-128)],
    ["test.u16", v.u16(65535)],
    ["test.i16", v.i16(-32768)],
    ["test.u32", v.u32(4294967295)],
    ["test.i32", v.i32(-2147483648)],
    ["test.f32", v.f32(Math.fround(1.1))],
    ["test.f32_neg_zero", v.f32(-0)],
    ["test.bool_true", v.bool(true)],
    ["test.bool_false", v.bool(false)],
    ["test.u64", v.u64(18446744073709551615n)],
    ["test.i64", v.i64(-9223372036854775808n)],
    ["test.f64", v.f64(-1.25e-300)],
    ["test.arr_u8", v.array(GgufValueType.UINT8, Uint8Array.from([0, 1, 255]))],
    ["test.arr_i8", v.array(GgufValueType.INT8, Int8Array.from([-128, 0, 127]))],
    ["test.arr_u16", v.array(GgufValueType.UINT16, Uint16Array.from([0, 65535]))],
    ["test.arr_i16", v.array(GgufValueType.INT16, Int16Array.from([-32768, 32767]))],
    ["test.arr_u32", v.array(GgufValueType.UINT32, Uint32Array.from([0, 4294967295, 7]))],
    ["test.arr_i32", v.array(GgufValueType.INT32, Int32Array.from([-2147483648, 2147483647, -1]))],
    ["test.arr_f32", v.array(GgufValueType.FLOAT32, Float32Array.from([1.5, -2.25, 1e-30]))],
    ["test.arr_bool", v.array(GgufValueType.BOOL, [true, false, true])],
    ["test.arr_str", v.array(GgufValueType.STRING, ["a", "", "Ġthe", "é", "\u{1F600}x"])],
    ["test.arr_u64", v.array(GgufValueType.UINT64, BigUint64Array.from([0n, 18446744073709551615n]))],
    ["test.arr_i64", v.array(GgufValueType.INT64, BigInt64Array.from([-9223372036854775808n, 5n]))],
    ["test.arr_f64", v.array(GgufValueType.FLOAT64, Float64Array.from([Math.PI, -0, 1e300]))],
    [
      "test.arr_nested",
      v.array(GgufValueType.ARRAY, [
        v.array(GgufValueType.INT32, Int32Array.from([1, 2, 3])),
        v.array(GgufValueType.STRING, ["x", "yz"]),
        v.array(GgufValueType.ARRAY, [v.array(GgufValueType.FLOAT32, Float32Array.from([0.5]))]),
      ]),
    ],
    ["test.arr_empty", v.array(GgufValueType.UINT32, new Uint32Array(0))],
    ["general.alignment", v.u32(64)],
  ]);
}

export function kitchenSinkTensors(): GgufWriteTensor[] {
  return [
    tensor("token_embd.weight", GgmlType.F32, [8, 4], 1),
    tensor("blk.0.attn_norm.weight", GgmlType.F16, [8], 2),
    tensor("blk.0.ffn_gate_exps.weight", GgmlType.Q4_0, [64, 2, 3], 3),
    tensor("blk.0.ffn_up_exps.weight", GgmlType.Q8_0, [32, 3, 2], 4),
    tensor("blk.0.ffn_down_exps.weight", GgmlType.Q4_K, [256, 1, 2], 5),
    tensor("blk.0.bf16.weight", GgmlType.BF16, [3, 5], 6),
    tensor("blk.0.q6k.weight", GgmlType.Q6_K, [256, 2], 7),
    tensor("blk.0.i32.weight", GgmlType.I32, [5], 8),
    tensor("output.4d.weight", GgmlType.F32, [2, 3, 1, 2], 9),
    tensor("scalar.weight", GgmlType.F32, [], 10),
  ];
}

export function kitchenSink(): GgufWriteInput {
  return { metadata: kitchenSinkMetadata(), tensors: kitchenSinkTensors() };
}

/** A small valid file for the fuzzer: a few values of each kind, three tiny tensors. */
export function smallInput(): GgufWriteInput {
  const v = ggufValue;
  return {
    metadata: new Map<string, GgufMetadataValue>([
      ["general.architecture", v.str("llama")],
      ["a.u32", v.u32(7)],
      ["a.f32", v.f32(0.5)],
      ["a.u64", v.u64(9n)],
      ["a.strs", v.array(GgufValueType.STRING, ["ab", "c"])],
      ["a.nums", v.array(GgufValueType.INT32, Int32Array.from([1, -1]))],
      ["a.nested", v.array(GgufValueType.ARRAY, [v.array(GgufValueType.UINT8, Uint8Array.from([1, 2]))])],
      ["general.alignment", v.u32(16)],
    ]),
    tensors: [
      tensor("t.f32", GgmlType.F32, [4, 2], 11),
      tensor("t.q8", GgmlType.Q8_0, [32], 12),
      tensor("t.f16", GgmlType.F16, [2, 1, 1, 2], 13),
    ],
  };
}

/** Runs a Python script with gguf-py of the pinned llama.cpp on the path; returns stdout. */
export async function runGgufPy(script: string, args: string[] = []): Promise<string> {
  // A URL string keeps the type checker away from the untyped .mjs.
  const url = pathToFileURL(
    join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", "tools", "llama-source.mjs"),
  ).href;
  const { llamaSourceDir } = (await import(url)) as { llamaSourceDir(): string };
  const res = spawnSync("python3", ["-c", script, ...args], {
    env: { ...process.env, PYTHONPATH: join(llamaSourceDir(), "gguf-py"), PYTHONIOENCODING: "utf-8" },
    encoding: "utf8",
    maxBuffer: 256 * 1024 * 1024,
  });
  if (res.status !== 0) throw new Error(`python failed (${res.status}):\n${res.stderr}`);
  return res.stdout;
}
