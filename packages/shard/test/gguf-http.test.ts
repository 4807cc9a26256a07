// httpSource and readGguf over HTTP Range requests, against a local node:http server: few
// requests for a big model's header, typed errors for servers that ignore or garble ranges, abort.

import { getEventListeners } from "node:events";
import { createReadStream, statSync } from "node:fs";
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { GgufError } from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { Agent } from "undici";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  GgmlType,
  GgufValueType,
  type GgufWriteTensor,
  ggufValue,
  httpSource,
  readGguf,
  writeGguf,
} from "../src/index.js";
import { kitchenSink } from "./gguf-fixtures.js";

const tmp = tempDir("moeswarm-gguf-http-");
const sinkPath = join(tmp.dir, "sink.gguf");
const bigPath = join(tmp.dir, "big.gguf");

interface Stats {
  requests: number;
  bytesSent: number;
}
const stats: Stats = { requests: 0, bytesSent: 0 };
let server: Server;
let base: string;
let delayMs = 0;
const delayed = new Set<NodeJS.Timeout>();
let sizeOverride: number | undefined;

function serveRange(req: IncomingMessage, res: ServerResponse, path: string, cap?: number): void {
  const size = sizeOverride ?? statSync(path).size;
  const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? "");
  if (!m) {
    res.writeHead(400).end();
    return;
  }
  const start = Number(m[1]);
  if (start >= size) {
    res.writeHead(416, { "content-range": `bytes */${size}` }).end();
    return;
  }
  let end = Math.min(Number(m[2]), size - 1);
  if (cap !== undefined) end = Math.min(end, start + cap - 1);
  res.writeHead(206, { "content-range": `bytes ${start}-${end}/${size}`, "content-length": end - start + 1 });
  stats.bytesSent += end - start + 1;
  createReadStream(path, { start, end }).pipe(res);
}

