import { createHash, randomBytes } from "node:crypto";
import { existsSync, mkdtempSync, readFileSync, rmSync, symlinkSync, writeFileSync } from "node:fs";
import { createServer, type IncomingHttpHeaders, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { isMoeswarmError } from "@moeswarm/core";
import { afterAll, afterEach, beforeAll, describe, expect, it } from "vitest";
import { downloadResumable } from "../src/download.js";

/**
 * A file server with the hub's resume semantics (Range + If-Range against a strong ETag) that
 * misbehaves on demand: cuts the connection after some bytes, stalls, or changes the file.
 */
interface Plan {
  /** Per request: cut after this many body bytes (undefined: send it all). */
  cutAfter?: Array<number | undefined>;
  /** Per request: stop sending (socket stays open) after this many bytes. */
  stallAfter?: Array<number | undefined>;
  /** Replace the file before answering request n (0-based). */
  changeBefore?: number;
  status?: number;
}

let server: Server;
let base: string;
let file = randomBytes(300_000);
let plan: Plan = {};
let seen: IncomingHttpHeaders[] = [];
const etagOf = (b: Buffer) => `"${createHash("sha256").update(b).digest("hex").slice(0, 16)}"`;

beforeAll(async () => {
  server = createServer((req, res) => {
    const n = seen.length;
    seen.push(req.headers);
    if (plan.changeBefore === n) file = randomBytes(file.length);
    if (plan.status) {
      res.writeHead(plan.status, { "content-type": "application/json" });
      res.end(JSON.stringify({ error: { code: "MOESWARM_HUB_NOT_FOUND", message: "no such slice" } }));
      return;
    }
    const etag = etagOf(file);
    let start = 0;
    const range = /^bytes=(\d+)-$/.exec(String(req.headers.range ?? ""));
    const partial = range !== null && req.headers["if-range"] === etag;
    if (partial) start = Number(range[1]);
    const body = file.subarray(start);
    res.writeHead(partial ? 206 : 200, {
      etag,
      "accept-ranges": "bytes",
      "content-length": String(body.length),
      ...(partial ? { "content-range": `bytes ${start}-${file.length - 1}/${file.length}` } : {}),
    });
    const cut = plan.cutAfter?.[n];
    const stall = plan.stallAfter?.[n];
    if (cut !== undefined) {
      res.write(body.subarray(0, cut), () => setTimeout(() => res.socket?.destroy(), 20));
    } else if (stall !== undefined) {
      res.write(body.subarray(0, stall));
    } else {
      res.end(body);
    }
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  base = `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
});

afterAll(async () => {
  server.closeAllConnections();
  await new Promise((r) => server.close(r));
});

let dir: string;
afterEach(() => {
  plan = {};
  seen = [];
  if (dir) rmSync(dir, { recursive: true, force: true });
});

function fresh(): string {
  dir = mkdtempSync(join(tmpdir(), "moeswarm-download-"));
  return join(dir, "slice.gguf");
}

const fast = { initialDelayMs: 5, maxDelayMs: 20 };

describe("downloadResumable", () => {
  it("resumes a body cut mid-way with Range and If-Range, and ends with the exact bytes", async () => {
    const dest = fresh();
    plan = { cutAfter: [100_000, 50_000] };
    const retries: number[] = [];
    const r = await downloadResumable(`${base}/slice`, dest, {
      ...fast,
      onRetry: (x) => retries.push(x.received),
    });
    expect(readFileSync(dest).equals(file)).toBe(true);
    expect(r).toMatchObject({
      bytes: file.length,
      requests: 3,
      resumes: 2,
      reusedBytes: 0,
      etag: etagOf(file),
    });
    expect(seen[0]?.range).toBeUndefined();
    // each retry asks for exactly what is missing, guarded by the ETag of what it holds
    expect(seen[1]?.range).toBe(`bytes=${retries[0]}-`);
    expect(seen[1]?.["if-range"]).toBe(etagOf(file));
    expect(seen[2]?.range).toBe(`bytes=${retries[1]}-`);
    expect(retries[0]).toBeGreaterThan(0);
    // the server destroys the socket shortly after handing the bytes to the kernel, so how many of
    // them the client read before the cut depends on scheduling: never fewer than before
    expect(retries[1]).toBeGreaterThanOrEqual(retries[0] as number);
    expect(existsSync(`${dest}.part`)).toBe(false);
    expect(existsSync(`${dest}.part.json`)).toBe(false);
  });

  it("takes the whole new file when it changed between two requests (If-Range failed)", async () => {
    const dest = fresh();
    plan = { cutAfter: [120_000], changeBefore: 1 };
    const before = etagOf(file);
    const retries: number[] = [];
    const r = await downloadResumable(`${base}/slice`, dest, {
      ...fast,
      onRetry: (x) => retries.push(x.received),
    });
    expect(etagOf(file)).not.toBe(before);
    expect(readFileSync(dest).equals(file)).toBe(true);
    expect(seen[1]?.range).toBe(`bytes=${retries[0]}-`);
    expect(seen[1]?.["if-range"]).toBe(before);
    expect(r).toMatchObject({ requests: 2, resumes: 0, etag: etagOf(file) });
  });

  it("continues a partial file left by an earlier run", async () => {
    const dest = fresh();
    plan = { cutAfter: [150_000] };
    const error = await downloadResumable(`${base}/slice`, dest, { ...fast, maxAttempts: 1 }).catch((e) => e);
    expect(isMoeswarmError(error, "MOESWARM_TRANSPORT_CLOSED")).toBe(true);
    expect(existsSync(`${dest}.part`)).toBe(true);
    plan = {};
    seen = [];
    const r = await downloadResumable(`${base}/slice`, dest, fast);
    expect(readFileSync(dest).equals(file)).toBe(true);
    expect(r.reusedBytes).toBeGreaterThan(0);
    expect(r.requests).toBe(1);
    expect(seen[0]?.range).toBe(`bytes=${r.reusedBytes}-`);
  });

  it("cuts a body that stalls and resumes it", async () => {
    const dest = fresh();
    plan = { stallAfter: [80_000] };
    const r = await downloadResumable(`${base}/slice`, dest, { ...fast, idleTimeoutMs: 150 });
    expect(readFileSync(dest).equals(file)).toBe(true);
    expect(r.resumes).toBe(1);
  });

  it("gives up after maxAttempts failures in a row without progress", async () => {
    const dest = fresh();
    // an attempt that brings new bytes starts the count again
    plan = { cutAfter: [1000, 0, 1000, 0, 0, 0, 0] };
    const error = await downloadResumable(`${base}/slice`, dest, { ...fast, maxAttempts: 3 }).catch((e) => e);
    expect(isMoeswarmError(error, "MOESWARM_TRANSPORT_CLOSED")).toBe(true);
    expect(error.message).toMatch(/failed 3 times in a row/);
    expect(seen.length).toBe(5);
    expect(seen[4]?.range).toBe("bytes=2000-");
  });

  it("does not retry what retrying cannot fix (a 404 from the hub)", async () => {
    const dest = fresh();
    plan = { status: 404 };
    const error = await downloadResumable(`${base}/slice`, dest, fast).catch((e) => e);
    expect(isMoeswarmError(error, "MOESWARM_HUB_NOT_FOUND")).toBe(true);
    expect(seen.length).toBe(1);
  });

  it("a full disk is the disk's error (MOESWARM_IO_NO_SPACE), not the hub's, and is not retried", async () => {
    const dest = fresh();
    // the partial file is /dev/full: every write fails with ENOSPC, as on a full phone
    symlinkSync("/dev/full", `${dest}.part`);
    const retries: unknown[] = [];
    const error = await downloadResumable(`${base}/slice`, dest, {
      ...fast,
      onRetry: (r) => retries.push(r),
    }).catch((e) => e);
    expect(isMoeswarmError(error, "MOESWARM_IO_NO_SPACE"), String(error)).toBe(true);
    expect(error.message).toMatch(/writing .*slice\.gguf\.part/);
    expect(retries).toEqual([]);
    expect(seen.length).toBe(1);
  });

  it("a destination it cannot create is a local error too (ENOTDIR: MOESWARM_IO_NOT_FOUND), after one request", async () => {
    const dest = fresh();
    writeFileSync(join(dir, "not-a-dir"), "x");
    const error = await downloadResumable(`${base}/slice`, join(dir, "not-a-dir", "slice.gguf"), fast).catch(
      (e) => e,
    );
    expect(isMoeswarmError(error, "MOESWARM_IO_NOT_FOUND"), String(error)).toBe(true);
    expect(seen.length).toBe(1);
    expect(dest).toBeDefined();
  });

  it("rejects with the signal's reason: already aborted, and aborted mid-body", async () => {
    const dest = fresh();
    const reason = new Error("stop");
    await expect(
      downloadResumable(`${base}/slice`, dest, { signal: AbortSignal.abort(reason) }),
    ).rejects.toBe(reason);
    expect(seen.length).toBe(0);
    plan = { stallAfter: [10_000] };
    const controller = new AbortController();
    const p = downloadResumable(`${base}/slice`, dest, {
      signal: controller.signal,
      onProgress: () => controller.abort(reason),
    });
    await expect(p).rejects.toBe(reason);
    expect(existsSync(dest)).toBe(false);
  });
});
