import {
  bufferSource,
  buildManifest,
  parseManifest,
  readGguf,
  type SliceManifest,
  verifySlice,
} from "@moeswarm/shard";
import { beforeAll, describe, expect, it } from "vitest";
import { createHub } from "../src/index.js";
import { startProxy } from "./helpers.js";
import {
  call,
  json,
  parsePrometheus,
  partialDownload,
  referenceSlice,
  sampleValue,
  sha256,
  waitFor,
} from "./hub-helpers.js";
import { ID, SECRET, useHub } from "./hub-http-fixture.js";

// the hub of this file (hub-http-fixture.ts), started before its tests and closed after them
const fx = useHub();
const { shardUrl } = fx;

describe("models and manifests", () => {
  it("lists the model with its shape, sizes and header sha256", async () => {
    const a = await call(`${fx.base}/api/models`);
    expect(a.status).toBe(200);
    expect(a.headers["content-type"]).toMatch(/^application\/json/);
    const { models } = json(a) as { models: Array<Record<string, unknown>> };
    expect(models).toHaveLength(1);
    const header = await readGguf(fx.tinyPath);
    const fresh = await buildManifest(fx.tinyPath);
    const m = models[0]!;
    expect(m).toMatchObject({
      id: ID,
      arch: "qwen3moe",
      layers: 2,
      moeLayers: ["0:2"],
      experts: 8,
      expertsUsed: 2,
      fileSize: Number(header.fileSize),
      headerSha256: fresh.source.headerSha256,
      expertBytes: fresh.layers[0]!.bytesPerExpert,
      expertBytesTotal: fresh.layers.reduce((n, l) => n + l.bytesPerExpert * l.nExpert, 0),
    });
    const one = await call(`${fx.base}/api/models/${ID}`);
    expect(json(one)).toEqual(m);
  });

  it("serves the manifest, equal to one built afresh from the file, with an ETag", async () => {
    const a = await call(`${fx.base}/api/models/${ID}/manifest`);
    expect(a.status).toBe(200);
    const served = parseManifest(json(a));
    const fresh = await buildManifest(fx.tinyPath);
    expect({ ...served, source: { ...served.source, mtimeMs: null } }).toEqual(fresh);
    const etag = a.headers.etag as string;
    expect(etag).toMatch(/^"[A-Za-z0-9_-]+"$/);
    const again = await call(`${fx.base}/api/models/${ID}/manifest`, { headers: { "if-none-match": etag } });
    expect(again.status).toBe(304);
    expect(again.body.byteLength).toBe(0);
  });
});

