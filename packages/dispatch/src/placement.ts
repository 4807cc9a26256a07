import { DispatchError, formatRange, InvalidArgumentError, toRanges } from "@moeswarm/core";

/** A worker's `register` frame: which experts of which layers it serves. */
export interface WorkerRegistration {
  /** The worker's peer id (the `hello` id). */
  readonly id: string;
  readonly model: string;
  readonly layers: readonly number[];
  /** Global expert ids, served for every layer in `layers`. */
  readonly experts: readonly number[];
  /**
   * The principal the worker's token was issued to (the hub's placement carries it; default: the
   * id). Trust "verify" pairs only workers of distinct principals: two ids of one owner are one
   * opinion.
   */
  readonly owner?: string;
  /**
   * How the worker computes (backend + ISA/build, e.g. "ggml-cpu-x86_64", "vulkan"): answers of
   * one class must agree bit for bit, of different classes within the calibrated tolerance.
   */
  readonly computeClass?: string;
  /**
   * The activation dtypes the worker's compute takes (its hello's `caps.dtypes`, which the hub's
   * placement carries), undefined when it did not say: see `quantizingTransport`.
   */
  readonly dtypes?: readonly string[];
}

/** The experts of one layer that nobody serves, as half-open ranges `a:b` joined by commas. */
export interface MissingExperts {
  readonly layer: number;
  readonly experts: string;
  readonly count: number;
}

export interface PlacementOptions {
  /** Registrations for another model are rejected. */
  readonly model: string;
}

const MAX_ID = 0x7fff_ffff;

function checkIds(values: readonly number[], what: string, workerId: string): number[] {
  if (!Array.isArray(values)) {
    throw new InvalidArgumentError(`worker ${workerId}: ${what} must be an array`);
  }
  for (const v of values) {
    if (!Number.isInteger(v) || v < 0 || v > MAX_ID) {
      throw new InvalidArgumentError(
        `worker ${workerId}: ${what} must be non-negative integers, got ${String(v)}`,
      );
    }
  }
  return [...new Set(values)].sort((a, b) => a - b);
}

function sameIds(a: readonly number[], b: readonly number[]): boolean {
  return a.length === b.length && a.every((v, i) => v === b[i]);
}

/**
 * Which worker owns each (layer, expert), built from `register` frames; an expert with several
 * owners has replicas. A worker may serve several slices (rectangles of layers x experts) of one
 * model: each `register` frame on the relay adds one, and `fromRegistrations` / `add` merge them.
 * Also holds the in-flight request count per worker, which replica choice reads (see
 * {@link Placement.choose}).
 */
export class Placement {
  readonly model: string;
  readonly #byLayer = new Map<number, Map<number, string[]>>();
  /** Per worker, its slices in the order they were added. */
  readonly #registrations = new Map<string, Array<{ layers: number[]; experts: number[] }>>();
  readonly #inFlight = new Map<string, number>();
  /** Per worker, its principal and compute class when the registration said. */
  readonly #owner = new Map<string, string>();
  readonly #class = new Map<string, string>();
  readonly #dtypes = new Map<string, readonly string[]>();
  #rotation = 0;

  constructor(options: PlacementOptions) {
    if (typeof options?.model !== "string") {
      throw new InvalidArgumentError("Placement: options.model must be a string");
    }
    this.model = options.model;
  }

  /**
   * A placement from registrations (one entry per slice, as the hub's placement lists them); the
   * model defaults to the first registration's. Entries with the same worker id are merged: the
   * worker owns every cell of each of them.
   */
  static fromRegistrations(
    registrations: Iterable<WorkerRegistration>,
    options: { model?: string } = {},
  ): Placement {
    const regs = [...registrations];
    const model = options.model ?? regs[0]?.model;
    if (model === undefined) {
      throw new InvalidArgumentError("Placement.fromRegistrations: no registrations and no model given");
    }
    const placement = new Placement({ model });
    for (const r of regs) placement.add(r);
    return placement;
  }

