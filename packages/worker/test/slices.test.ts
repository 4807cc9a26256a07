// Workers that hold several slices: runWorker (in this process, native compute when it loads)
// against a hub serving the synthetic qwen3moe `small` model (4 MoE layers x 64 experts). With
// capacity to spare a worker keeps claiming, so greedy rectangles leave no strip uncovered; a
// dispatch whose slots span two of a worker's slices gets the bits of one compute over the whole
// model; a restart reuses every cached slice; the hub drains a worker over HTTP.
import { existsSync, mkdirSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { type Hub, mintToken } from "@moeswarm/hub";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import type { TempDir } from "@moeswarm/testkit";
import { loadExpertCompute } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { WorkerEvent } from "../src/events.js";
import { runWorker, type WorkerSummary } from "../src/run-worker.js";
import {
  bitsEqual,
  complete,
  firstBitDiff,
  normals,
  type PlacementJson,
  randomWeights,
  startTestHub,
  waitPlacement as waitPlacementOf,
} from "./fixtures.js";

const MODEL = "qwen3moe-small";
const SECRET = "worker-slices-test-secret-0123456789abcdef";
const LAYERS = 4;
const EXPERTS = 64;

let hub: Hub;
let url: string;
let relayUrl: string;
let modelPath: string;
let bytesPerExpert: number;
let work: string;
let workDir: TempDir | undefined;
const open: RelayConnection[] = [];

const token = (role: "worker" | "backbone" | "admin", id?: string) =>
  mintToken({ role, ...(id === undefined ? {} : { id }), ttlS: 600 }, SECRET);
const range = (start: number, end: number) => Array.from({ length: end - start }, (_, i) => start + i);
const span = (values: number[]) => `${values[0]}:${(values.at(-1) as number) + 1}`;

beforeAll(async () => {
  ({
    hub,
    url,
    relayUrl,
    modelPath,
    work: workDir,
  } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "small",
    workPrefix: "moeswarm-worker-slices-",
    leaseTtlMs: 30_000,
  }));
  work = workDir.dir;
  const info = (await (await fetch(`${url}/api/models/${MODEL}`)).json()) as { expertBytes: number };
  bytesPerExpert = info.expertBytes;
});

afterAll(async () => {
  await Promise.all(open.map((c) => c.close()));
  await hub?.close();
  workDir?.remove();
});

const waitPlacement = (what: string, test: (p: PlacementJson) => boolean, timeoutMs = 45_000) =>
  waitPlacementOf(url, MODEL, what, test, { timeoutMs });

/** A runWorker in this process, with its events, stopped by its controller or by the hub. */
function start(id: string, capacity: number, cacheDir = join(work, `cache-${id}`), cacheMaxBytes?: number) {
  const controller = new AbortController();
  const events: WorkerEvent[] = [];
  const done: Promise<WorkerSummary> = runWorker({
    hub: url,
    token: token("worker", id),
    capacity: { ramBytes: capacity },
    cacheDir,
    ...(cacheMaxBytes !== undefined ? { cacheMaxBytes } : {}),
    threads: 1,
    pollMs: 100,
    signal: controller.signal,
    log: (e) => events.push(e),
  });
  return { id, controller, events, done, cacheDir };
}

async function drainFromHub(id: string, reason?: string): Promise<Response> {
  return fetch(`${url}/api/workers/${id}/drain`, {
    method: "POST",
    headers: { authorization: `Bearer ${token("admin")}`, "content-type": "application/json" },
    ...(reason === undefined ? {} : { body: JSON.stringify({ reason }) }),
  });
}

