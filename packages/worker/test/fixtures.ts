// The runtime's test fixtures: a loopback hub, plus worker-native's synthetic models and float
// comparisons (the slices a worker serves are those models' slices; written once, over there).
import { type ChildProcess, spawn } from "node:child_process";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { createHub, type Hub } from "@moeswarm/hub";
import { ensureSyntheticModel } from "@moeswarm/shard";
import { type TempDir, tempDir } from "@moeswarm/testkit";
import { expect } from "vitest";
import type { WorkerEvent } from "../src/events.js";

export {
  bitsEqual,
  type Fixture,
  firstBitDiff,
  normals,
  randomIds,
  randomWeights,
  rng,
  writeModel,
  writeSlice,
} from "../../worker-native/test/fixtures.js";

/** Synthetic models, kept across runs (MOESWARM_CACHE_DIR shares them with other packages' tests). */
export const MODEL_CACHE = process.env.MOESWARM_CACHE_DIR ?? join(tmpdir(), "moeswarm-worker-test-models");

/** GET /api/models/:id/placement's body, the fields these tests read. */
export interface PlacementJson {
  version: number;
  registrations: Array<{ id: string; model: string; layers: number[]; experts: number[]; dtypes?: string[] }>;
  owners: Array<{ layer: number; experts: string; workers: string[] }>;
  missing: Array<{ layer: number; experts: string; count: number }>;
}

export interface TestHub {
  hub: Hub;
  url: string;
  relayUrl: string;
  modelPath: string;
  /** A fresh folder for the hub's manifests and the workers' caches. */
  work: TempDir;
}

/** A synthetic model served by a hub on loopback (no dashboard), for the runtime's tests. */
export async function startTestHub(options: {
  secret: string;
  model: string;
  preset: "tiny" | "small";
  /** The work folder's name prefix. */
  workPrefix: string;
  leaseTtlMs?: number;
}): Promise<TestHub> {
  const work = tempDir(options.workPrefix);
  const modelPath = (await ensureSyntheticModel(options.preset, { cacheDir: MODEL_CACHE })).path;
  const hub = createHub({
    secret: options.secret,
    models: [{ id: options.model, path: modelPath }],
    manifestDir: work.dir,
    dashboard: false,
    // these runtime tests assume one copy of each expert is full coverage
    replicas: 1,
    ...(options.leaseTtlMs !== undefined ? { market: { leaseTtlMs: options.leaseTtlMs } } : {}),
  });
  const { url, relayUrl } = await hub.listen(0);
  return { hub, url, relayUrl, modelPath, work };
}

/** The model's placement now, or (with `since`) once it has moved past that version; undefined: not yet. */
export async function placement(
  url: string,
  model: string,
  since?: number,
): Promise<PlacementJson | undefined> {
  const q = since === undefined ? "" : `?since=${since}&wait=2`;
  const res = await fetch(`${url}/api/models/${model}/placement${q}`);
  if (res.status === 304) return undefined;
  expect(res.status).toBe(200);
  return (await res.json()) as PlacementJson;
}

/**
 * Long-polls the placement until `test` holds; returns that placement. A timeout's message names
 * `what` and `detail` of the last placement seen.
 */
export async function waitPlacement(
  url: string,
  model: string,
  what: string,
  test: (p: PlacementJson) => boolean,
  options: { timeoutMs?: number; detail?: (p: PlacementJson) => string } = {},
): Promise<PlacementJson> {
  const { timeoutMs = 45_000, detail = (p) => JSON.stringify(p.registrations) } = options;
  const end = Date.now() + timeoutMs;
  let p = (await placement(url, model)) as PlacementJson;
  while (!test(p)) {
    if (Date.now() > end) throw new Error(`no ${what} within ${timeoutMs} ms: ${detail(p)}`);
    p = (await placement(url, model, p.version)) ?? p;
  }
  return p;
}

/** Every expert of every layer served, by exactly one worker. */
export const complete = (p: PlacementJson) =>
  p.missing.length === 0 && p.owners.every((o) => o.workers.length === 1);

/** The built command (`pnpm --filter @moeswarm/worker build`). */
export const WORKER_BIN = fileURLToPath(new URL("../dist/worker-cli.js", import.meta.url));

/** `moeswarm-worker ... --json` in its own process: its events as they arrive, its stderr, its exit. */
export interface WorkerBin {
  readonly child: ChildProcess;
  readonly events: WorkerEvent[];
  readonly stderr: string;
  readonly exited: Promise<number | null>;
}

/** Starts the built worker command with `args` and `--json`, outside any MOESWARM_TOKEN/HUB of this shell. */
export function spawnWorkerBin(args: readonly string[]): WorkerBin {
  const child = spawn(process.execPath, [WORKER_BIN, ...args, "--json"], {
    stdio: ["ignore", "pipe", "pipe"],
    env: { ...process.env, MOESWARM_TOKEN: "", MOESWARM_HUB: "" },
  });
  const events: WorkerEvent[] = [];
  let stderr = "";
  let buffer = "";
  child.stdout?.setEncoding("utf8").on("data", (text: string) => {
    buffer += text;
    const lines = buffer.split("\n");
    buffer = lines.pop() ?? "";
    for (const l of lines) events.push(JSON.parse(l) as WorkerEvent);
  });
  child.stderr?.setEncoding("utf8").on("data", (text: string) => {
    stderr += text;
  });
  const exited = new Promise<number | null>((resolve) => child.on("exit", (code) => resolve(code)));
  return {
    child,
    events,
    get stderr() {
      return stderr;
    },
    exited,
  };
}
