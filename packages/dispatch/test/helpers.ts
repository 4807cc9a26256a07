import { rng } from "@moeswarm/testkit";
import {
  type ExpertHandler,
  type ExpertMatrices,
  type ExpertRequest,
  type ExpertTransport,
  type ExpertWeights,
  InProcessTransport,
  Placement,
  type Routing,
  type WorkerRegistration,
} from "../src/index.js";

// Deterministic PRNG (mulberry32) so a failing case replays from its seed.
export { rng } from "@moeswarm/testkit";

export interface TinyModel extends ExpertWeights {
  readonly nExpert: number;
  readonly nFf: number;
  readonly layers: number;
}

/** Random f64 expert weights, values exactly representable in f32 so an f32 worker sees the same model. */
export function tinyModel(
  seed: number,
  shape: { nExpert: number; nEmbd: number; nFf: number; layers?: number; merged?: boolean; extras?: boolean },
): TinyModel {
  const rand = rng(seed);
  const layers = shape.layers ?? 1;
  const v = () => Math.fround((rand() * 2 - 1) * 0.5);
  const mat = (n: number) => Float64Array.from({ length: n }, v);
  const store = new Map<string, ExpertMatrices>();
  for (let l = 0; l < layers; l++) {
    for (let e = 0; e < shape.nExpert; e++) {
      const { nEmbd, nFf } = shape;
      const base = shape.merged
        ? { gateUp: mat(2 * nFf * nEmbd), down: mat(nEmbd * nFf) }
        : { gate: mat(nFf * nEmbd), up: mat(nFf * nEmbd), down: mat(nEmbd * nFf) };
      const extras = shape.extras
        ? shape.merged
          ? { upScale: 0.5 + rand(), downScale: 0.5 + rand(), gateUpBias: mat(2 * nFf), downBias: mat(nEmbd) }
          : {
              gateScale: 0.5 + rand(),
              upScale: 0.5 + rand(),
              downScale: 0.5 + rand(),
              gateBias: mat(nFf),
              upBias: mat(nFf),
              downBias: mat(nEmbd),
            }
        : {};
      store.set(`${l}:${e}`, { ...base, ...extras });
    }
  }
  return {
    nEmbd: shape.nEmbd,
    nExpert: shape.nExpert,
    nFf: shape.nFf,
    layers,
    expert(layer, expert) {
      const m = store.get(`${layer}:${expert}`);
      if (!m) throw new Error(`no expert ${layer}:${expert}`);
      return m;
    },
  };
}

export function randomHidden(seed: number, n: number, nEmbd: number): Float32Array {
  const rand = rng(seed);
  return Float32Array.from({ length: n * nEmbd }, () => rand() * 4 - 2);
}

/** Random routing: k distinct experts per token and random positive f32 weights. */
export function randomRouting(seed: number, n: number, k: number, nExpert: number): Routing {
  const rand = rng(seed);
  const ids = new Int32Array(n * k);
  const weights = new Float32Array(n * k);
  for (let i = 0; i < n; i++) {
    const pool = Array.from({ length: nExpert }, (_, e) => e);
    for (let j = 0; j < k; j++) {
      const pick = Math.floor(rand() * pool.length);
      ids[i * k + j] = pool.splice(pick, 1)[0]!;
      weights[i * k + j] = rand() + 0.01;
    }
  }
  return { n, k, ids, weights };
}

/** Each expert on 1..replicas random workers out of nWorkers. */
export function randomRegistrations(
  seed: number,
  nWorkers: number,
  nExpert: number,
  layers: number[],
  replicas = 1,
  model = "tiny",
): WorkerRegistration[] {
  const rand = rng(seed);
  const owned: number[][] = Array.from({ length: nWorkers }, () => []);
  for (let e = 0; e < nExpert; e++) {
    const r = 1 + Math.floor(rand() * replicas);
    const ws = new Set<number>();
    while (ws.size < Math.min(r, nWorkers)) ws.add(Math.floor(rand() * nWorkers));
    for (const w of ws) owned[w]!.push(e);
  }
  return owned
    .map((experts, w) => ({ id: `w${w}`, model, layers, experts }))
    .filter((r) => r.experts.length > 0);
}

export function swarm(
  regs: WorkerRegistration[],
  computeFor: (reg: WorkerRegistration) => ExpertHandler,
): { placement: Placement; transport: InProcessTransport } {
  const placement = Placement.fromRegistrations(regs);
  const transport = new InProcessTransport(regs.map((r) => [r.id, computeFor(r)] as const));
  return { placement, transport };
}

/** Bit pattern equality of two float arrays (distinguishes -0 and NaN payloads). */
export function sameBits(a: Float32Array, b: Float32Array): boolean {
  if (a.length !== b.length) return false;
  const ua = new Uint32Array(a.buffer, a.byteOffset, a.length);
  const ub = new Uint32Array(b.buffer, b.byteOffset, b.length);
  for (let i = 0; i < ua.length; i++) if (ua[i] !== ub[i]) return false;
  return true;
}

export function maxAbsDiff(a: ArrayLike<number>, b: ArrayLike<number>): number {
  if (a.length !== b.length) return Number.POSITIVE_INFINITY;
  let m = 0;
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i]! - b[i]!));
  return m;
}

/**
 * Workers of model "tiny" (layer 0) as in-process computes that count their calls. With
 * `trusted: false` the transport does not say it is trusted (as the relay's): trust "verify".
 */
export function countedWorkers(
  workers: ReadonlyArray<[string, number[], ExpertHandler, owner?: string]>,
  options: { trusted?: boolean } = {},
): { placement: Placement; transport: ExpertTransport; calls: Record<string, number> } {
  const calls: Record<string, number> = {};
  const placement = Placement.fromRegistrations(
    workers.map(([id, experts, , owner]) => ({
      id,
      model: "tiny",
      layers: [0],
      experts,
      ...(owner ? { owner } : {}),
    })),
  );
  const inner = new InProcessTransport(
    workers.map(([id, , compute]) => {
      calls[id] = 0;
      const counted: ExpertHandler = (req, o) => {
        calls[id]!++;
        return compute(req, o);
      };
      return [id, counted] as const;
    }),
  );
  const transport: ExpertTransport =
    options.trusted === false ? { request: (to, req, o) => inner.request(to, req, o) } : inner;
  return { placement, transport, calls };
}

/** `honest`'s answer with `y` changed by `lie` (a liar for spot checks and trust "verify"). */
export function lyingWith(
  honest: ExpertHandler,
  lie: (req: ExpertRequest, y: Float32Array) => void,
): ExpertHandler {
  return async (req, o) => {
    const r = await honest(req, o);
    const y = Float32Array.from(r.y);
    lie(req, y);
    return { ...r, y };
  };
}

/** `honest`'s outputs x1.05, rounded to f32: right direction, wrong norm. */
export function scaledLiar(honest: ExpertHandler): ExpertHandler {
  return lyingWith(honest, (_, y) => {
    for (let i = 0; i < y.length; i++) y[i] = Math.fround(y[i]! * 1.05);
  });
}
