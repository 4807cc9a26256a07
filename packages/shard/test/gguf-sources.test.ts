// fileSource and bufferSource: positioned reads, ends, closing, bad arguments; how many reads a
// header costs.

import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, describe, expect, it } from "vitest";
import {
  type ByteSource,
  bufferSource,
  fileSource,
  GgufValueType,
  ggufValue,
  readGguf,
  writeGguf,
} from "../src/index.js";
import { pseudoBytes } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-gguf-src-");
afterAll(() => tmp.remove());
const bytes = pseudoBytes(10_000, 42);
const path = join(tmp.dir, "bytes.bin");
writeFileSync(path, bytes);

describe.each([
  ["fileSource", () => fileSource(path)],
  ["bufferSource", async () => bufferSource(bytes)],
])("%s", (_name, open) => {
  it("reads exact ranges, short at the end, empty past it", async () => {
    const src = await open();
    expect(src.size).toBe(10_000n);
    expect(Buffer.compare(await src.read(0, 10), bytes.subarray(0, 10))).toBe(0);
    expect(Buffer.compare(await src.read(1234n, 4000), bytes.subarray(1234, 5234))).toBe(0);
    expect(Buffer.compare(await src.read(9990, 100), bytes.subarray(9990))).toBe(0);
    expect((await src.read(10_000, 5)).byteLength).toBe(0);
    expect((await src.read(50_000n, 5)).byteLength).toBe(0);
    expect((await src.read(5, 0)).byteLength).toBe(0);
    await src.close();
  });

  it("rejects bad arguments and reads after close", async () => {
    const src = await open();
    for (const [o, l] of [
      [-1, 1],
      [1.5, 1],
      [0, -1],
      [0, 2 ** 31],
      [-1n, 1],
    ] as const) {
      await expect(src.read(o, l)).rejects.toBeInstanceOf(InvalidArgumentError);
    }
    await expect(src.read(0, 1, { signal: AbortSignal.abort("why") })).rejects.toMatchObject({
      code: "MOESWARM_ABORTED",
    });
    await src[Symbol.asyncDispose]();
    await expect(src.read(0, 1)).rejects.toMatchObject({ code: "MOESWARM_GGUF_IO" });
    await src.close(); // closing twice is fine
  });
});

describe("fileSource", () => {
  it("reports missing files and directories as MOESWARM_GGUF_IO", async () => {
    await expect(fileSource(join(tmp.dir, "absent.gguf"))).rejects.toMatchObject({
      code: "MOESWARM_GGUF_IO",
    });
    await expect(fileSource(tmp.dir)).rejects.toMatchObject({ code: "MOESWARM_GGUF_IO" });
    await expect(readGguf(join(tmp.dir, "absent.gguf"))).rejects.toBeInstanceOf(GgufError);
  });
});

describe("read-ahead", () => {
  /** Counts the reads a source serves. */
  function counting(inner: ByteSource, forwardHint = false): ByteSource & { reads: number[] } {
    const reads: number[] = [];
    return {
      size: inner.size,
      description: inner.description,
      preferredReadSize: forwardHint ? inner.preferredReadSize : undefined,
      reads,
      read(offset, length, options) {
        reads.push(length);
        return inner.read(offset, length, options);
      },
      close: () => inner.close(),
      [Symbol.asyncDispose]: () => inner.close(),
    };
  }

  it("reads a 4 MB header in a handful of growing blocks, from a local file too (1 MiB first)", async () => {
    const p = join(tmp.dir, "vocab.gguf");
    const tokens = Array.from({ length: 200_000 }, (_, i) => `token-${i}`);
    const blob = "y".repeat(2_500_000);
    await writeGguf(
      {
        metadata: {
          "tokenizer.ggml.tokens": ggufValue.array(GgufValueType.STRING, tokens),
          "big.string": ggufValue.str(blob),
        },
        tensors: [],
      },
      p,
    );
    const src = counting(await fileSource(p));
    const header = await readGguf(src);
    await src.close();
    expect(header.metadata.get("big.string")?.value).toBe(blob);
    const tokensValue = header.metadata.get("tokenizer.ggml.tokens")?.value as string[] | undefined;
    expect(tokensValue?.[199_999]).toBe("token-199999");
    // 1 MiB, then 2 MiB, then exactly what is left of the big string.
    expect(src.reads[0]).toBe(1 << 20);
    expect(src.reads.length).toBeLessThanOrEqual(4);

    // a local file starts small as well: a 16 MiB first read made a large model's parse 2x slower
    const local = counting(await fileSource(p), true);
    expect(await readGguf(local)).toEqual(header);
    await local.close();
    expect(local.reads[0]).toBe(1 << 20);
    expect(local.reads.length).toBeLessThanOrEqual(4);
  });
});
