// Reusing a cache never fragments placement: a worker whose cache holds small slices from earlier
// runs (another capacity, replicas) claims what a fresh worker would, downloading it, and later
// restarts reuse that slice: the placement shape of a fresh worker every time. A real hub serves
// the synthetic qwen3moe `small` model (4 MoE layers x 64 experts); the workers run in this process.
import { join } from "node:path";
import { type Hub, mintToken } from "@moeswarm/hub";
import type { TempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { WorkerEvent } from "../src/events.js";
import { runWorker, type WorkerSummary } from "../src/run-worker.js";
import { type PlacementJson, startTestHub, waitPlacement as waitPlacementOf } from "./fixtures.js";

const MODEL = "qwen3moe-small";
const SECRET = "worker-cache-shape-test-secret-0123456789";

let hub: Hub;
let url: string;
let bytesPerExpert: number;
let workDir: TempDir | undefined;

beforeAll(async () => {
  ({
    hub,
    url,
    work: workDir,
  } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "small",
    workPrefix: "moeswarm-worker-cache-shape-",
    leaseTtlMs: 30_000,
  }));
  const info = (await (await fetch(`${url}/api/models/${MODEL}`)).json()) as { expertBytes: number };
  bytesPerExpert = info.expertBytes;
});

afterAll(async () => {
  await hub?.close();
  workDir?.remove();
});

const span = (values: number[]) => `${values[0]}:${(values.at(-1) as number) + 1}`;
const shapeOf = (p: PlacementJson, id: string) =>
  p.registrations
    .filter((r) => r.id === id)
    .map((r) => `L${span(r.layers)} E${span(r.experts)}`)
    .sort();

/** Runs a worker of `experts` experts' capacity until it is full, returns its placement shape. */
async function runUntilFull(id: string, experts: number, cacheDir: string) {
  const controller = new AbortController();
  const events: WorkerEvent[] = [];
  let full!: () => void;
  const isFull = new Promise<void>((resolve) => {
    full = resolve;
  });
  const done: Promise<WorkerSummary> = runWorker({
    hub: url,
    token: mintToken({ role: "worker", id, ttlS: 600 }, SECRET),
    capacity: { ramBytes: experts * bytesPerExpert },
    cacheDir,
    threads: 1,
    pollMs: 100,
    signal: controller.signal,
    log: (e) => {
      events.push(e);
      if (e.event === "idle" && e.reason === "full") full();
    },
  });
  await Promise.race([isFull, done]);
  const p = await waitPlacementOf(url, MODEL, `${id} registered`, (x) => shapeOf(x, id).length > 0);
  const shape = shapeOf(p, id);
  controller.abort("restart");
  const summary = await done;
  await waitPlacementOf(url, MODEL, `${id} gone`, (x) => shapeOf(x, id).length === 0, { timeoutMs: 5000 });
  return { shape, summary, events };
}

describe("a reused cache and placement", () => {
  it("a worker restarted with small cached slices ends with a fresh worker's shape, and reuses it after", async () => {
    const work = (workDir as TempDir).dir;
    const fresh = await runUntilFull("fresh", 64, join(work, "cache-fresh"));
    expect(fresh.shape).toEqual(["L0:1 E0:64"]); // one whole layer: a token's layer is one request

    // earlier runs with less room leave small slices in the cache
    const cacheDir = join(work, "cache-reused");
    expect((await runUntilFull("reused", 16, cacheDir)).shape).toEqual(["L0:1 E0:16"]);
    expect((await runUntilFull("reused", 8, cacheDir)).shape).toEqual(["L0:1 E0:8"]);

    // a whole layer's room: the whole layer, not the cached 0:8 plus the rest of the layer
    const grown = await runUntilFull("reused", 64, cacheDir);
    expect(grown.shape).toEqual(fresh.shape);
    expect(grown.summary.slices.map((s) => s.reused)).toEqual([false]);

    // restarted twice: the same shape from the cache, no byte downloaded
    for (let i = 0; i < 2; i++) {
      const again = await runUntilFull("reused", 64, cacheDir);
      expect(again.shape).toEqual(fresh.shape);
      expect(again.summary.downloadedBytes).toBe(0);
      expect(again.summary.slices.map((s) => s.reused)).toEqual([true]);
      expect(again.events.filter((e) => e.event === "cached")).toHaveLength(1);
    }
  });
});
