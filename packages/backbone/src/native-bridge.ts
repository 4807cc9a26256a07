import { InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import {
  decodeNativeFrame,
  encodeNativeTable,
  failureCode,
  type NativeReceiptRouting,
  type NativeReceiptsFrame,
  type NativeTableFrame,
} from "./native-plane.js";
import { NativeTable, type NativeTableCounters, type NativeTableOptions } from "./native-table.js";
import type { PluginConnection } from "./plugin-socket.js";
import type { RoutingStats } from "./routing-stats.js";

// The bridge's side of the native plane on the plugin socket: the connections that said
// native-hello get the table at once and every new one; the plugin's receipts become the bridge's
// routing statistics and receipts (what the hub credits), as if the bridge had routed those
// expert-tokens itself, and its failures drop the worker from the table for a backoff.

/** The native plane's counters in the bridge's metrics: a plain object (JSON-safe). */
export interface NativeMetrics {
  /** Whether the bridge offers native layers; `off` says why not. */
  enabled: boolean;
  off?: string;
  /** Plugin connections that said native-hello, open now. */
  connections: number;
  /** The table now: its seq, its layers, their primaries and alts, the plugin's deadline and hedge. */
  table: {
    seq: number;
    layers: number[];
    workers: string[];
    alts: string[];
    deadlineMs: number;
    hedgeMs?: number;
    hedgeFactor?: number;
    hedgeMinMs?: number;
  };
  /** Workers out of the table after failures, backing off now. */
  dropped: string[];
  /** Native splits the plugin reported answered, their token rows and filled ids. */
  splits: number;
  tokens: number;
  expertTokens: number;
  /** Native splits that failed and took the bridge path instead, and their codes (of every failure). */
  fallbacks: number;
  /** Failures after which the entry's alt was asked natively (no fallback for that failure). */
  failovers: number;
  /** Primaries silent for the table's hedgeMs whose frame also went to the alt; races the alt won. */
  hedges: number;
  hedgeWins: number;
  failures: Record<string, number>;
  /** Receipts frames read; frames from the plugin that did not parse (dropped), by code. */
  receipts: number;
  duplicates: number;
  malformed: number;
  malformedCodes: Record<string, number>;
  /** Per worker: native splits and expert-tokens credited. */
  workers: Record<string, { splits: number; expertTokens: number }>;
  tables: number;
  ticketsFetched: number;
  ticketErrors: number;
  /** Times a worker was dropped after failures. */
  drops: number;
}

export interface NativePlaneOptions {
  /** The table's sources; absent: the plane is off (a native-hello gets an empty table). */
  table?: Omit<NativeTableOptions, "onTable"> | undefined;
  /** Why the plane is off (for the metrics). */
  off?: string | undefined;
  /** What an off plane's empty table says. */
  backbone: string;
  deadlineMs: number;
  /** Receipts are counted here (the hub's stats report). */
  routing: RoutingStats;
}

/** The native plane's frames on the plugin connections. */
export class NativePlane {
  readonly #o: NativePlaneOptions;
  readonly #table: NativeTable | undefined;
  readonly #idle: NativeTableFrame;
  /** Connections that want tables, with the last receipts seq read on each. */
  readonly #conns = new Map<PluginConnection, number>();
  readonly #c = {
    splits: 0,
    tokens: 0,
    expertTokens: 0,
    fallbacks: 0,
    failovers: 0,
    hedges: 0,
    hedgeWins: 0,
    receipts: 0,
    duplicates: 0,
    malformed: 0,
  };
  readonly #failures: Record<string, number> = Object.create(null) as Record<string, number>;
  readonly #malformedCodes: Record<string, number> = Object.create(null) as Record<string, number>;
  readonly #workers = new Map<string, { splits: number; expertTokens: number }>();

  constructor(options: NativePlaneOptions) {
    this.#o = options;
    this.#idle = {
      v: 1,
      t: "native-table",
      seq: 0,
      backbone: options.backbone,
      deadlineMs: options.deadlineMs,
      layers: [],
    };
    this.#table = options.table
      ? new NativeTable({ ...options.table, onTable: (t) => this.#push(t) })
      : undefined;
  }

  get enabled(): boolean {
    return this.#table !== undefined;
  }

  /** The table the plugin has (or gets at its hello). */
  current(): NativeTableFrame {
    return this.#table?.current() ?? this.#idle;
  }

  /** Rebuilds the table (a new placement, a quarantine); pushes it if it changed. */
  refresh(): void {
    this.#table?.refresh();
  }

  /** A native-plane frame's payload from a plugin connection (core's decoder did not know its type). */
  onPayload(payload: Uint8Array, conn: PluginConnection): void {
    let frame: ReturnType<typeof decodeNativeFrame>;
    try {
      frame = decodeNativeFrame(payload);
    } catch (error) {
      // a bad frame is dropped and counted: the plugin's splits go on, the bridge stays up
      const code = isMoeswarmError(error) ? error.code : "MOESWARM_PROTOCOL_MALFORMED";
      this.#c.malformed++;
      this.#malformedCodes[code] = (this.#malformedCodes[code] ?? 0) + 1;
      return;
    }
    try {
      this.#handle(frame, conn);
    } catch (error) {
      // nothing here may take the bridge down (this runs in the socket's data handler): counted
      const code = isMoeswarmError(error) ? error.code : "internal";
      this.#c.malformed++;
      this.#malformedCodes[code] = (this.#malformedCodes[code] ?? 0) + 1;
    }
  }

  #handle(frame: ReturnType<typeof decodeNativeFrame>, conn: PluginConnection): void {
    if (frame.t === "native-hello") {
      // the table as of now (a quarantine or an open circuit since the last look), then to this
      // connection and every later change
      this.#table?.refresh();
      if (!this.#conns.has(conn)) {
        this.#conns.set(conn, -1);
        conn.onClose(() => this.#conns.delete(conn));
      }
      conn.sendPayload(encodeNativeTable(this.current()));
      return;
    }
    const last = this.#conns.get(conn) ?? -1;
    if (frame.seq <= last) {
      this.#c.duplicates++;
      return;
    }
    if (this.#conns.has(conn)) this.#conns.set(conn, frame.seq);
    this.#receipts(frame);
  }

  /** The receipts' routing counts, for experts the model has (a report must never fail for one). */
  #routed(routing: readonly NativeReceiptRouting[]): void {
    const nExpert = this.#o.table?.view()?.nExpert ?? 0;
    for (const r of routing) {
      r.experts.forEach((e, i) => {
        if (e < nExpert) this.#o.routing.countRouted(r.layer, e, r.counts[i]!);
      });
    }
  }

  #receipts(f: NativeReceiptsFrame): void {
    this.#c.receipts++;
    const failing = new Set(f.failures.map((x) => x.worker));
    // a split layer's tokens come once per split in `layers`, not from each owner's count
    const split = new Set((f.layers ?? []).map((l) => l.layer));
    for (const l of f.layers ?? []) {
      this.#c.splits += l.splits;
      this.#c.tokens += l.tokens;
      this.#o.routing.countNative(l.layer, undefined, l.tokens, 0);
    }
    for (const c of f.counts) {
      const whole = !split.has(c.layer);
      this.#c.splits += whole ? c.splits : 0;
      this.#c.tokens += whole ? c.tokens : 0;
      this.#c.expertTokens += c.expertTokens;
      const w = this.#workers.get(c.worker) ?? { splits: 0, expertTokens: 0 };
      w.splits += c.splits;
      w.expertTokens += c.expertTokens;
      this.#workers.set(c.worker, w);
      this.#o.routing.countNative(c.layer, c.worker, whole ? c.tokens : 0, c.expertTokens);
      if (c.splits > 0 && !failing.has(c.worker)) this.#table?.succeeded(c.worker);
    }
    this.#c.hedges += f.hedges ?? 0;
    this.#c.hedgeWins += f.hedgeWins ?? 0;
    this.#routed(f.routing ?? []);
    for (const x of f.failures) {
      if (x.failover) this.#c.failovers++;
      else this.#c.fallbacks++;
      const code = failureCode(x.code);
      this.#failures[code] = (this.#failures[code] ?? 0) + 1;
    }
    for (const w of failing) this.#table?.failed(w);
    // quarantines and open circuits change without an event of their own: receipts come at most
    // once a second while the plane is busy, a cheap moment to look again
    this.#table?.refresh();
  }

  #push(table: NativeTableFrame): void {
    if (this.#conns.size === 0) return;
    const payload = encodeNativeTable(table);
    for (const conn of this.#conns.keys()) conn.sendPayload(payload);
  }

  metrics(): NativeMetrics {
    const t = this.current();
    const counters: NativeTableCounters = this.#table?.counters ?? {
      tables: 0,
      ticketsFetched: 0,
      ticketErrors: 0,
      drops: 0,
    };
    return {
      enabled: this.enabled,
      ...(this.#o.off !== undefined ? { off: this.#o.off } : {}),
      connections: this.#conns.size,
      table: {
        seq: t.seq,
        layers: [...new Set(t.layers.map((e) => e.layer))],
        workers: [...new Set(t.layers.map((e) => e.worker))],
        alts: [...new Set(t.layers.flatMap((e) => (e.alt ? [e.alt.worker] : [])))],
        deadlineMs: t.deadlineMs,
        ...(t.hedgeMs !== undefined ? { hedgeMs: t.hedgeMs } : {}),
        ...(t.hedgeFactor !== undefined ? { hedgeFactor: t.hedgeFactor, hedgeMinMs: t.hedgeMinMs! } : {}),
      },
      dropped: this.#table?.dropped() ?? [],
      ...this.#c,
      failures: { ...this.#failures },
      malformedCodes: { ...this.#malformedCodes },
      workers: Object.fromEntries([...this.#workers].map(([id, w]) => [id, { ...w }])),
      ...counters,
    };
  }
}

/** The bridge's `native` option in detail. */
export interface BridgeNativeOptions {
  /**
   * How long a native split may take before the plugin gives up on it and takes the bridge path,
   * ms. Default: 4x the bridge's `hedgeMs` when set (the plugin hedges to a replica after
   * `hedgeMs`), else 5000; never above `pluginTimeoutMs`.
   */
  deadlineMs?: number;
  /** The plugin's `MOESWARM_TIMEOUT_MS` (default 30000): the deadline stays within it. */
  pluginTimeoutMs?: number;
  /** A worker the plugin reports failing is left out for this backoff (default 1 s doubling to 60 s). */
  backoff?: { initialMs?: number; maxMs?: number };
}

/** Without a hedge, a native split that takes this long goes down the bridge path instead. */
export const DEFAULT_NATIVE_DEADLINE_MS = 5000;
const DEFAULT_PLUGIN_TIMEOUT_MS = 30_000;

/** Checks the bridge's `native` option (InvalidArgumentError). */
export function checkNativeOption(native: unknown): void {
  if (native === undefined || typeof native === "boolean") return;
  if (typeof native !== "object" || native === null) {
    throw new InvalidArgumentError(
      "native must be true, false or { deadlineMs?, pluginTimeoutMs?, backoff? }",
    );
  }
  const o = native as BridgeNativeOptions;
  for (const key of ["deadlineMs", "pluginTimeoutMs"] as const) {
    const v = o[key];
    if (v !== undefined && (!Number.isSafeInteger(v) || v < 1 || v > 0xffff_ffff)) {
      throw new InvalidArgumentError(`native.${key} must be an integer in 1..2^32-1`);
    }
  }
  const b = o.backoff;
  if (b !== undefined) {
    const ok = (v: unknown) => v === undefined || (Number.isFinite(v) && (v as number) >= 1);
    if (typeof b !== "object" || b === null || !ok(b.initialMs) || !ok(b.maxMs)) {
      throw new InvalidArgumentError("native.backoff must be { initialMs?, maxMs? } in ms (>= 1)");
    }
  }
}

/** The plugin's deadline for a native split: the option, else the hedge, else the default; within the plugin's timeout. */
/** The native deadline is this many hedge delays when the bridge hedges. */
export const HEDGE_DEADLINE_FACTOR = 4;

export function nativeDeadlineMs(
  native: boolean | BridgeNativeOptions | undefined,
  hedgeMs: number | undefined,
): number {
  const o = typeof native === "object" ? native : {};
  const cap = o.pluginTimeoutMs ?? DEFAULT_PLUGIN_TIMEOUT_MS;
  // with a hedge, the plugin races a replica after hedgeMs (phase 3) and gives the split up later;
  // 4x leaves the twin three hedge delays to answer, as dispatch's hedge leaves the slow ask running
  const want =
    o.deadlineMs ??
    (hedgeMs !== undefined && hedgeMs > 0 ? HEDGE_DEADLINE_FACTOR * hedgeMs : DEFAULT_NATIVE_DEADLINE_MS);
  // the plugin refuses a deadline above a day
  return Math.max(1, Math.min(cap, 86_400_000, Math.ceil(want)));
}

/**
 * The table's hedge from the bridge's `hedgeMs`: a fixed one in whole ms (at least 1), dropped when
 * it would not come before the native deadline (nothing left to race); none for `hedgeMs: 0`;
 * and for an unset `hedgeMs` dispatch's adaptive one (`liveness.hedgeDelay`: hedgeFactor x the
 * worker's p50, at least floorMs / 4), which the plugin applies to its own round trips, when the
 * bridge has liveness (an untrusted transport), else none.
 */
export function nativeHedge(
  hedgeMs: number | undefined,
  deadlineMs: number,
  liveness?: { readonly hedgeFactor: number; readonly floorMs: number },
): { hedgeMs?: number; hedgeFactor?: number; hedgeMinMs?: number } {
  if (hedgeMs === undefined) {
    return liveness
      ? { hedgeFactor: liveness.hedgeFactor, hedgeMinMs: Math.max(1, Math.ceil(liveness.floorMs / 4)) }
      : {};
  }
  if (!(hedgeMs > 0)) return {};
  const h = Math.max(1, Math.ceil(hedgeMs));
  return h < deadlineMs ? { hedgeMs: h } : {};
}

/** Why the native plane is off for a bridge with these settings (undefined: it is on). */
export function nativeOffReason(s: {
  native: boolean | BridgeNativeOptions | undefined;
  hub: boolean;
  trust: "verify" | "own";
  spotCheck: boolean;
}): string | undefined {
  if (s.native === false) return "turned off (native: false)";
  if (!s.hub) return "no hub (tickets and native listeners come from the hub's placement)";
  if (s.trust !== "own") return 'trust "verify" sends every part to two workers (the bridge path)';
  if (s.spotCheck) return "spot checks re-compute answers on the bridge path";
  return undefined;
}
