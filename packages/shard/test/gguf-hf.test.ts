// @huggingface/gguf (an independent parser) against our writer and reader on the same files.

import { join } from "node:path";
import { gguf } from "@huggingface/gguf";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  type GgufMetadataValue,
  GgufValueType,
  type GgufWriteInput,
  readGguf,
  writeGguf,
} from "../src/index.js";
import { kitchenSink, smallInput } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-gguf-hf-");
afterAll(() => tmp.remove());

/** Our typed value as @huggingface/gguf reports it: plain JS arrays, bigint for 64-bit ints. */
function asHf(v: GgufMetadataValue): unknown {
  // @huggingface/gguf decodes with a default TextDecoder, which drops a leading BOM; gguf-py and
  // ggml keep it (and so do we: see gguf-pyref.test.ts), so only here is it removed.
  if (v.type === GgufValueType.STRING) return v.value.replace(/^\uFEFF/, "");
  if (v.type !== GgufValueType.ARRAY) return v.value;
  if (v.itemType === GgufValueType.ARRAY) return v.value.map(asHf);
  return [...(v.value as Iterable<unknown>)];
}

describe("@huggingface/gguf parses our files", () => {
  const inputs: [string, GgufWriteInput][] = [
    ["kitchen sink", kitchenSink()],
    ["small", smallInput()],
  ];
  for (const [label, input] of inputs) {
    it(`${label}: same metadata (values and types) and tensor infos`, async () => {
      const path = join(tmp.dir, `${label.replace(" ", "-")}.gguf`);
      const plan = await writeGguf(input, path);
      const hf = await gguf(path, { allowLocalFile: true, typedMetadata: true });
      const ours = await readGguf(path);

      expect(hf.littleEndian).toBe(true);
      expect(hf.metadata.version).toBe(3);
      expect(hf.metadata.tensor_count).toBe(BigInt(plan.tensors.length));
      expect(hf.metadata.kv_count).toBe(BigInt(plan.metadata.size));
      const { version: _v, tensor_count: _t, kv_count: _k, ...rest } = hf.metadata;
      const hfMeta = rest as Record<string, unknown>;
      expect(Object.keys(hfMeta)).toEqual([...ours.metadata.keys()]);
      for (const [key, value] of ours.metadata) {
        expect(hfMeta[key], key).toEqual(asHf(value));
        const typed = hf.typedMetadata[key];
        expect(typed?.type, key).toBe(value.type);
        if (value.type === GgufValueType.ARRAY && value.value.length > 0) {
          expect((typed as { subType?: number }).subType, key).toBe(value.itemType);
        }
      }

      expect(hf.tensorDataOffset).toBe(ours.dataOffset);
      expect(hf.tensorInfos.map((t) => t.name)).toEqual(ours.tensors.map((t) => t.name));
      for (const [i, t] of ours.tensors.entries()) {
        const h = hf.tensorInfos[i]!;
        expect(h.dtype as number, t.name).toBe(t.type);
        expect(h.n_dims, t.name).toBe(t.shape.length);
        expect(h.shape, t.name).toEqual(t.shape.map(BigInt));
        expect(h.offset, t.name).toBe(t.offset);
      }
    });
  }
});
