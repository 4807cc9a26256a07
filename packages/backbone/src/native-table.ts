import { InvalidArgumentError } from "@moeswarm/core";
import type { Placement } from "@moeswarm/dispatch";
import type { NativeTableEntry, NativeTableFrame } from "./native-plane.js";

// The native plane's table: which remote layers the plugin may send straight to a worker
// (docs/architecture.md section 4). A layer ONE worker holds whole is one entry: its split is one
// dispatch in mode "sum" to that worker, exactly what the bridge would send it. A layer split over
// several workers (phase 2), each holding one contiguous range of its experts and nobody else any of
// them, is one entry per worker with its `experts` range: the plugin sends each a mode "each"
// dispatch and combines. Layers with replicas (phase 3, replicaLayerPlan, what the table uses) get
// one primary per range and an `alt` holding the same range, which the plugin fails over and hedges
// to; gaps stay on the bridge path. The bridge decides whether the plane is on at all (trust "own",
// no spot checks); this module builds the entries, keeps their tickets fresh, and drops a worker the
// plugin reports failing for a backoff. wholeLayerOwners and nativeLayerOwners are the phase 1 and 2
// rules, kept as the reference the plan reduces to without replicas.

/** A worker's native listener as the hub's placement publishes it. */
export interface NativeRoute {
  /** `host:port` (IPv6 as `[::1]:port`), in the worker's order of preference. */
  readonly addrs: readonly string[];
  /** SHA-256 fingerprint of its certificate (AA:BB:...), pinned by the plugin. */
  readonly fingerprint: string;
}

/** What the table is built from: one version of the live placement. */
export interface NativePlacementView {
  readonly placement: Placement;
  /** The model's MoE layers. */
  readonly layers: readonly number[];
  /** Routed experts per layer. */
  readonly nExpert: number;
  /** Workers that advertise a native listener. */
  readonly native: ReadonlyMap<string, NativeRoute>;
}

/** A layer that can go native, before its ticket. */
export interface NativeCandidate {
  layer: number;
  worker: string;
  addr: string;
  fp: string;
  /** Set for an owner of a split layer: the range [lo, hi) of its experts. */
  experts?: [number, number];
}

/**
 * Per layer, its one owner when a single worker holds every expert of it (and nobody else holds
 * any), that worker is not excluded (quarantined, its circuit open) and it advertises a native
 * listener. A layer with a gap, a replica or a second owner of any expert is left out: the bridge
 * would split, hedge or verify it, which the plugin does not.
 */
export function wholeLayerOwners(view: NativePlacementView, exclude: ReadonlySet<string>): NativeCandidate[] {
  const out: NativeCandidate[] = [];
  for (const layer of view.layers) {
    let owner: string | undefined;
    let single = view.nExpert > 0;
    for (let e = 0; e < view.nExpert && single; e++) {
      const owners = view.placement.owners(layer, e);
      if (owners.length !== 1 || (owner !== undefined && owners[0] !== owner)) single = false;
      else owner = owners[0];
    }
    if (!single || owner === undefined || exclude.has(owner)) continue;
    const route = view.native.get(owner);
    const addr = route?.addrs[0];
    if (!route || addr === undefined) continue;
    out.push({ layer, worker: owner, addr, fp: route.fingerprint });
  }
  return out;
}

/**
 * Per layer, its owners when every expert of it is held by exactly one worker (no replica, no gap),
 * each owner holds one contiguous range of its experts, and every owner advertises a native listener
 * and is not excluded: one candidate per owner, `experts` set when there are several. A layer that
 * breaks any of that is left out (the bridge path). Layers in `view.layers` order.
 */
export function nativeLayerOwners(
  view: NativePlacementView,
  exclude: ReadonlySet<string>,
): NativeCandidate[][] {
  const out: NativeCandidate[][] = [];
  for (const layer of view.layers) {
    const ranges = ownerRanges(view, layer);
    if (!ranges) continue;
    const group: NativeCandidate[] = [];
    for (const [worker, lo, hi] of ranges) {
      const route = view.native.get(worker);
      const addr = route?.addrs[0];
      if (exclude.has(worker) || !route || addr === undefined) break;
      group.push({
        layer,
        worker,
        addr,
        fp: route.fingerprint,
        ...(ranges.length > 1 ? { experts: [lo, hi] as [number, number] } : {}),
      });
    }
    if (group.length === ranges.length) out.push(group);
  }
  return out;
}