describe("a worker's cache under --cache-max", () => {
  it("deletes a stale slice of another model to make room for the one it downloads", async () => {
    const cacheDir = join(work, "cache-pruner");
    // a slice another model left behind, as big as this model's whole expert weights
    const whole = LAYERS * EXPERTS * bytesPerExpert;
    const stale = join(cacheDir, "gone-model", "0-1_0-8.gguf");
    mkdirSync(dirname(stale), { recursive: true });
    writeFileSync(stale, Buffer.alloc(whole));
    writeFileSync(
      stale.replace(/\.gguf$/, ".json"),
      JSON.stringify({ model: "gone-model", layers: "0:1", experts: "0:8", fileBytes: whole, savedAt: 1 }),
    );
    const w = start("pruner", whole * 2, cacheDir, Math.ceil(whole * 1.5));
    await waitPlacement("complete coverage", complete);
    const pruned = w.events.filter((e) => e.event === "cache-pruned");
    expect(pruned.length).toBeGreaterThanOrEqual(1);
    expect(pruned[0]).toMatchObject({ fits: true, removed: [{ path: stale, kind: "slice", bytes: whole }] });
    expect(existsSync(stale)).toBe(false);
    expect((await drainFromHub("pruner")).status).toBe(200);
    expect(await w.done).toMatchObject({ reason: "drain", served: true });
    await waitPlacement("nobody", (x) => x.registrations.length === 0, 5000);
  });
});