  #check(registration: WorkerRegistration): { id: string; layers: number[]; experts: number[] } {
    const { id, model, owner, computeClass, dtypes } = registration ?? ({} as WorkerRegistration);
    if (typeof id !== "string" || id.length === 0 || Buffer.byteLength(id) > 128) {
      throw new InvalidArgumentError("worker id must be a string of 1..128 bytes");
    }
    for (const [what, v] of [
      ["owner", owner],
      ["computeClass", computeClass],
    ] as const) {
      if (v !== undefined && (typeof v !== "string" || v.length === 0 || Buffer.byteLength(v) > 128)) {
        throw new InvalidArgumentError(`worker ${id}: ${what} must be a string of 1..128 bytes`);
      }
    }
    if (
      dtypes !== undefined &&
      (!Array.isArray(dtypes) ||
        dtypes.length > 64 ||
        !dtypes.every((d) => typeof d === "string" && d.length > 0))
    ) {
      throw new InvalidArgumentError(`worker ${id}: dtypes must be at most 64 non-empty strings`);
    }
    if (model !== this.model) {
      throw new InvalidArgumentError(
        `worker ${id} registered model ${JSON.stringify(model)}, this placement is for ${JSON.stringify(this.model)}`,
      );
    }
    return {
      id,
      layers: checkIds(registration.layers, "layers", id),
      experts: checkIds(registration.experts, "experts", id),
    };
  }

  /** Adds a worker, or replaces everything a worker with the same id registered before. */
  register(registration: WorkerRegistration): void {
    const { id, layers, experts } = this.#check(registration);
    this.unregister(id);
    this.#identity(registration);
    this.#insert(id, layers, experts);
  }

  /**
   * Adds one more slice to a worker (a worker with several slices, as several `register` frames
   * announce them); the worker keeps what it registered before. Adding a slice it already has
   * changes nothing.
   */
  add(registration: WorkerRegistration): void {
    const { id, layers, experts } = this.#check(registration);
    this.#identity(registration);
    const had = this.#registrations.get(id);
    if (had?.some((s) => sameIds(s.layers, layers) && sameIds(s.experts, experts))) return;
    this.#insert(id, layers, experts);
  }

  #identity(registration: WorkerRegistration): void {
    const { id, owner, computeClass, dtypes } = registration;
    if (owner !== undefined) this.#owner.set(id, owner);
    if (computeClass !== undefined) this.#class.set(id, computeClass);
    if (dtypes !== undefined) this.#dtypes.set(id, Object.freeze([...dtypes]));
  }

  /** The principal a worker's token was issued to (its id when the registration did not say). */
  principal(id: string): string {
    return this.#owner.get(id) ?? id;
  }

  /** A worker's compute class, undefined when its registration did not say. */
  computeClass(id: string): string | undefined {
    return this.#class.get(id);
  }

  /** The activation dtypes a worker said its compute takes, undefined when it did not say. */
  dtypes(id: string): readonly string[] | undefined {
    return this.#dtypes.get(id);
  }

  /** The registered workers of the same principal as `id` (itself included). */
  samePrincipal(id: string): string[] {
    const p = this.principal(id);
    return this.workers().filter((w) => w === id || this.principal(w) === p);
  }

  #insert(id: string, layers: number[], experts: number[]): void {
    const slices = this.#registrations.get(id);
    if (slices) slices.push({ layers, experts });
    else this.#registrations.set(id, [{ layers, experts }]);
    for (const layer of layers) {
      let byExpert = this.#byLayer.get(layer);
      if (!byExpert) {
        byExpert = new Map();
        this.#byLayer.set(layer, byExpert);
      }
      for (const e of experts) {
        const owners = byExpert.get(e);
        // overlapping slices of one worker still make it one owner of the cell
        if (!owners) byExpert.set(e, [id]);
        else if (!owners.includes(id)) owners.push(id);
      }
    }
  }

  /** Removes a worker with all its slices (it left or was quarantined). Returns whether it was registered. */
  unregister(id: string): boolean {
    const slices = this.#registrations.get(id);
    if (!slices) return false;
    this.#registrations.delete(id);
    this.#owner.delete(id);
    this.#class.delete(id);
    this.#dtypes.delete(id);
    for (const reg of slices) {
      for (const layer of reg.layers) {
        const byExpert = this.#byLayer.get(layer);
        if (!byExpert) continue;
        for (const e of reg.experts) {
          const owners = byExpert.get(e);
          if (!owners) continue;
          const i = owners.indexOf(id);
          if (i >= 0) owners.splice(i, 1);
          if (owners.length === 0) byExpert.delete(e);
        }
        if (byExpert.size === 0) this.#byLayer.delete(layer);
      }
    }
    return true;
  }

  /** Registered worker ids, in registration order. */
  workers(): string[] {
    return [...this.#registrations.keys()];
  }

  /** Owners of one expert, in registration order (empty when none). */
  owners(layer: number, expert: number): readonly string[] {
    return this.#byLayer.get(layer)?.get(expert) ?? [];
  }

  /** Every expert `0..nExpert-1` of the given layers that has no owner. */
  missing(options: { layers: Iterable<number>; nExpert: number }): MissingExperts[] {
    const out: MissingExperts[] = [];
    for (const layer of options.layers) {
      const byExpert = this.#byLayer.get(layer);
      const ids: number[] = [];
      for (let e = 0; e < options.nExpert; e++) if (!byExpert?.has(e)) ids.push(e);
      if (ids.length > 0) {
        out.push({ layer, experts: toRanges(ids).map(formatRange).join(","), count: ids.length });
      }
    }
    return out;
  }

  /**
   * Throws DispatchError MOESWARM_DISPATCH_NO_OWNER listing every (layer, expert) routing could
   * select that has no owner, so a gap is reported before decoding starts, not mid-step.
   */
  validate(options: { layers: Iterable<number>; nExpert: number }): void {
    if (!Number.isInteger(options?.nExpert) || options.nExpert < 1) {
      throw new InvalidArgumentError("validate: nExpert must be a positive integer");
    }
    const missing = this.missing(options);
    if (missing.length === 0) return;
    const total = missing.reduce((s, m) => s + m.count, 0);
    const shown = missing
      .slice(0, 8)
      .map((m) => `layer ${m.layer}: ${m.experts}`)
      .join("; ");
    throw new DispatchError(
      "MOESWARM_DISPATCH_NO_OWNER",
      `${total} expert(s) of model ${this.model} have no owner (${shown}${missing.length > 8 ? "; ..." : ""})`,
      { details: { model: this.model, missing } },
    );
  }

  /** Requests currently outstanding at a worker (maintained by the dispatcher). */
  inFlight(id: string): number {
    return this.#inFlight.get(id) ?? 0;
  }

  /** @internal the dispatcher counts a request it sends. */
  acquire(id: string): void {
    this.#inFlight.set(id, this.inFlight(id) + 1);
  }

  /** @internal the dispatcher counts a request that settled. */
  release(id: string): void {
    const v = this.inFlight(id) - 1;
    if (v > 0) this.#inFlight.set(id, v);
    else this.#inFlight.delete(id);
  }

  /** @internal a new dispatch call: advances the round-robin rotation. */
  nextRotation(): number {
    const r = this.#rotation;
    this.#rotation = (r + 1) % 0x4000_0000;
    return r;
  }

  /**
   * Picks one owner of (layer, expert), or undefined when none is left after `exclude`.
   * Deterministic and load-aware: fewest in-flight requests first; among equals an owner already
   * picked in this call (`chosen`), so a call sends as few requests as it can; then round robin
   * (the replica list rotated by `rotation`, which advances per call).
   */
  choose(
    layer: number,
    expert: number,
    context: { rotation: number; chosen?: ReadonlySet<string>; exclude?: ReadonlySet<string> },
  ): string | undefined {
    const owners = this.owners(layer, expert);
    const n = owners.length;
    let best: string | undefined;
    let bestLoad = Number.POSITIVE_INFINITY;
    let bestChosen = false;
    for (let i = 0; i < n; i++) {
      const id = owners[(context.rotation + i) % n]!;
      if (context.exclude?.has(id)) continue;
      const load = this.inFlight(id);
      const chosen = context.chosen?.has(id) ?? false;
      if (load < bestLoad || (load === bestLoad && chosen && !bestChosen)) {
        best = id;
        bestLoad = load;
        bestChosen = chosen;
      }
    }
    return best;
  }
}
