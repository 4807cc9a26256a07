import { createHash } from "node:crypto";
import { copyFileSync, mkdtempSync, rmSync } from "node:fs";
import { request as httpRequest, type IncomingHttpHeaders } from "node:http";
import { request as httpsRequest } from "node:https";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { DispatchRequest } from "@moeswarm/relay-client";
import {
  ensureSyntheticModel,
  type IndexSelection,
  type SyntheticPreset,
  sliceExperts,
} from "@moeswarm/shard";

export { waitFor } from "@moeswarm/testkit";

/** Synthetic models are cached across runs (generation is deterministic; `small` takes seconds). */
export const MODEL_CACHE = process.env.MOESWARM_CACHE_DIR ?? join(tmpdir(), "moeswarm-hub-test-models");

export async function syntheticModel(preset: SyntheticPreset): Promise<string> {
  return (await ensureSyntheticModel(preset, { cacheDir: MODEL_CACHE })).path;
}

export interface TempDir {
  readonly dir: string;
  remove(): void;
}

export function tempDir(prefix = "moeswarm-hub-"): TempDir {
  const dir = mkdtempSync(join(tmpdir(), prefix));
  return { dir, remove: () => rmSync(dir, { recursive: true, force: true }) };
}

/** A private copy of a model file (tests that register, truncate or delete it). */
export function copyModel(from: string, dir: string, name: string): string {
  const to = join(dir, name);
  copyFileSync(from, to);
  return to;
}

export interface Answer {
  status: number;
  headers: IncomingHttpHeaders;
  body: Buffer;
}

export interface RequestOptions {
  method?: string;
  headers?: Record<string, string>;
  body?: string | Buffer;
  /** CA to trust for https. */
  ca?: string;
  /** Raw request target, sent as is (no URL normalisation: for path-escape tests). */
  path?: string;
}

/** One HTTP(S) request with node:http, the whole body buffered (small answers). */
export function call(url: string, options: RequestOptions = {}): Promise<Answer> {
  const u = new URL(url);
  const send = u.protocol === "https:" ? httpsRequest : httpRequest;
  return new Promise<Answer>((resolve, reject) => {
    const req = send(
      {
        host: u.hostname,
        port: u.port,
        path: options.path ?? `${u.pathname}${u.search}`,
        method: options.method ?? "GET",
        headers: options.headers,
        ca: options.ca,
        agent: false,
      },
      (res) => {
        const parts: Buffer[] = [];
        res.on("data", (c: Buffer) => parts.push(c));
        res.on("end", () =>
          resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(parts) }),
        );
        res.on("error", reject);
      },
    );
    req.on("error", reject);
    req.end(options.body);
  });
}

export function json(answer: Answer): unknown {
  return JSON.parse(answer.body.toString("utf8"));
}

export function sha256(bytes: Uint8Array): string {
  return createHash("sha256").update(bytes).digest("hex");
}

export async function collect(chunks: AsyncIterable<Uint8Array>): Promise<Buffer> {
  const parts: Buffer[] = [];
  for await (const c of chunks) parts.push(Buffer.from(c));
  return Buffer.concat(parts);
}

/**
 * Downloads `url` but stops after at least `stopAfter` bytes by calling `cut` (which breaks the
 * link: destroys the response, or kills a proxy in between). Resolves with what arrived.
 */
export function partialDownload(
  url: string,
  stopAfter: number,
  cut: (destroy: () => void) => void,
  options: RequestOptions = {},
): Promise<{ headers: IncomingHttpHeaders; status: number; received: Buffer; ended: boolean }> {
  const u = new URL(url);
  const send = u.protocol === "https:" ? httpsRequest : httpRequest;
  return new Promise((resolve, reject) => {
    const parts: Buffer[] = [];
    let received = 0;
    let cutDone = false;
    const req = send(
      {
        host: u.hostname,
        port: u.port,
        path: `${u.pathname}${u.search}`,
        headers: options.headers,
        ca: options.ca,
        agent: false,
      },
      (res) => {
        const finish = (ended: boolean) =>
          resolve({
            headers: res.headers,
            status: res.statusCode ?? 0,
            received: Buffer.concat(parts),
            ended,
          });
        res.on("data", (c: Buffer) => {
          parts.push(c);
          received += c.byteLength;
          if (!cutDone && received >= stopAfter) {
            cutDone = true;
            cut(() => res.destroy());
          }
        });
        res.on("end", () => finish(true));
        res.on("error", () => finish(false));
        res.on("close", () => finish(false));
      },
    );
    req.on("error", (error) => (cutDone ? undefined : reject(error)));
    req.end();
  });
}

/** One sample of the Prometheus exposition: `name{labels} value`. */
export interface Sample {
  name: string;
  labels: Record<string, string>;
  value: number;
}