/** A layer's owners as [worker, lo, hi) runs, or undefined (a gap, a replica, an owner of two runs). */
function ownerRanges(view: NativePlacementView, layer: number): Array<[string, number, number]> | undefined {
  const runs: Array<[string, number, number]> = [];
  for (let e = 0; e < view.nExpert; e++) {
    const owners = view.placement.owners(layer, e);
    if (owners.length !== 1) return undefined;
    const last = runs[runs.length - 1];
    if (last && last[0] === owners[0]) last[2] = e + 1;
    else runs.push([owners[0]!, e, e + 1]);
  }
  const workers = new Set(runs.map((r) => r[0]));
  return runs.length > 0 && workers.size === runs.length ? runs : undefined;
}

/** Where a replica of an entry's range is: the plugin's failover and hedge target. */
export interface NativeAltCandidate {
  worker: string;
  addr: string;
  fp: string;
}

/** A candidate of the replica-aware plan (phase 3): its owner, and maybe a second one. */
export interface NativePlanCandidate extends NativeCandidate {
  /** Another worker holding the whole range (or the whole layer), not primary in this layer. */
  alt?: NativeAltCandidate;
}

/**
 * Per layer, the native plan with replicas (phase 3): disjoint contiguous ranges covering every
 * expert, one primary per range (a worker is primary of at most one range of a layer), each range
 * with an `alt` when another usable worker holds all of it. Only workers for which `usable` is true
 * (native listener, not excluded, not dropped, a live ticket: the caller's call) are chosen. A layer
 * with an expert no usable worker holds (a gap) is left out, as is one whose greedy cover would need
 * a worker twice (the plugin sends one dispatch per worker and split).
 *
 * The cover is greedy from expert 0: among the usable owners of the first uncovered expert, the one
 * whose run reaches farthest, so a worker holding the whole layer gets one entry without `experts`.
 * Ties (two whole copies of the model) rotate by the layer number over the owners sorted by id, so
 * about half the layers get each copy as primary, and the same placement always gives the same
 * table (no flapping). Layouts without replicas give what nativeLayerOwners gives.
 */
export function replicaLayerPlan(
  view: NativePlacementView,
  usable: (worker: string) => boolean,
): NativePlanCandidate[][] {
  const out: NativePlanCandidate[][] = [];
  for (const layer of view.layers) {
    const ranges = coverRanges(view, layer, usable);
    if (!ranges) continue;
    const primaries = new Set(ranges.map((r) => r.worker));
    const alts = new Set<string>();
    const group: NativePlanCandidate[] = [];
    for (const r of ranges) {
      const route = view.native.get(r.worker)!;
      const alt = altFor(view, layer, r, usable, primaries, alts);
      group.push({
        layer,
        worker: r.worker,
        addr: route.addrs[0]!,
        fp: route.fingerprint,
        ...(ranges.length > 1 ? { experts: [r.lo, r.hi] as [number, number] } : {}),
        ...(alt ? { alt } : {}),
      });
    }
    out.push(group);
  }
  return out;
}

interface CoverRange {
  worker: string;
  lo: number;
  hi: number;
}

/** The usable owners of one expert, sorted by id (the rotation's order). */
function usableOwners(
  view: NativePlacementView,
  layer: number,
  e: number,
  usable: (worker: string) => boolean,
): string[] {
  return view.placement
    .owners(layer, e)
    .filter((w) => usable(w) && view.native.get(w)?.addrs[0] !== undefined)
    .sort();
}

/** The greedy cover of a layer's experts (see replicaLayerPlan), or undefined. */
function coverRanges(
  view: NativePlacementView,
  layer: number,
  usable: (worker: string) => boolean,
): CoverRange[] | undefined {
  const owners: Array<Set<string>> = [];
  for (let e = 0; e < view.nExpert; e++) {
    const o = usableOwners(view, layer, e, usable);
    if (o.length === 0) return undefined;
    owners.push(new Set(o));
  }
  if (owners.length === 0) return undefined;
  const ranges: CoverRange[] = [];
  const used = new Set<string>();
  let lo = 0;
  while (lo < view.nExpert) {
    let best: string[] = [];
    let reach = lo;
    for (const w of [...owners[lo]!].sort()) {
      if (used.has(w)) continue;
      let hi = lo + 1;
      while (hi < view.nExpert && owners[hi]!.has(w)) hi++;
      if (hi > reach) {
        reach = hi;
        best = [w];
      } else if (hi === reach) best.push(w);
    }
    const worker = best[layer % Math.max(1, best.length)];
    if (worker === undefined) return undefined;
    used.add(worker);
    ranges.push({ worker, lo, hi: reach });
    lo = reach;
  }
  return ranges;
}

