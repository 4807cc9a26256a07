import { randomBytes } from "node:crypto";
import { createReadStream } from "node:fs";
import { open } from "node:fs/promises";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { dirname, join } from "node:path";
import { pipeline } from "node:stream/promises";
import { fileURLToPath } from "node:url";
import { Worker } from "node:worker_threads";
import { createHub, createLoopbackCertificates, type Hub } from "@moeswarm/hub";
import { ensureSyntheticModel, loadOrBuildManifest } from "@moeswarm/shard";
import { type Benchmark, gbPerSecond, interleaved, median, pairedRatio, type Row } from "../harness.js";

// Downloading layer 0 x all 64 experts of the `medium` synthetic qwen3moe (~53 MiB of Q8_0 slabs)
// from the hub's expert-shard endpoint over loopback, next to reading the same byte ranges of the
// same file with positioned fs reads in the same run (page cache warm). The client runs in a
// worker thread (its own event loop, as a real downloader would be another process) and only
// counts the bytes. The figure is download GB/s / fs-read GB/s: 1.0 would mean HTTP (and TLS)
// cost nothing beyond reading the bytes.

const CACHE_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..", ".cache", "models");
const MB = 1024 * 1024;

// The downloader: GETs a URL on request and answers with the byte count (plain JS: no loader).
const CLIENT = `
const { parentPort } = require("node:worker_threads");
const http = require("node:http");
const https = require("node:https");
const agents = { "http:": new http.Agent({ keepAlive: true }), "https:": null };
parentPort.on("message", ({ url, ca }) => {
  const u = new URL(url);
  if (u.protocol === "https:" && !agents["https:"]) agents["https:"] = new https.Agent({ keepAlive: true, ca });
  const get = u.protocol === "https:" ? https.get : http.get;
  get(url, { agent: agents[u.protocol] }, (res) => {
    let n = 0;
    res.on("data", (c) => { n += c.length; });
    res.on("end", () => parentPort.postMessage({ bytes: n, status: res.statusCode }));
    res.on("error", (e) => parentPort.postMessage({ error: String(e) }));
  }).on("error", (e) => parentPort.postMessage({ error: String(e) }));
});
`;

function downloader() {
  const worker = new Worker(CLIENT, { eval: true });
  const get = (url: string, ca?: string) =>
    new Promise<number>((resolve, reject) => {
      worker.once("message", (m: { bytes?: number; status?: number; error?: string }) => {
        if (m.error || m.status !== 200) reject(new Error(m.error ?? `status ${m.status}`));
        else resolve(m.bytes as number);
      });
      worker.postMessage({ url, ca });
    });
  return { get, close: () => worker.terminate() };
}

/** The reference server: node:http piping fs read streams of the slab ranges, nothing else. */
function referenceServer(
  path: string,
  ranges: readonly { start: number; length: number }[],
  slabBytes: number,
) {
  return createServer(async (_req, res) => {
    res.writeHead(200, { "content-length": slabBytes });
    for (const r of ranges) {
      await pipeline(
        createReadStream(path, {
          start: r.start,
          end: r.start + r.length - 1,
          highWaterMark: MB, // the hub's read size: the same I/O pattern
        }),
        res,
        {
          end: false,
        },
      );
    }
    res.end();
  });
}

/** Download throughput against fs reads (and against the plain server), from the cases' samples in order. */
function downloadRatios(samples: number[][], sliceBytes: number, slabBytes: number): Record<string, number> {
  const [fs1, , plainNode, http1, http8, https1] = samples;
  // throughput ratios per round (both sides moved their own byte counts), then the median
  const tput = (bytes: number, baseline: number[], measured: number[]) =>
    pairedRatio(
      baseline.map((ns) => ns / slabBytes),
      measured.map((ns) => ns / bytes),
    );
  const ratios: Record<string, number> = {
    "http/fs-read": tput(sliceBytes, fs1!, http1!),
    "http-8MiB-chunks/fs-read": tput(sliceBytes, fs1!, http8!),
  };
  if (https1) ratios["https/fs-read"] = tput(sliceBytes, fs1!, https1);
  ratios["http/fs-read (best)"] = sliceBytes / Math.min(...http1!) / (slabBytes / Math.min(...fs1!));
  // the hub against the plainest Node server of the same bytes: what the hub itself costs
  ratios["http/plain-node-http"] = tput(
    sliceBytes,
    plainNode!.map((ns) => (ns * slabBytes) / sliceBytes),
    http1!,
  );
  return ratios;
}