const NAME = /^[a-zA-Z_:][a-zA-Z0-9_:]*$/;
const LABEL = /^([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\\n]|\\\\|\\"|\\n)*)"/;

/**
 * A strict reader of the Prometheus text format 0.0.4: every line is a HELP, a TYPE (before the
 * family's samples, once) or a sample whose name belongs to a declared family. Throws on
 * anything else, so a malformed exposition fails the test.
 */
export function parsePrometheus(text: string): { samples: Sample[]; types: Map<string, string> } {
  const types = new Map<string, string>();
  const seenSamples = new Set<string>();
  const samples: Sample[] = [];
  const lines = text.split("\n");
  if (lines.at(-1) !== "") throw new Error("the exposition must end with a newline");
  for (const [i, line] of lines.slice(0, -1).entries()) {
    const where = `line ${i + 1}: ${JSON.stringify(line)}`;
    if (line === "") continue;
    if (line.startsWith("# HELP ")) {
      const name = line.slice(7).split(" ")[0] ?? "";
      if (!NAME.test(name)) throw new Error(`bad HELP name, ${where}`);
      continue;
    }
    if (line.startsWith("# TYPE ")) {
      const [name = "", type = "", ...rest] = line.slice(7).split(" ");
      if (!NAME.test(name) || rest.length > 0) throw new Error(`bad TYPE, ${where}`);
      if (!["counter", "gauge", "histogram", "summary", "untyped"].includes(type)) {
        throw new Error(`unknown type, ${where}`);
      }
      if (types.has(name) || seenSamples.has(name)) throw new Error(`TYPE after samples or twice, ${where}`);
      types.set(name, type);
      continue;
    }
    if (line.startsWith("#")) continue;
    const brace = line.indexOf("{");
    const space = line.indexOf(" ");
    const nameEnd = brace >= 0 && brace < space ? brace : space;
    const name = line.slice(0, nameEnd);
    if (!NAME.test(name)) throw new Error(`bad sample name, ${where}`);
    const labels: Record<string, string> = {};
    let rest = line.slice(nameEnd);
    if (rest.startsWith("{")) {
      rest = rest.slice(1);
      while (!rest.startsWith("}")) {
        const m = LABEL.exec(rest);
        if (!m) throw new Error(`bad label, ${where}`);
        labels[m[1] as string] = (m[2] as string)
          .replace(/\\n/g, "\n")
          .replace(/\\"/g, '"')
          .replace(/\\\\/g, "\\");
        rest = rest.slice(m[0].length);
        if (rest.startsWith(",")) rest = rest.slice(1);
        else if (!rest.startsWith("}")) throw new Error(`bad label list, ${where}`);
      }
      rest = rest.slice(1);
    }
    const fields = rest.trim().split(" ");
    if (fields.length < 1 || fields.length > 2) throw new Error(`bad value, ${where}`);
    const raw = fields[0] as string;
    const value = raw === "+Inf" ? Infinity : raw === "-Inf" ? -Infinity : raw === "NaN" ? NaN : Number(raw);
    if (raw === "" || (Number.isNaN(value) && raw !== "NaN")) throw new Error(`bad value, ${where}`);
    const family = [name, name.replace(/_(bucket|sum|count|total)$/, "")].find((n) => types.has(n));
    if (family === undefined) throw new Error(`sample of an undeclared family, ${where}`);
    seenSamples.add(family);
    samples.push({ name, labels, value });
  }
  return { samples, types };
}

/** The value of the sample with this name and these labels (0 when absent). */
export function sampleValue(
  samples: readonly Sample[],
  name: string,
  labels: Record<string, string> = {},
): number {
  const hit = samples.find(
    (s) => s.name === name && Object.entries(labels).every(([k, v]) => s.labels[k] === v),
  );
  return hit?.value ?? 0;
}

/** The bytes of shard's own slice of a model file (the reference the hub's answers must equal). */
export async function referenceSlice(
  path: string,
  options: { layers: IndexSelection; experts: IndexSelection },
): Promise<Buffer> {
  const slice = await sliceExperts(path, options);
  try {
    return await collect(slice.stream());
  } finally {
    await slice.close();
  }
}

/**
 * A backbone's dispatch of `ids` (n*k expert ids, -1 empty) for one layer through the relay, with
 * zero activations of width 2: what the hub's relay counts when it bounds stats reports.
 * Settles with the worker's answer or error (fake workers often answer nothing useful).
 */
export function relayDispatch(
  backbone: { request(to: string, r: DispatchRequest): Promise<unknown> },
  to: string,
  model: string,
  layer: number,
  ids: Int32Array,
  k: number,
): Promise<unknown> {
  const n = ids.length / k;
  return backbone.request(to, {
    model,
    layer,
    n,
    embd: 2,
    k,
    x: new Float32Array(n * 2),
    ids,
    mode: "each",
  });
}
