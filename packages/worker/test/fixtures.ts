// The runtime's test fixtures: a loopback hub, plus worker-native's synthetic models and float
// comparisons (the slices a worker serves are those models' slices; written once, over there).
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createHub, type Hub } from "@moeswarm/hub";
import { ensureSyntheticModel } from "@moeswarm/shard";
import { type TempDir, tempDir } from "@moeswarm/testkit";
import { expect } from "vitest";

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