export const expertShard: Benchmark = {
  name: "expert-shard",
  description:
    "download a 1-layer slice (all experts) of the medium synthetic model from the hub over loopback http/https vs fs reads of the same byte ranges",
  async run() {
    const notes: string[] = [];
    const t0 = performance.now();
    const model = await ensureSyntheticModel("medium", { cacheDir: CACHE_DIR });
    notes.push(
      `model ${model.path} (${(model.size / MB).toFixed(1)} MiB) ${model.created ? `generated in ${((performance.now() - t0) / 1000).toFixed(1)} s` : "reused from the cache"}`,
    );
    const { manifest } = await loadOrBuildManifest(model.path);
    const layer = manifest.layers[0]!;
    const ranges = layer.tensors.map((t) => ({ start: t.offset, length: t.nbytes }));
    const slabBytes = ranges.reduce((n, r) => n + r.length, 0);
    const query = `layers=${layer.layer}:${layer.layer + 1}&experts=0:${layer.nExpert}`;

    const secret = randomBytes(32).toString("hex");
    // no openssl: the https row is left out
    const tls = await createLoopbackCertificates({ hosts: ["127.0.0.1"], days: 1 }).catch(() => undefined);
    const hubs: Hub[] = [];
    const client = downloader();
    const handle = await open(model.path, "r");
    let plainServer: Server | undefined;
    try {
      const start = async (options: { chunkSize?: number; tls?: { cert: string; key: string } }) => {
        const hub = createHub({ secret, models: [{ id: "medium", path: model.path }], ...options });
        hubs.push(hub);
        return `${(await hub.listen(0)).url}/api/models/medium/expert-shard?${query}`;
      };
      const plain = await start({});
      const bigChunks = await start({ chunkSize: 8 * MB });
      const secure = tls ? await start({ tls: { cert: tls.cert, key: tls.key } }) : undefined;
      const sliceBytes = await client.get(plain);
      plainServer = referenceServer(model.path, ranges, slabBytes);
      await new Promise<void>((resolve) => plainServer!.listen(0, "127.0.0.1", resolve));
      const reference = `http://127.0.0.1:${(plainServer.address() as AddressInfo).port}/`;

      const fsRead = (chunk: number) => async () => {
        for (const r of ranges) {
          for (let p = 0; p < r.length; p += chunk) {
            const n = Math.min(chunk, r.length - p);
            await handle.read(new Uint8Array(n), 0, n, r.start + p);
          }
        }
      };
      const cases: Array<[string, () => Promise<unknown>]> = [
        ["fs read 1 MiB chunks (baseline)", fsRead(MB)],
        ["fs read 8 MiB chunks", fsRead(8 * MB)],
        ["plain node:http + 1 MiB fs streams of the ranges", () => client.get(reference)],
        ["http download (hub chunk 1 MiB, default)", () => client.get(plain)],
        ["http download (hub chunk 8 MiB)", () => client.get(bigChunks)],
      ];
      if (secure && tls) cases.push(["https download (hub chunk 1 MiB)", () => client.get(secure, tls.ca)]);
      const times = await interleaved(cases, { minTimeMs: 20_000, minRounds: 15, maxRounds: 80 });

      const rows: Row[] = times.map(({ label, samples }) => {
        const bytes = label.startsWith("fs") || label.startsWith("plain") ? slabBytes : sliceBytes;
        return {
          case: label,
          MiB: +(bytes / MB).toFixed(1),
          "median ms": +(median(samples) / 1e6).toFixed(2),
          "min ms": +(Math.min(...samples) / 1e6).toFixed(2),
          "GB/s": +gbPerSecond(bytes, median(samples)).toFixed(3),
        };
      });
      const ratios = downloadRatios(
        times.map((t) => t.samples),
        sliceBytes,
        slabBytes,
      );
      notes.push(
        `the slice is ${sliceBytes} bytes: ${slabBytes} of expert slabs plus its GGUF header (${sliceBytes - slabBytes} bytes, slab sha256s included)`,
        `${times[0]!.samples.length} interleaved rounds; the client is a worker thread of this process (keep-alive agent); 2 cores shared with other work: the min column is the steadier figure`,
        tls
          ? "https: TLS 1.3 with a P-256 certificate (createLoopbackCertificates), the production path (port 443)"
          : "no openssl: https not measured",
      );
      return { rows, ratios, notes };
    } finally {
      await client.close();
      await handle.close();
      await Promise.all(hubs.map((h) => h.close()));
      plainServer?.closeAllConnections();
      await new Promise<void>((resolve) => (plainServer ? plainServer.close(() => resolve()) : resolve()));
    }
  },
};