describe("expert-shard", () => {
  let manifest: SliceManifest;
  beforeAll(async () => {
    manifest = parseManifest(json(await call(`${fx.base}/api/models/${ID}/manifest`)));
  });

  it.each([
    ["layers=0:1&experts=0:8", { start: 0, end: 1 }, { start: 0, end: 8 }],
    ["layers=1&experts=3:6", { start: 1, end: 2 }, { start: 3, end: 6 }],
    ["experts=0:8&layers=0:2", { start: 0, end: 2 }, { start: 0, end: 8 }],
  ])(
    "%s: the bytes of shard's sliceExperts, verified against the manifest",
    async (query, layers, experts) => {
      const a = await call(shardUrl(query));
      expect(a.status).toBe(200);
      // the reference: sliced in this process without the manifest (it hashes the slabs itself)
      const reference = await referenceSlice(fx.tinyPath, { layers, experts });
      expect(Number(a.headers["content-length"])).toBe(reference.byteLength);
      expect(a.body.byteLength).toBe(reference.byteLength);
      expect(sha256(a.body)).toBe(sha256(reference));
      expect(a.headers["content-type"]).toBe("application/octet-stream");
      expect(a.headers["accept-ranges"]).toBe("bytes");
      expect(a.headers["x-moeswarm-source-sha256"]).toBe(manifest.source.headerSha256);
      const verified = await verifySlice(bufferSource(a.body), manifest);
      expect(verified.layers).toEqual(
        Array.from({ length: layers.end - layers.start }, (_, i) => layers.start + i),
      );
      expect(verified.experts).toEqual(
        Array.from({ length: experts.end - experts.start }, (_, i) => experts.start + i),
      );
      expect(verified.slabs).toBe(verified.layers.length * 3 * verified.experts.length);
    },
  );

  it("gives a strong ETag that depends on the normalised query only", async () => {
    const a = await call(shardUrl("layers=0:1&experts=0:4"), { method: "HEAD" });
    const b = await call(shardUrl("experts=0:4&layers=0&extra=1"), { method: "HEAD" });
    const c = await call(shardUrl("layers=0:1&experts=0:5"), { method: "HEAD" });
    expect(a.headers.etag).toMatch(/^"[A-Za-z0-9_-]{43}"$/);
    expect(b.headers.etag).toBe(a.headers.etag);
    expect(c.headers.etag).not.toBe(a.headers.etag);
    // a second hub on the same file (a restart) gives the same tag
    const other = createHub({ secret: SECRET, models: [{ id: "again", path: fx.tinyPath }] });
    try {
      const url = (await other.listen(0)).url;
      const d = await call(`${url}/api/models/again/expert-shard?layers=0:1&experts=0:4`, { method: "HEAD" });
      expect(d.headers.etag).toBe(a.headers.etag);
    } finally {
      await other.close();
    }
  });

  it("answers HEAD with the headers of GET and no body", async () => {
    const get = await call(shardUrl("layers=0:2&experts=2:7"));
    const head = await call(shardUrl("layers=0:2&experts=2:7"), { method: "HEAD" });
    expect(head.status).toBe(200);
    expect(head.body.byteLength).toBe(0);
    for (const h of ["content-length", "etag", "accept-ranges", "content-type", "content-disposition"]) {
      expect(head.headers[h]).toBe(get.headers[h]);
    }
  });

  it("serves byte ranges: 206 with Content-Range, open-ended and suffix forms", async () => {
    const full = (await call(shardUrl("layers=0:1&experts=0:8"))).body;
    const n = full.byteLength;
    const cases: Array<[string, number, number]> = [
      ["bytes=0-99", 0, 100],
      ["bytes=1000-", 1000, n],
      ["bytes=-500", n - 500, n],
      [`bytes=${n - 1}-${n + 1000}`, n - 1, n],
      ["bytes=4096-8191", 4096, 8192],
    ];
    for (const [range, start, end] of cases) {
      const a = await call(shardUrl("layers=0:1&experts=0:8"), { headers: { range } });
      expect(a.status, range).toBe(206);
      expect(a.headers["content-range"]).toBe(`bytes ${start}-${end - 1}/${n}`);
      expect(Number(a.headers["content-length"])).toBe(end - start);
      expect(a.body.equals(full.subarray(start, end)), range).toBe(true);
    }
    // several ranges, another unit or a malformed header: served whole, as RFC 9110 allows
    for (const range of ["bytes=0-1,5-6", "items=0-5", "bytes=abc", "bytes=9-3"]) {
      const a = await call(shardUrl("layers=0:1&experts=0:8"), { headers: { range } });
      expect(a.status, range).toBe(200);
      expect(a.body.equals(full)).toBe(true);
    }
  });

  it("answers 416 with Content-Range for unsatisfiable ranges", async () => {
    const n = Number(
      (await call(shardUrl("layers=0:1&experts=0:8"), { method: "HEAD" })).headers["content-length"],
    );
    for (const range of [
      `bytes=${n}-`,
      `bytes=${n + 10}-${n + 20}`,
      "bytes=-0",
      "bytes=99999999999999999999-",
    ]) {
      const a = await call(shardUrl("layers=0:1&experts=0:8"), { headers: { range } });
      expect(a.status, range).toBe(416);
      expect(a.headers["content-range"]).toBe(`bytes */${n}`);
      expect(json(a)).toMatchObject({ error: { code: "MOESWARM_HUB_RANGE_NOT_SATISFIABLE" } });
    }
  });

  it("honours If-Range only with the current ETag, and If-None-Match", async () => {
    const url = shardUrl("layers=1:2&experts=0:8");
    const full = await call(url);
    const etag = full.headers.etag as string;
    const same = await call(url, { headers: { range: "bytes=10-19", "if-range": etag } });
    expect(same.status).toBe(206);
    expect(same.body.equals(full.body.subarray(10, 20))).toBe(true);
    for (const stale of ['"not-this-one"', `W/${etag}`, "Sun, 29 Nov 2026 00:00:00 GMT"]) {
      const a = await call(url, { headers: { range: "bytes=10-19", "if-range": stale } });
      expect(a.status, stale).toBe(200);
      expect(a.body.equals(full.body)).toBe(true);
    }
    const cached = await call(url, { headers: { "if-none-match": `"x", ${etag}` } });
    expect(cached.status).toBe(304);
    expect(cached.headers.etag).toBe(etag);
    expect(cached.body.byteLength).toBe(0);
  });

  it("resumes a download cut halfway (response destroyed) with Range into identical bytes", async () => {
    const url = shardUrl("layers=0:2&experts=0:8");
    const full = await call(url);
    const total = full.body.byteLength;
    const part = await partialDownload(url, total >> 1, (destroy) => destroy());
    expect(part.ended).toBe(false);
    expect(part.received.byteLength).toBeLessThan(total);
    const rest = await call(url, {
      headers: { range: `bytes=${part.received.byteLength}-`, "if-range": part.headers.etag as string },
    });
    expect(rest.status).toBe(206);
    const joined = Buffer.concat([part.received, rest.body]);
    expect(sha256(joined)).toBe(sha256(full.body));
    await verifySlice(bufferSource(joined), manifest);
  });

  it("resumes a download whose connection a proxy kills halfway", async () => {
    const port = Number(new URL(fx.base).port);
    const proxy = await startProxy(port);
    try {
      const path = "/api/models/tiny/expert-shard?layers=0:2&experts=1:7";
      const full = await call(`${fx.base}${path}`);
      const part = await partialDownload(`http://127.0.0.1:${proxy.port}${path}`, 20_000, () => proxy.kill());
      expect(part.received.byteLength).toBeLessThan(full.body.byteLength);
      const rest = await call(`http://127.0.0.1:${proxy.port}${path}`, {
        headers: { range: `bytes=${part.received.byteLength}-`, "if-range": part.headers.etag as string },
      });
      expect(rest.status).toBe(206);
      const joined = Buffer.concat([part.received, rest.body]);
      expect(sha256(joined)).toBe(sha256(full.body));
      await verifySlice(bufferSource(joined), manifest);
      // the cut download let go of the file: nothing is streaming any more
      await waitFor(async () => {
        const { samples } = parsePrometheus((await call(`${fx.base}/metrics`)).body.toString());
        return sampleValue(samples, "moeswarm_http_downloads_in_flight") === 0;
      }, "the cut download to end");
    } finally {
      await proxy.close();
    }
  });
});