describe("workers with several slices", () => {
  it("two workers with 15% slack cover the model with whole layers: one owner per layer", async () => {
    const capacity = Math.ceil(((LAYERS * EXPERTS * bytesPerExpert) / 2) * 1.15);
    const a = start("two-a", capacity);
    const b = start("two-b", capacity);
    const p = await waitPlacement("complete coverage", complete);
    const rects = (id: string) =>
      p.registrations.filter((r) => r.id === id).map((r) => `L${span(r.layers)} E${span(r.experts)}`);
    // layers 0:3 x experts 0:49 would be the largest rectangle that fits, but two whole layers are
    // worth more than half of it, and a token's layer then costs one request
    expect([...rects("two-a"), ...rects("two-b")].sort()).toEqual(["L0:2 E0:64", "L2:4 E0:64"]);
    expect(rects("two-a")).toHaveLength(1);
    const cells = p.registrations.reduce((n, r) => n + r.layers.length * r.experts.length, 0);
    expect(cells).toBe(LAYERS * EXPERTS);

    // the hub drains both over HTTP: each finishes, deregisters every slice and resolves
    expect((await drainFromHub("two-a", "maintenance")).status).toBe(200);
    expect((await drainFromHub("two-b")).status).toBe(200);
    const [sa, sb] = await Promise.all([a.done, b.done]);
    expect(sa).toMatchObject({ reason: "drain", served: true });
    expect(sb).toMatchObject({ reason: "drain", served: true });
    expect([sa, sb].map((s) => s.slices.length)).toEqual([1, 1]);
    expect(a.events.find((e) => e.event === "drain")).toMatchObject({ reason: "the hub asked: maintenance" });
    expect(b.events.find((e) => e.event === "drain")).toMatchObject({ reason: "the hub asked" });
    expect((await drainFromHub("two-a")).status).toBe(404); // gone
    await waitPlacement("nobody", (x) => x.registrations.length === 0, 5000);
  });

  it("three equal workers with 15% slack cover the model, every cell once", async () => {
    const capacity = Math.ceil(((LAYERS * EXPERTS * bytesPerExpert) / 3) * 1.15);
    const ws = ["three-a", "three-b", "three-c"].map((id) => start(id, capacity));
    const p = await waitPlacement("complete coverage", complete);
    expect(p.registrations.reduce((n, r) => n + r.layers.length * r.experts.length, 0)).toBe(
      LAYERS * EXPERTS,
    );
    for (const w of ws) {
      const held = p.registrations.filter((r) => r.id === w.id);
      expect(held.length, w.id).toBeGreaterThan(0);
      expect(
        held.reduce((n, r) => n + r.layers.length * r.experts.length, 0) * bytesPerExpert,
      ).toBeLessThanOrEqual(capacity);
    }
    for (const w of ws) w.controller.abort("test done");
    for (const s of await Promise.all(ws.map((w) => w.done)))
      expect(s).toMatchObject({ reason: "signal", served: true });
    await waitPlacement("nobody", (x) => x.registrations.length === 0, 5000);
  });

  it("answers a dispatch spanning two of its slices with the bits of one compute, and reuses both after a restart", async () => {
    // another worker serves layers 1:4 and experts 16:48 of layer 0: what is left of layer 0 is two
    // runs, 0:16 and 48:64, which a worker with room for 32 experts takes as two slices
    const other = await connectRelay(relayUrl, {
      role: "worker",
      id: "other",
      token: token("worker", "other"),
      reconnect: false,
      onDispatch: () => ({ y: new Float32Array(0) }),
    });
    open.push(other);
    // the hub registers only what a lease of the worker covers: claim both slices first
    for (const [layers, experts] of [
      ["1:4", "0:64"],
      ["0:1", "16:48"],
    ]) {
      const claimed = await fetch(`${url}/api/claims`, {
        method: "POST",
        headers: { authorization: `Bearer ${token("worker", "other")}`, "content-type": "application/json" },
        body: JSON.stringify({ model: MODEL, layers, experts, capacity: { ramBytes: 2 ** 40 } }),
      });
      expect(claimed.status).toBe(201);
    }
    other.register({ model: MODEL, layers: [1, 2, 3], experts: range(0, 64) });
    other.register({ model: MODEL, layers: [0], experts: range(16, 48) });
    await waitPlacement(
      "the other worker",
      (p) => p.registrations.filter((r) => r.id === "other").length === 2,
    );

    const w = start("span", 32 * bytesPerExpert);
    const p = await waitPlacement("complete coverage", complete);
    expect(
      p.registrations
        .filter((r) => r.id === "span")
        .map((r) => `L${span(r.layers)} E${span(r.experts)}`)
        .sort(),
    ).toEqual(["L0:1 E0:16", "L0:1 E48:64"]);
    expect(w.events.filter((e) => e.event === "registered").at(-1)).toMatchObject({
      slices: 2,
      bytes: 32 * bytesPerExpert,
    });

    const backbone = await connectRelay(relayUrl, {
      role: "backbone",
      id: "bb-span",
      token: token("backbone", "bb-span"),
      reconnect: false,
    });
    open.push(backbone);
    await using whole = await loadExpertCompute(modelPath, { backend: "auto", threads: 1 });
    const loaded = w.events.find((e) => e.event === "loaded") as Extract<WorkerEvent, { event: "loaded" }>;
    expect(loaded.backend).toBe(whole.info.backend); // the same kernels on both sides
    const n = 5;
    const k = 4;
    const embd = whole.info.nEmbd;
    const x = normals(n * embd, 31, 0.5);
    // every token mixes both slices; one slot empty
    const ids = Int32Array.from([0, 63, 15, 48, 50, 2, -1, 60, 7, 8, 55, 9, 49, 1, 62, 14, 3, 52, 12, 58]);
    const wts = randomWeights(n, k, 5);
    for (const mode of ["each", "sum"] as const) {
      const reply = await backbone.request("span", {
        model: MODEL,
        layer: 0,
        n,
        embd,
        x,
        k,
        ids,
        w: wts,
        mode,
      });
      const want = await whole.run({ layer: 0, x, ids, k, w: wts, mode });
      expect(reply.from).toBe("span");
      expect(firstBitDiff(reply.y, want), mode).toBe(-1);
      expect(bitsEqual(reply.y, want)).toBe(true);
      expect(want.some((v) => v !== 0)).toBe(true);
    }
    // an expert the other worker serves is not computed here
    await expect(
      backbone.request("span", {
        model: MODEL,
        layer: 0,
        n: 1,
        embd,
        x: x.subarray(0, embd),
        k: 1,
        ids: Int32Array.from([20]),
        mode: "each",
      }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });

    w.controller.abort("restart");
    const first = await w.done;
    expect(first.slices.map((s) => s.reused)).toEqual([false, false]);
    await waitPlacement("span gone", (x) => !x.registrations.some((r) => r.id === "span"), 5000);

    // the restart takes both slices from its cache: verified, no byte downloaded
    const again = start("span", 32 * bytesPerExpert, w.cacheDir);
    await waitPlacement(
      "span back",
      (x) => complete(x) && x.registrations.filter((r) => r.id === "span").length === 2,
    );
    again.controller.abort("test done");
    const second = await again.done;
    expect(second.downloadedBytes).toBe(0);
    expect(second.slices.map((s) => s.reused)).toEqual([true, true]);
    expect(second.slices.map((s) => s.experts).sort()).toEqual(["0:16", "48:64"]);
    expect(again.events.filter((e) => e.event === "cached")).toHaveLength(2);
    expect(again.events.some((e) => e.event === "download-start")).toBe(false);
    await other.close();
  });
});