beforeAll(async () => {
  await writeGguf(kitchenSink(), sinkPath);
  // A 122B-like header shape: a big tokenizer array and many tensors over a ~17 GB sparse file.
  const tokens = Array.from({ length: 150_000 }, (_, i) => `tok_${i}_${"x".repeat(i % 17)}`);
  const tensors: GgufWriteTensor[] = [];
  for (let l = 0; l < 48; l++) {
    tensors.push({ name: `blk.${l}.ffn_gate_exps.weight`, type: GgmlType.Q4_K, shape: [3072, 1024, 256] });
    tensors.push({ name: `blk.${l}.attn_norm.weight`, type: GgmlType.F32, shape: [3072] });
  }
  await writeGguf(
    {
      metadata: new Map([
        ["general.architecture", ggufValue.str("qwen35moe")],
        ["tokenizer.ggml.tokens", ggufValue.array(GgufValueType.STRING, tokens)],
      ]),
      tensors,
    },
    bigPath,
    { headerOnly: true },
  );

  server = createServer((req, res) => {
    stats.requests++;
    const url = new URL(req.url ?? "/", "http://x");
    const go = () => {
      switch (url.pathname) {
        case "/sink.gguf":
          return serveRange(req, res, sinkPath);
        case "/big.gguf":
          return serveRange(req, res, bigPath);
        case "/capped.gguf":
          return serveRange(req, res, sinkPath, 100);
        case "/redirect.gguf":
          return res.writeHead(302, { location: "/sink.gguf" }).end();
        case "/ignores-range.gguf": {
          // Sends the whole "file" with 200: 64 MiB the client must not download.
          res.writeHead(200, { "content-length": 64 << 20 });
          let sent = 0;
          const chunk = Buffer.alloc(1 << 16);
          const pump = () => {
            while (sent < 64 << 20) {
              sent += chunk.byteLength;
              stats.bytesSent += chunk.byteLength;
              if (!res.write(chunk)) return res.once("drain", pump);
            }
            res.end();
          };
          res.on("close", () => undefined);
          return pump();
        }
        case "/no-content-range.gguf":
          res.writeHead(206, { "content-length": 4 });
          return res.end("GGUF");
        case "/wrong-range.gguf":
          res.writeHead(206, { "content-range": "bytes 5-8/100", "content-length": 4 });
          return res.end("GGUF");
        case "/error.gguf":
          return res.writeHead(500).end("boom");
        default:
          return res.writeHead(404).end();
      }
    };
    if (delayMs > 0) {
      // A delayed answer to a request the client already gave up on must not outlive the file.
      const timer = setTimeout(() => {
        delayed.delete(timer);
        if (!res.destroyed) go();
      }, delayMs);
      delayed.add(timer);
    } else go();
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

afterAll(async () => {
  for (const timer of delayed) clearTimeout(timer);
  server.closeAllConnections();
  await new Promise((resolve) => server.close(resolve));
  tmp.remove();
});

function reset(): void {
  stats.requests = 0;
  stats.bytesSent = 0;
  delayMs = 0;
  sizeOverride = undefined;
}

describe("readGguf over HTTP", () => {
  it("reads the same header as from the file", async () => {
    reset();
    const fromFile = await readGguf(sinkPath);
    const fromHttp = await readGguf(new URL(`${base}/sink.gguf`));
    expect(fromHttp).toEqual(fromFile);
    expect(stats.requests).toBe(1);
    // a URL given as a string is a URL, not a relative path named "http:"
    expect(await readGguf(`${base}/sink.gguf`)).toEqual(fromFile);
    expect(stats.requests).toBe(2);
  });

  it("reads a 17 GB model's 2.6 MB header in a few requests, without its data", async () => {
    reset();
    const size = statSync(bigPath).size;
    expect(size).toBeGreaterThan(16e9);
    const header = await readGguf(httpSource(`${base}/big.gguf`));
    expect(header.fileSize).toBe(BigInt(size));
    expect(header.tensors).toHaveLength(96);
    expect(header.metadata.get("tokenizer.ggml.tokens")?.value).toHaveLength(150_000);
    expect(header.headerSize).toBeGreaterThan(2_500_000);
    // 1 + 2 MiB read-ahead covers ~3 MB: two requests, and nowhere near the data.
    expect(stats.requests).toBeLessThanOrEqual(3);
    expect(stats.bytesSent).toBeLessThan(8 << 20);
  });

  it("follows redirects and stitches ranges a server caps", async () => {
    reset();
    const want = await readGguf(sinkPath);
    expect(await readGguf(httpSource(`${base}/redirect.gguf`))).toEqual(want);
    const capped = httpSource(`${base}/capped.gguf`);
    const bytes = await capped.read(0, 1000);
    expect(bytes.byteLength).toBe(1000);
    const { readFileSync } = await import("node:fs");
    expect(Buffer.compare(bytes, readFileSync(sinkPath).subarray(0, 1000))).toBe(0);
  });

  it("returns short reads at the end and nothing past it", async () => {
    reset();
    const size = statSync(sinkPath).size;
    const src = httpSource(`${base}/sink.gguf`);
    expect((await src.read(size - 10, 100)).byteLength).toBe(10);
    expect(src.size).toBe(BigInt(size));
    expect((await src.read(size + 5, 10)).byteLength).toBe(0);
    const fresh = httpSource(`${base}/sink.gguf`);
    expect((await fresh.read(size + 5, 10)).byteLength).toBe(0); // a 416 teaches the size too
    expect(fresh.size).toBe(BigInt(size));
  });
});

describe("servers that break the contract", () => {
  async function ioError(path: string): Promise<GgufError> {
    const error = await httpSource(`${base}${path}`)
      .read(0, 1024)
      .catch((e: unknown) => e);
    expect(error).toBeInstanceOf(GgufError);
    expect((error as GgufError).code).toBe("MOESWARM_GGUF_IO");
    return error as GgufError;
  }

  it("a server ignoring Range: MOESWARM_GGUF_IO, body not downloaded", async () => {
    reset();
    const error = await ioError("/ignores-range.gguf");
    expect(error.message).toMatch(/ignored the Range header/);
    await new Promise((r) => setTimeout(r, 50));
    expect(stats.bytesSent).toBeLessThan(16 << 20);
    await expect(readGguf(new URL(`${base}/ignores-range.gguf`))).rejects.toMatchObject({
      code: "MOESWARM_GGUF_IO",
    });
  });

  it("206 without Content-Range, a wrong range, 404 and 500: MOESWARM_GGUF_IO", async () => {
    await ioError("/no-content-range.gguf");
    await ioError("/wrong-range.gguf");
    expect((await ioError("/missing.gguf")).details).toMatchObject({ status: 404 });
    expect((await ioError("/error.gguf")).details).toMatchObject({ status: 500 });
  });

  it("a resource that changes size between requests", async () => {
    reset();
    const src = httpSource(`${base}/sink.gguf`);
    await src.read(0, 10);
    sizeOverride = statSync(sinkPath).size - 1;
    await expect(src.read(10, 10)).rejects.toMatchObject({ code: "MOESWARM_GGUF_IO" });
    sizeOverride = undefined;
  });

  it("a refused connection", async () => {
    const error = await httpSource("http://127.0.0.1:1/x.gguf", {
      dispatcher: new Agent({ connect: { timeout: 2000 } }),
    })
      .read(0, 10)
      .catch((e: unknown) => e);
    expect((error as GgufError).code).toBe("MOESWARM_GGUF_IO");
  });

  it("bad arguments", () => {
    expect(() => httpSource("ftp://x/y")).toThrow(
      expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
    );
    expect(() => httpSource(`${base}/x`, { headers: { Range: "bytes=0-1" } })).toThrow(
      expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
    );
  });
});

describe("abort over HTTP", () => {
  it("already aborted, aborted while waiting, listeners removed", async () => {
    reset();
    const reason = new Error("user");
    const src = httpSource(`${base}/sink.gguf`);
    await expect(src.read(0, 10, { signal: AbortSignal.abort(reason) })).rejects.toBe(reason);

    delayMs = 200;
    const controller = new AbortController();
    const sourceLevel = new AbortController();
    const slow = httpSource(`${base}/sink.gguf`, { signal: sourceLevel.signal });
    const pending = readGguf(slow, { signal: controller.signal });
    setTimeout(() => controller.abort(reason), 20);
    await expect(pending).rejects.toBe(reason);
    delayMs = 0;

    // A completed or failed read leaves no listener on either signal.
    const perRead = new AbortController();
    const fast = httpSource(`${base}/sink.gguf`, { signal: sourceLevel.signal });
    await fast.read(0, 10, { signal: perRead.signal });
    await fast.read(10_000_000, 10, { signal: perRead.signal });
    await httpSource(`${base}/error.gguf`, { signal: sourceLevel.signal })
      .read(0, 10, { signal: perRead.signal })
      .catch(() => undefined);
    expect(getEventListeners(perRead.signal, "abort")).toHaveLength(0);
    expect(getEventListeners(sourceLevel.signal, "abort")).toHaveLength(0);
  });
});
