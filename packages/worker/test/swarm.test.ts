// Real processes on loopback: `moeswarm-worker` bins (the built dist/worker-cli.js) against a hub
// started here, covering a synthetic qwen3moe `small` model (4 MoE layers x 64 experts) by
// themselves, serving dispatches through the relay, replacing a killed worker, surviving a
// corrupted download, draining on SIGTERM and reusing their cache after a restart.
import { type ChildProcess, spawn } from "node:child_process";
import { existsSync, mkdirSync, writeFileSync } from "node:fs";
import { createServer, request as httpRequest, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { type Hub, mintToken } from "@moeswarm/hub";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import type { TempDir } from "@moeswarm/testkit";
import type { ExpertCompute } from "@moeswarm/worker-native";
import { loadExpertCompute } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { wireDtypesOf } from "../src/compute-class.js";
import type { WorkerEvent } from "../src/events.js";
import {
  complete,
  normals,
  type PlacementJson as Placement,
  placement as placementOf,
  rng,
  startTestHub,
  waitPlacement as waitPlacementOf,
} from "./fixtures.js";

const BIN = fileURLToPath(new URL("../dist/worker-cli.js", import.meta.url));
const OUTPUT = fileURLToPath(new URL("../test-output/", import.meta.url));
const MODEL = "qwen3moe-small";
const SECRET = "worker-runtime-test-secret-0123456789abcdef";
const LAYERS = 4;
const EXPERTS = 64;

/** One `moeswarm-worker` process and what it printed. */
class WorkerProcess {
  readonly lines: string[] = [];
  readonly events: WorkerEvent[] = [];
  readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  readonly child: ChildProcess;
  #stderr = "";
  #waiters = new Set<() => void>();
  #buffer = "";

  constructor(
    readonly name: string,
    args: string[],
    readonly json: boolean,
  ) {
    this.child = spawn(process.execPath, [BIN, ...args, ...(json ? ["--json"] : [])], {
      stdio: ["ignore", "pipe", "pipe"],
      env: { ...process.env, MOESWARM_TOKEN: "", MOESWARM_HUB: "" },
    });
    this.child.stdout?.setEncoding("utf8").on("data", (text: string) => {
      this.#buffer += text;
      const parts = this.#buffer.split("\n");
      this.#buffer = parts.pop() ?? "";
      for (const line of parts) {
        this.lines.push(line);
        if (json) this.events.push(JSON.parse(line) as WorkerEvent);
      }
      for (const w of [...this.#waiters]) w();
    });
    this.child.stderr?.setEncoding("utf8").on("data", (text: string) => {
      this.#stderr += text;
    });
    this.exited = new Promise((resolve) => {
      this.child.on("exit", (code, signal) => {
        for (const w of [...this.#waiters]) w();
        resolve({ code, signal });
      });
    });
  }

  get alive(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  has(event: string): boolean {
    return this.events.some((e) => e.event === event);
  }

  /** Resolves once `test` holds on what was printed; the output goes into the failure message. */
  waitFor(what: string, test: () => boolean, timeoutMs = 30_000): Promise<void> {
    return new Promise((resolve, reject) => {
      const check = () => {
        if (test()) {
          done();
          resolve();
        } else if (!this.alive) {
          done();
          reject(new Error(`${this.name} exited before ${what}:\n${this.output()}`));
        }
      };
      const timer = setTimeout(() => {
        done();
        reject(new Error(`${this.name}: no ${what} within ${timeoutMs} ms:\n${this.output()}`));
      }, timeoutMs);
      const done = () => {
        clearTimeout(timer);
        this.#waiters.delete(check);
      };
      this.#waiters.add(check);
      check();
    });
  }

  output(): string {
    return `${this.lines.slice(-40).join("\n")}\n[stderr] ${this.#stderr}`;
  }
}

/**
 * An HTTP proxy in front of the hub that flips one byte, 1000 bytes before the end (inside the
 * last expert slab), of the first expert-shard body it passes on.
 */
function corruptingProxy(
  target: string,
): Promise<{ url: string; server: Server; stats: { shards: number; flipped: number } }> {
  const up = new URL(target);
  const stats = { shards: 0, flipped: 0 };
  const server = createServer((req, res) => {
    const forward = httpRequest(
      { host: up.hostname, port: up.port, path: req.url, method: req.method, headers: req.headers },
      (answer) => {
        res.writeHead(answer.statusCode ?? 502, answer.headers);
        const shard = (req.url ?? "").includes("/expert-shard") && answer.statusCode === 200;
        if (shard) stats.shards++;
        if (!shard || stats.flipped > 0) {
          answer.pipe(res);
          return;
        }
        stats.flipped++;
        const at = Number(answer.headers["content-length"]) - 1000;
        let pos = 0;
        answer.on("data", (chunk: Buffer) => {
          let out = chunk;
          if (at >= pos && at < pos + chunk.length) {
            out = Buffer.from(chunk);
            out[at - pos] = (out[at - pos] as number) ^ 0x5a;
          }
          pos += chunk.length;
          res.write(out);
        });
        answer.on("end", () => res.end());
      },
    );
    forward.on("error", () => res.destroy());
    req.pipe(forward);
  });
  return new Promise((resolve) =>
    server.listen(0, "127.0.0.1", () =>
      resolve({ url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, server, stats }),
    ),
  );
}

let hub: Hub;
let url: string;
let relayUrl: string;
let modelPath: string;
let layerBytes: number;
let work: string;
let workDir: TempDir | undefined;
let proxy: Awaited<ReturnType<typeof corruptingProxy>>;
const workers: WorkerProcess[] = [];
const figures: Record<string, unknown> = {};

const placement = (since?: number) => placementOf(url, MODEL, since);

/** Long-polls the placement until `test` holds; a timeout prints every worker's output. */
const waitPlacement = (what: string, test: (p: Placement) => boolean, timeoutMs = 45_000) =>
  waitPlacementOf(url, MODEL, what, test, {
    timeoutMs,
    detail: (p) =>
      `${JSON.stringify(p.owners)}\n${workers.map((w) => `--- ${w.name}\n${w.output()}`).join("\n")}`,
  });

function startWorker(
  name: string,
  layers: number,
  options: { json?: boolean; hub?: string; cacheDir?: string; poll?: string } = {},
): WorkerProcess {
  const cacheDir = options.cacheDir ?? join(work, `cache-${name}`);
  const token = mintToken({ role: "worker", id: name, ttlS: 3600 }, SECRET);
  const args = [
    "--hub",
    options.hub ?? url,
    "--relay",
    relayUrl,
    "--token",
    token,
    "--capacity",
    String(layers * layerBytes),
    "--cache-dir",
    cacheDir,
    "--threads",
    "1",
    "--poll",
    options.poll ?? "0.2",
  ];
  const w = new WorkerProcess(name, args, options.json ?? true);
  workers.push(w);
  return w;
}

/** Bytes the hub has served from expert-shard so far (its own Prometheus counter). */
async function shardBytesServed(): Promise<number> {
  const metric = await hub.metrics.registry.getSingleMetric("moeswarm_http_bytes_served_total")?.get();
  return metric?.values.find((v) => v.labels.route === "/api/models/:model/expert-shard")?.value ?? 0;
}

function ownersOf(p: Placement, id: string): Set<string> {
  const cells = new Set<string>();
  for (const r of p.registrations) {
    if (r.id !== id) continue;
    for (const l of r.layers) for (const e of r.experts) cells.add(`${l}/${e}`);
  }
  return cells;
}

beforeAll(async () => {
  if (!existsSync(BIN))
    throw new Error(`${BIN} is missing: run \`pnpm --filter @moeswarm/worker build\` first`);
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
    workPrefix: "moeswarm-worker-swarm-",
    leaseTtlMs: 30_000,
  }));
  work = workDir.dir;
  const info = (await (await fetch(`${url}/api/models/${MODEL}`)).json()) as {
    expertBytes: number;
    experts: number;
  };
  expect(info.experts).toBe(EXPERTS);
  layerBytes = info.expertBytes * EXPERTS;
  proxy = await corruptingProxy(url);
});

afterAll(async () => {
  for (const w of workers) if (w.alive) w.child.kill("SIGKILL");
  await Promise.all(workers.map((w) => w.exited));
  await hub?.close();
  proxy?.server.closeAllConnections();
  await new Promise((r) => proxy?.server.close(r) ?? r(undefined));
  workDir?.remove();
  mkdirSync(OUTPUT, { recursive: true });
  writeFileSync(join(OUTPUT, "worker-swarm-figures.json"), `${JSON.stringify(figures, null, 2)}\n`);
});

describe("moeswarm-worker processes against a hub", () => {
  let a: WorkerProcess;
  let b: WorkerProcess;
  let c: WorkerProcess;
  let d: WorkerProcess;

  it("three workers cover the model by themselves, one of them through a corrupted download", async () => {
    const t0 = Date.now();
    a = startWorker("w-a", 2);
    b = startWorker("w-b", 1, { json: false });
    c = startWorker("w-c", 1, { hub: proxy.url });
    const p = await waitPlacement("complete coverage", complete);
    figures.timeToCoverMs = Date.now() - t0;
    // (a worker may hold its share as more than one slice when another took the layers between)
    expect([...new Set(p.registrations.map((r) => r.id))].sort()).toEqual(["w-a", "w-b", "w-c"]);
    // every cell exactly once, and each worker holds exactly its capacity: 2, 1 and 1 whole layers
    const all = new Set<string>();
    for (const id of ["w-a", "w-b", "w-c"]) for (const cell of ownersOf(p, id)) all.add(cell);
    expect(all.size).toBe(LAYERS * EXPERTS);
    expect(ownersOf(p, "w-a").size).toBe(2 * EXPERTS);
    expect(ownersOf(p, "w-b").size).toBe(EXPERTS);

    // w-c's first download had a byte flipped: the sha256 check caught it, it fetched again
    await c.waitFor("serving", () => c.has("serving"));
    const order = c.events
      .map((e) => e.event)
      .filter((e) => ["downloaded", "corrupt", "verified", "serving"].includes(e));
    expect(order).toEqual(["downloaded", "corrupt", "downloaded", "verified", "serving"]);
    const corrupt = c.events.find((e) => e.event === "corrupt") as Extract<WorkerEvent, { event: "corrupt" }>;
    expect(corrupt.error).toMatch(/does not match the manifest/);
    expect(corrupt.expert).toBe(EXPERTS - 1);
    expect(proxy.stats).toEqual({ shards: 2, flipped: 1 });

    const downloads = [a, c].flatMap((w) =>
      w.events.filter((e): e is Extract<WorkerEvent, { event: "downloaded" }> => e.event === "downloaded"),
    );
    figures.downloads = downloads.map((e) => ({
      bytes: e.bytes,
      ms: Math.round(e.ms),
      bytesPerSecond: e.bytesPerSecond,
    }));
  }, 120_000);

  it("answers dispatches through the relay with the bits of a local compute over the whole model", async () => {
    const backbone: RelayConnection = await connectRelay(relayUrl, {
      role: "backbone",
      id: "bb-test",
      token: mintToken({ role: "backbone", id: "bb-test", ttlS: 3600 }, SECRET),
    });
    let full: ExpertCompute | undefined;
    try {
      full = await loadExpertCompute(modelPath, { backend: "auto", threads: 1 });
      const loaded = a.events.find((e) => e.event === "loaded") as Extract<WorkerEvent, { event: "loaded" }>;
      // the same backend on both sides, so the same bits
      expect(loaded.backend).toBe(full.info.backend);
      const p = (await placement()) as Placement;
      // each registration carries the dtypes its worker's hello advertised for its compute
      // (w-b prints text, not events)
      for (const w of [a, c]) {
        const loaded = w.events.find((e) => e.event === "loaded") as Extract<
          WorkerEvent,
          { event: "loaded" }
        >;
        const said = wireDtypesOf({
          backend: loaded.backend as never,
          ...(loaded.device ? { device: loaded.device } : {}),
        });
        const mine = p.registrations.filter((x) => x.id === w.name);
        expect(mine.length).toBeGreaterThan(0);
        for (const r of mine) expect(r.dtypes).toEqual(said);
        // ggml's CPU kernels take q8 rows as they are: a CPU worker says so
        if (loaded.device?.toLowerCase() === "cpu") expect(said).toContain("q8_0");
      }
      const r = rng(11);
      for (const reg of p.registrations) {
        const n = 3;
        const k = 2;
        const layer = reg.layers[reg.layers.length - 1] as number;
        const pick = () => reg.experts[Math.floor(r() * reg.experts.length)] as number;
        const ids = Int32Array.from([pick(), pick(), pick(), -1, pick(), pick()]);
        const x = normals(n * full.info.nEmbd, 100 + layer, 0.5);
        const w = Float32Array.from([0.6, 0.4, 1, 0, 0.3, 0.7]);
        for (const mode of ["sum", "each"] as const) {
          const reply = await backbone.request(reg.id, {
            model: MODEL,
            layer,
            n,
            embd: full.info.nEmbd,
            x,
            k,
            ids,
            w,
            mode,
          });
          const want = await full.run({ layer, x, ids, k, w: w, mode });
          expect(reply.from).toBe(reg.id);
          expect(reply.y.length).toBe(want.length);
          expect(Buffer.from(reply.y.buffer, reply.y.byteOffset, reply.y.byteLength)).toEqual(
            Buffer.from(want.buffer, want.byteOffset, want.byteLength),
          );
          expect(want.some((v) => v !== 0)).toBe(true);
        }
        // a layer outside the worker's slices is refused with a typed error, not computed
        const mine = p.registrations.filter((x) => x.id === reg.id).flatMap((x) => x.layers);
        const foreign = [0, 1, 2, 3].find((l) => !mine.includes(l));
        if (foreign === undefined) continue;
        await expect(
          backbone.request(reg.id, {
            model: MODEL,
            layer: foreign,
            n,
            embd: full.info.nEmbd,
            x,
            k,
            ids,
            w,
            mode: "sum",
          }),
        ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
      }
    } finally {
      await full?.close();
      await backbone.close();
    }
  });

  it("notices a killed worker: its slice is in demand again and a spare worker takes it", async () => {
    // the spare polls while everything is covered: nothing to claim
    d = startWorker("w-d", 2, { poll: "1" });
    await d.waitFor("idle", () => d.events.some((e) => e.event === "idle" && e.reason === "covered"));
    const before = (await placement()) as Placement;
    const cellsOfA = ownersOf(before, "w-a");
    a.child.kill("SIGKILL");
    const t0 = Date.now();
    await a.exited;
    const dropped = await waitPlacement("w-a dropped", (p) => !p.registrations.some((r) => r.id === "w-a"));
    expect(dropped.missing.reduce((n, m) => n + m.count, 0)).toBe(cellsOfA.size);
    // the cells are in demand again (or already leased by the spare, if it polled first)
    const demand = (await (await fetch(`${url}/api/demand?model=${MODEL}`)).json()) as {
      ranges: Array<{ layer: number; experts: string; count: number }>;
    };
    const leased = hub.status({ model: MODEL }).leases.filter((l) => l.worker === "w-d");
    const inDemand = demand.ranges.reduce((n, r) => n + r.count, 0);
    expect(inDemand === cellsOfA.size || leased.length === 1).toBe(true);

    const p = await waitPlacement(
      "the spare covering",
      (x) => complete(x) && x.registrations.some((r) => r.id === "w-d"),
    );
    figures.replaceKilledWorkerMs = Date.now() - t0;
    expect(ownersOf(p, "w-d")).toEqual(cellsOfA);
    // it chose from the demand list: the value of 128 uncovered cells (100 + load 1 each), in one
    // slice or (when w-a's layers were not adjacent) two
    const claimed = d.events.filter(
      (e): e is Extract<WorkerEvent, { event: "claimed" }> => e.event === "claimed",
    );
    expect(claimed.reduce((v, e) => v + (e.value ?? 0), 0)).toBeCloseTo(101 * cellsOfA.size, 6);
    expect(d.events.findIndex((e) => e.event === "idle")).toBeLessThan(d.events.indexOf(claimed[0]!));
  });

  it("drains on SIGTERM, deregisters, exits 0, and a restart reuses its cached slice without downloading", async () => {
    const cellsOfB = ownersOf((await placement()) as Placement, "w-b");
    b.child.kill("SIGTERM");
    expect(await b.exited).toEqual({ code: 0, signal: null });
    await waitPlacement("w-b dropped", (p) => !p.registrations.some((r) => r.id === "w-b"));
    const life = b.lines.map((l) => l.replace(/^\d\d:\d\d:\d\d\.\d{3} /, ""));
    const steps = [
      /^worker w-b starting/,
      /^demand: [1-4] ranges? under-covered \(\d+ experts, [\d.]+ MB\); best fit for 13\.4 MB: layer \d experts 0:64 of qwen3moe-small \(13\.4 MB, value 6464\)$/,
      /^claimed layer \d experts 0:64 of qwen3moe-small \(13\.4 MB\), lease \d+(\.\d)? s$/,
      /^downloading http:\/\/127\.0\.0\.1:\d+\/api\/models\/qwen3moe-small\/expert-shard\?layers=\d:\d&experts=0:64 \(13\.4 MB\)$/,
      /^downloaded 13\.4 MB in /,
      /^verified 192 slabs \(13\.4 MB\) against the manifest/,
      /^loaded (native|the TypeScript fallback)/,
      /^connected to relay ws:\/\//,
      /^registered layer \d experts 0:64 of qwen3moe-small \(64 experts\)$/,
      /^serving$/,
      /^dispatch from bb-test \(layer \d\) failed: MOESWARM_INVALID_ARGUMENT: layer \d is not in this slice/,
      /^drain requested \(SIGTERM\): finishing 0 in-flight requests$/,
      /^drained: served 2 requests \(6 tokens\), 1 failed; deregistered$/,
      /^exit 0$/,
    ];
    let at = 0;
    for (const step of steps) {
      const found = life.findIndex((l, i) => i >= at && step.test(l));
      expect(found, `${step} in\n${life.join("\n")}`).toBeGreaterThanOrEqual(at);
      at = found + 1;
    }
    mkdirSync(OUTPUT, { recursive: true });
    writeFileSync(join(OUTPUT, "worker-life.log"), `${b.lines.join("\n")}\n`);

    const served = await shardBytesServed();
    const again = startWorker("w-b", 1, { json: false, cacheDir: join(work, "cache-w-b") });
    const p = await waitPlacement(
      "w-b back",
      (x) => complete(x) && x.registrations.some((r) => r.id === "w-b"),
    );
    expect(ownersOf(p, "w-b")).toEqual(cellsOfB);
    await again.waitFor("serving", () => again.lines.some((l) => l.endsWith(" serving")));
    expect(
      again.lines.some((l) => / claimed layer \d experts 0:64 of qwen3moe-small .*\[cached\]/.test(l)),
    ).toBe(true);
    expect(
      again.lines.some((l) => / verified 192 slabs .*reusing the cached slice, no download$/.test(l)),
    ).toBe(true);
    expect(again.lines.some((l) => /^\S+ download(ing|ed) /.test(l))).toBe(false);
    expect(await shardBytesServed()).toBe(served);

    // the hub drains one (POST /api/workers/:id/drain): it finishes, deregisters and exits 0
    const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
    const drained = await fetch(`${url}/api/workers/w-c/drain`, {
      method: "POST",
      headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
      body: JSON.stringify({ reason: "maintenance" }),
    });
    expect(drained.status).toBe(200);
    expect(await c.exited).toEqual({ code: 0, signal: null });
    const drainEvent = c.events.find((e) => e.event === "drain");
    expect(drainEvent).toMatchObject({ reason: "the hub asked: maintenance" });
    expect(c.events.at(-1)).toMatchObject({ event: "exit", code: 0 });

    // the others drain cleanly on SIGTERM
    for (const w of workers.filter((x) => x.alive)) w.child.kill("SIGTERM");
    for (const w of [d, again]) expect(await w.exited).toEqual({ code: 0, signal: null });
    await waitPlacement("nobody", (x) => x.registrations.length === 0, 5000);
  });
});