/**
 * A second usable worker holding every expert of r: not a primary of this layer and not already
 * another range's alt (the plugin's link to a worker carries one exchange at a time). Rotated by
 * the layer number among the candidates, as the primaries are.
 */
function altFor(
  view: NativePlacementView,
  layer: number,
  r: CoverRange,
  usable: (worker: string) => boolean,
  primaries: ReadonlySet<string>,
  alts: Set<string>,
): NativeAltCandidate | undefined {
  let cands = usableOwners(view, layer, r.lo, usable).filter((w) => !primaries.has(w) && !alts.has(w));
  for (let e = r.lo + 1; e < r.hi && cands.length > 0; e++) {
    const here = new Set(view.placement.owners(layer, e));
    cands = cands.filter((w) => here.has(w));
  }
  const worker = cands[layer % Math.max(1, cands.length)];
  if (worker === undefined) return undefined;
  alts.add(worker);
  const route = view.native.get(worker)!;
  return { worker, addr: route.addrs[0]!, fp: route.fingerprint };
}

/**
 * The workers the table may need: every native, not excluded owner of a layer those workers can
 * cover whole (without drops or tickets). They get tickets ahead of need.
 */
export function nativeWorkers(view: NativePlacementView, exclude: ReadonlySet<string>): Set<string> {
  const out = new Set<string>();
  const ok = (w: string) => !exclude.has(w);
  for (const layer of view.layers) {
    if (!coverRanges(view, layer, ok)) continue;
    for (let e = 0; e < view.nExpert; e++) for (const w of usableOwners(view, layer, e, ok)) out.add(w);
  }
  return out;
}

/** A ticket as the hub mints it (`POST /api/direct/tickets`). */
export interface NativeTicket {
  ticket: string;
  /** Expiry, unix ms. */
  exp: number;
}

/** 1 s doubling to 60 s, as the plugin and DirectTransport back off. */
export interface NativeBackoffOptions {
  initialMs?: number;
  maxMs?: number;
}

/** Per worker: how long it is out, and for how long the next time. */
export class WorkerBackoff {
  readonly #state = new Map<string, { delayMs: number; until: number }>();
  readonly #initial: number;
  readonly #max: number;

  constructor(options: NativeBackoffOptions = {}) {
    this.#initial = options.initialMs ?? 1000;
    this.#max = Math.max(this.#initial, options.maxMs ?? 60_000);
  }

  active(worker: string, now: number): boolean {
    const s = this.#state.get(worker);
    return s !== undefined && now < s.until;
  }

  /** When the backoff of `worker` ends (undefined: not backing off). */
  until(worker: string, now: number): number | undefined {
    const s = this.#state.get(worker);
    return s !== undefined && now < s.until ? s.until : undefined;
  }

  /**
   * A failure: starts the next backoff (the first 1 s, then doubling), unless one is running:
   * failures of splits already under way when the worker was dropped do not lengthen it.
   * Returns the delay started, or undefined.
   */
  fail(worker: string, now: number): number | undefined {
    const s = this.#state.get(worker);
    if (s && now < s.until) return undefined;
    const delayMs = s ? Math.min(this.#max, s.delayMs * 2) : this.#initial;
    this.#state.set(worker, { delayMs, until: now + delayMs });
    return delayMs;
  }

  /** A success after the backoff ended: the next failure starts at 1 s again. */
  succeeded(worker: string, now: number): void {
    if (!this.active(worker, now)) this.#state.delete(worker);
  }

  /** Forgets `worker`'s failures. */
  clear(worker: string): void {
    this.#state.delete(worker);
  }

  /** Workers backing off now. */
  list(now: number): string[] {
    return [...this.#state].filter(([, s]) => now < s.until).map(([w]) => w);
  }
}

export interface NativeTableOptions {
  /** The backbone's relay id (what its tickets name). */
  backbone: string;
  /** The plugin's deadline for a native split, ms. */
  deadlineMs: number;
  /** The plugin hedges a primary silent this long to its entry's alt (ms; absent: no hedge). */
  hedgeMs?: number | undefined;
  /** Or adaptively: max(hedgeMinMs, hedgeFactor x the primary's p50), both or neither (native-plane.ts). */
  hedgeFactor?: number | undefined;
  hedgeMinMs?: number | undefined;
  /** The live placement now (undefined: none yet, the table is empty). */
  view(): NativePlacementView | undefined;
  /** Workers the bridge would not send to now (quarantined, circuit open). */
  exclude(): ReadonlySet<string>;
  /** A ticket for `worker` from the hub. */
  ticket(worker: string, signal: AbortSignal): Promise<NativeTicket>;
  /** Called with each new table (a different content than the last). */
  onTable(table: NativeTableFrame): void;
  /** Ends ticket requests and timers. */
  signal: AbortSignal;
  /** Of a worker dropped after failures, and of ticket requests that failed. */
  backoff?: NativeBackoffOptions;
  /** A ticket request failed (it is retried with the backoff). */
  onTicketError?(worker: string, error: unknown): void;
}

/** A table entry is withdrawn this long before its ticket expires (a connect must still fit). */
const EXPIRY_MARGIN_MS = 5000;
/** A ticket is renewed once this share of its life has passed. */
const RENEW_AT = 0.8;

interface HeldTicket extends NativeTicket {
  renewAt: number;
}

export interface NativeTableCounters {
  /** Tables built (each with a new seq). */
  tables: number;
  ticketsFetched: number;
  ticketErrors: number;
  /** Times a worker was dropped after failures. */
  drops: number;
}

/** The adaptive hedge's fields, checked as the plugin checks them (a table it refuses is no table). */
function adaptiveHedge(
  o: NativeTableOptions,
  hedgeMs: number | undefined,
): { hedgeFactor?: number; hedgeMinMs?: number } {
  const { hedgeFactor: f, hedgeMinMs: m } = o;
  if (f === undefined && m === undefined) return {};
  if (
    f === undefined ||
    m === undefined ||
    hedgeMs !== undefined ||
    !(f >= 1 && f <= 100) ||
    !Number.isSafeInteger(m) ||
    m < 1 ||
    m > 86_400_000
  ) {
    throw new InvalidArgumentError(
      "native hedgeFactor (1..100) and hedgeMinMs (1..86400000) go together, and not with hedgeMs",
    );
  }
  return { hedgeFactor: f, hedgeMinMs: m };
}

/** The table the bridge pushes: rebuilt on `refresh()`, at ticket renewals and backoff ends. */
export class NativeTable {
  readonly counters: NativeTableCounters = { tables: 0, ticketsFetched: 0, ticketErrors: 0, drops: 0 };
  readonly #o: NativeTableOptions;
  readonly #tickets = new Map<string, HeldTicket>();
  readonly #fetching = new Set<string>();
  readonly #ticketRetry: WorkerBackoff;
  readonly #dropped: WorkerBackoff;
  #table: NativeTableFrame;
  #key = "[]";
  #timer: NodeJS.Timeout | undefined;
  #timerAt = Number.POSITIVE_INFINITY;

  constructor(options: NativeTableOptions) {
    const d = options.deadlineMs;
    if (!Number.isSafeInteger(d) || d < 1 || d > 0xffff_ffff) {
      throw new InvalidArgumentError("native deadlineMs must be an integer in 1..2^32-1");
    }
    this.#o = options;
    this.#ticketRetry = new WorkerBackoff(options.backoff);
    this.#dropped = new WorkerBackoff(options.backoff);
    const h = options.hedgeMs;
    if (h !== undefined && (!Number.isSafeInteger(h) || h < 1 || h > 0xffff_ffff)) {
      throw new InvalidArgumentError("native hedgeMs must be an integer in 1..2^32-1");
    }
    const adaptive = adaptiveHedge(options, h);
    this.#table = {
      v: 1,
      t: "native-table",
      seq: 0,
      backbone: options.backbone,
      deadlineMs: d,
      ...(h !== undefined ? { hedgeMs: h } : {}),
      ...adaptive,
      layers: [],
    };
    options.signal.addEventListener("abort", () => this.#clearTimer(), { once: true });
  }

  /** The table now (seq 0 and empty before the first build). */
  current(): NativeTableFrame {
    return this.#table;
  }

  /** Workers dropped after failures, backing off now. */
  dropped(): string[] {
    return this.#dropped.list(Date.now());
  }

  /** The plugin reported failures for `worker`: out of the table for the next backoff. */
  failed(worker: string): void {
    if (this.#dropped.fail(worker, Date.now()) === undefined) return;
    this.counters.drops++;
    this.refresh();
  }

  /** The plugin reported native splits answered by `worker`: its next failure backs off 1 s again. */
  succeeded(worker: string): void {
    this.#dropped.succeeded(worker, Date.now());
  }

  /** Rebuilds the table from the placement now; pushes it when it changed; asks for tickets it lacks. */
  refresh(): void {
    if (this.#o.signal.aborted) return;
    const now = Date.now();
    const view = this.#o.view();
    const exclude = this.#o.exclude();
    const wanted = view ? nativeWorkers(view, exclude) : new Set<string>();
    let wake = Number.POSITIVE_INFINITY;
    const later = (at: number | undefined) => {
      if (at !== undefined && at > now) wake = Math.min(wake, at);
    };
    // every worker that could serve a layer gets a ticket (a replica's too: it is the alt, or the
    // primary once the other copy is dropped); one dropped after failures is out until its backoff ends
    const live = new Map<string, HeldTicket>();
    for (const worker of wanted) {
      const droppedUntil = this.#dropped.until(worker, now);
      if (droppedUntil !== undefined) {
        later(droppedUntil);
        continue;
      }
      const held = this.#tickets.get(worker);
      if (!held || now >= held.renewAt) this.#fetch(worker, now);
      later(this.#ticketRetry.until(worker, now));
      if (!held || now >= held.exp - EXPIRY_MARGIN_MS) continue;
      later(held.renewAt);
      later(held.exp - EXPIRY_MARGIN_MS);
      live.set(worker, held);
    }
    const entries: NativeTableEntry[] = [];
    // a layer goes on only when its usable workers cover every expert: a missing owner without a
    // replica sends the whole layer to the bridge
    for (const group of view ? replicaLayerPlan(view, (w) => live.has(w)) : []) {
      for (const c of group) {
        const t = live.get(c.worker)!;
        const { alt, ...rest } = c;
        const a = alt ? live.get(alt.worker) : undefined;
        entries.push({
          ...rest,
          ticket: t.ticket,
          exp: t.exp,
          ...(alt && a ? { alt: { ...alt, ticket: a.ticket, exp: a.exp } } : {}),
        });
      }
    }
    // a worker gone from the placement: its ticket is of no use (a new one when it comes back)
    for (const w of this.#tickets.keys()) if (!wanted.has(w)) this.#tickets.delete(w);
    this.#schedule(wake);
    this.#publish(entries);
  }

  #publish(entries: NativeTableEntry[]): void {
    entries.sort((a, b) => a.layer - b.layer || (a.experts?.[0] ?? 0) - (b.experts?.[0] ?? 0));
    const key = JSON.stringify(entries);
    if (key === this.#key) return;
    this.#key = key;
    this.counters.tables++;
    this.#table = { ...this.#table, seq: this.#table.seq + 1, layers: entries };
    this.#o.onTable(this.#table);
  }

  #fetch(worker: string, now: number): void {
    if (this.#fetching.has(worker) || this.#ticketRetry.active(worker, now)) return;
    this.#fetching.add(worker);
    const { signal } = this.#o;
    // a ticket function that throws at once is a failed request like any other
    void Promise.resolve()
      .then(() => this.#o.ticket(worker, signal))
      .then((t) => {
        const at = Date.now();
        if (typeof t?.ticket !== "string" || !t.ticket.startsWith("mswt1.") || !Number.isSafeInteger(t.exp)) {
          throw new InvalidArgumentError("the hub answered no usable ticket ({ticket: mswt1..., exp})");
        }
        if (t.exp <= at + EXPIRY_MARGIN_MS) {
          throw new InvalidArgumentError(`the hub's ticket for ${worker} expires at once (exp ${t.exp})`);
        }
        this.counters.ticketsFetched++;
        this.#ticketRetry.clear(worker);
        this.#tickets.set(worker, { ticket: t.ticket, exp: t.exp, renewAt: at + (t.exp - at) * RENEW_AT });
      })
      .catch((error: unknown) => {
        if (signal.aborted) return;
        this.counters.ticketErrors++;
        this.#ticketRetry.fail(worker, Date.now());
        this.#o.onTicketError?.(worker, error);
      })
      .finally(() => {
        this.#fetching.delete(worker);
        this.refresh();
      });
  }

  /** One timer, at the earliest moment the table may change by itself. */
  #schedule(at: number): void {
    if (at === this.#timerAt) return;
    this.#clearTimer();
    if (!Number.isFinite(at)) return;
    this.#timerAt = at;
    this.#timer = setTimeout(
      () => {
        this.#timer = undefined;
        this.#timerAt = Number.POSITIVE_INFINITY;
        this.refresh();
      },
      Math.max(0, at - Date.now()),
    );
    this.#timer.unref?.();
  }

  #clearTimer(): void {
    if (this.#timer) clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#timerAt = Number.POSITIVE_INFINITY;
  }
}
