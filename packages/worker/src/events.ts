import { type FrameAllocatorState, frameAllocatorAdvice } from "@moeswarm/core";

/** One step of a worker's life, as `runWorker`'s `log` receives it (and `--json` prints it). */
export type WorkerEvent = WorkerEventBody & { /** ISO 8601 time. */ time: string };

interface SliceFields {
  model: string;
  /** "a:b" */
  layers: string;
  /** "a:b" */
  experts: string;
}

export type WorkerEventBody =
  | {
      event: "start";
      id: string;
      hub: string;
      capacityBytes: number;
      cacheDir: string;
      backend: string;
      /** How this process's glibc malloc is set for large frames (core frameAllocatorState). */
      malloc: FrameAllocatorState;
    }
  | { event: "hub-unreachable"; error: string; code: string; retryInMs: number }
  | {
      event: "idle";
      /** "full": its slices fill the capacity offered; it stops polling. */
      reason: "covered" | "no-fit" | "full";
      ranges: number;
      /** The capacity it has left for another slice. */
      capacityBytes: number;
      pollMs: number;
      /** Expert bytes its slices already hold (once it serves some). */
      heldBytes?: number | undefined;
    }
  | ({
      event: "demand";
      /** Under-covered ranges the hub listed, the experts and the bytes they hold. */
      ranges: number;
      cells: number;
      rangeBytes: number;
      /** The slice chosen for this worker's capacity. */
      value: number;
      bytes: number;
      capacityBytes: number;
    } & SliceFields)
  | ({ event: "cached"; path: string } & SliceFields)
  | {
      event: "cache-pruned";
      /** Deleted to make room, least recently used first. */
      removed: Array<{ path: string; bytes: number; kind: "slice" | "partial"; model: string }>;
      /** Bytes left in the cache, before the download. */
      cacheBytes: number;
      incomingBytes: number;
      maxBytes: number;
      /** False: the slices being served alone exceed the limit (the download goes ahead). */
      fits: boolean;
    }
  | ({ event: "claim-refused"; reason: string; retryAfterMs?: number | undefined } & SliceFields)
  | ({
      event: "claimed";
      leaseId: string;
      bytes: number;
      ttlMs: number;
      cached: boolean;
      value?: number | undefined;
    } & SliceFields)
  | { event: "lease-renewed"; leaseId: string; ttlMs: number }
  | { event: "lease-lost"; leaseId: string; error: string }
  | { event: "lease-released"; leaseId: string }
  | { event: "download-start"; url: string; bytes: number | undefined; resumeFrom: number }
  | { event: "progress"; received: number; total: number | undefined; bytesPerSecond: number }
  | {
      event: "download-retry";
      attempt: number;
      error: string;
      code: string;
      delayMs: number;
      received: number;
    }
  | {
      event: "downloaded";
      bytes: number;
      ms: number;
      bytesPerSecond: number;
      requests: number;
      resumes: number;
    }
  | { event: "verified"; slabs: number; bytes: number; ms: number; reused: boolean }
  | {
      event: "corrupt";
      error: string;
      layer?: number | undefined;
      expert?: number | undefined;
      tensor?: string | undefined;
      attempt: number;
      maxAttempts: number;
      reused: boolean;
    }
  | {
      event: "loaded";
      backend: string;
      cpu?: string | undefined;
      threads?: number | undefined;
      device?: string | undefined;
      fallback?: string | undefined;
      ms: number;
    }
  | { event: "connected"; url: string }
  /** The direct endpoint listens, and the hub was told (backbones that reach it dial it). */
  | { event: "direct"; endpoints: string[]; fingerprint: string; port: number }
  /** The hub has no direct links (an older hub): the endpoint is closed, the relay serves alone. */
  | { event: "direct-unsupported"; hub: string }
  /** A backbone's dial to the direct endpoint was refused (bad ticket, no hello). */
  | { event: "direct-refused"; code: string; error: string; remote?: string | undefined }
  /** The native listener (--listen-native) listens, and the hub was told. */
  | { event: "native-listening"; addresses: string[]; fingerprint: string; port: number }
  /** The native listener cannot run here (no OpenSSL 3, no addon): the worker serves without it. */
  | { event: "native-unavailable"; code: string; error: string }
  /** A backbone's connection to the native listener was refused (bad ticket, no hello). */
  | { event: "native-refused"; code: string; error: string; remote?: string | undefined }
  /** The layers the native listener serves changed (`layers` of the `offered` single-slice ones). */
  | { event: "native-routes"; layers: number; offered: number }
  | ({
      event: "registered";
      cells: number;
      /** Slices served now (this one included). */
      slices?: number | undefined;
      /** Expert bytes they hold, of the capacity offered. */
      bytes?: number | undefined;
      capacityBytes?: number | undefined;
    } & SliceFields)
  | { event: "serving" }
  | {
      event: "relay";
      state: string;
      attempt?: number | undefined;
      delayMs?: number | undefined;
      error?: string | undefined;
    }
  | { event: "dispatch-error"; error: string; code: string; layer: number; from: string }
  | { event: "drain"; reason: string; inFlight: number }
  | {
      event: "drained";
      requests: number;
      tokens: number;
      failed: number;
      inFlightAbandoned: number;
      /** Slices it served (all deregistered). */
      slices?: number | undefined;
      ms: number;
    }
  /**
   * Paused: by the hub (its owner or the operator; the hub routes it nothing new) or by itself
   * (battery low while discharging, or too hot; it tells the hub). It claims nothing new meanwhile.
   */
  | {
      event: "paused";
      by: "owner" | "operator" | "self";
      reason?: string | undefined;
      /** Battery charge, percent, and temperature, °C (a pause of its own). */
      battery?: number | undefined;
      tempC?: number | undefined;
    }
  | {
      event: "resumed";
      by: "owner" | "operator" | "self";
      battery?: number | undefined;
      tempC?: number | undefined;
    }
  /** The hub refused to record its own pause (it still claims nothing new while paused). */
  | { event: "pause-unreported"; error: string; code: string }
  /** A further slice could not be had (it keeps serving the ones it has). */
  | { event: "grow-failed"; error: string; code: string }
  | { event: "stopped"; reason: string }
  | { event: "exit"; code: number }
  | { event: "error"; error: string; code: string };

export type WorkerEventName = WorkerEventBody["event"];

/** Bytes in decimal units as a person reads them ("12.4 MB"). */
export function formatBytes(bytes: number): string {
  if (bytes < 1000) return `${bytes} B`;
  const units = ["kB", "MB", "GB", "TB"];
  let v = bytes / 1000;
  let u = 0;
  while (v >= 1000 && u < units.length - 1) {
    v /= 1000;
    u++;
  }
  return `${v >= 100 ? v.toFixed(0) : v.toFixed(1)} ${units[u]}`;
}

export function formatMs(ms: number): string {
  if (ms < 1000) return `${Math.round(ms)} ms`;
  const s = ms / 1000;
  return s < 100 ? `${s.toFixed(1)} s` : `${Math.round(s)} s`;
}

function slice(e: SliceFields): string {
  const [a, b] = e.layers.split(":").map(Number);
  const layers = b === (a as number) + 1 ? `layer ${a}` : `layers ${e.layers}`;
  return `${layers} experts ${e.experts} of ${e.model}`;
}

function plural(n: number, word: string): string {
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

/** An event's fields, by its name. */
type WorkerEventOf<N extends WorkerEventName> = Extract<WorkerEventBody, { event: N }>;

/** One formatter per event name: an event added to WorkerEventBody without one does not compile. */
const FORMATTERS: { [N in WorkerEventName]: (e: WorkerEventOf<N>) => string } = {
  start: (e) => {
    const advice = frameAllocatorAdvice(e.malloc);
    return `worker ${e.id} starting: hub ${e.hub}, capacity ${formatBytes(e.capacityBytes)}, cache ${e.cacheDir}, backend ${e.backend}${advice === undefined ? "" : `; ${advice}`}`;
  },
  "hub-unreachable": (e) => `hub unreachable (${e.code}: ${e.error}); retrying in ${formatMs(e.retryInMs)}`,
  idle: (e) => {
    if (e.reason === "full") {
      return `no room for another slice: ${formatBytes(e.heldBytes ?? 0)} held, the capacity offered`;
    }
    const left = e.heldBytes ? `the ${formatBytes(e.capacityBytes)} left` : formatBytes(e.capacityBytes);
    return e.reason === "covered"
      ? `nothing to claim: every expert is covered; polling every ${formatMs(e.pollMs)}`
      : `nothing to claim: ${plural(e.ranges, "range")} in demand, none fits ${left}; polling every ${formatMs(e.pollMs)}`;
  },
  demand: (e) =>
    `demand: ${plural(e.ranges, "range")} under-covered (${plural(e.cells, "expert")}, ${formatBytes(e.rangeBytes)}); best fit for ${formatBytes(e.capacityBytes)}: ${slice(e)} (${formatBytes(e.bytes)}, value ${Math.round(e.value)})`,
  cached: (e) => `found cached ${slice(e)} (${e.path})`,
  "cache-pruned": (e) => {
    const freed = e.removed.reduce((n, r) => n + r.bytes, 0);
    const what =
      e.removed.length > 0
        ? `deleted ${e.removed.length} cached file(s) (${formatBytes(freed)})`
        : "deleted nothing";
    return e.fits
      ? `cache limit ${formatBytes(e.maxBytes)}: ${what} to make room for ${formatBytes(e.incomingBytes)}`
      : `cache limit ${formatBytes(e.maxBytes)}: ${what}; the slices served alone hold ${formatBytes(e.cacheBytes)}, downloading ${formatBytes(e.incomingBytes)} anyway`;
  },
  "claim-refused": (e) => {
    const why =
      e.reason === "leased"
        ? "another worker leased part of it first"
        : e.reason === "covered"
          ? "already covered"
          : e.reason === "capacity"
            ? "more than the capacity offered"
            : e.reason === "owner"
              ? "another worker of the same owner holds it (a second copy of one owner is no replica)"
              : e.reason;
    return `claim of ${slice(e)} refused: ${why}; reading the demand again`;
  },
  claimed: (e) =>
    `claimed ${slice(e)} (${formatBytes(e.bytes)})${e.cached ? " [cached]" : ""}, lease ${formatMs(e.ttlMs)}`,
  "lease-renewed": (e) => `lease renewed (${formatMs(e.ttlMs)} left)`,
  "lease-lost": (e) => `lease lost: ${e.error}`,
  "lease-released": () => "lease released",
  "download-start": (e) =>
    e.resumeFrom > 0
      ? `downloading ${e.url}: resuming at ${formatBytes(e.resumeFrom)}`
      : `downloading ${e.url}${e.bytes !== undefined ? ` (${formatBytes(e.bytes)})` : ""}`,
  progress: (e) => {
    const pct = e.total ? ` ${((100 * e.received) / e.total).toFixed(0)}%` : "";
    return `downloading${pct} ${formatBytes(e.received)}${e.total ? ` of ${formatBytes(e.total)}` : ""} (${formatBytes(e.bytesPerSecond)}/s)`;
  },
  "download-retry": (e) =>
    `download interrupted at ${formatBytes(e.received)} (${e.error}); retry ${e.attempt} in ${formatMs(e.delayMs)}`,
  downloaded: (e) =>
    `downloaded ${formatBytes(e.bytes)} in ${formatMs(e.ms)} (${formatBytes(e.bytesPerSecond)}/s)${e.resumes > 0 ? `, resumed ${plural(e.resumes, "time")}` : ""}`,
  verified: (e) =>
    `verified ${plural(e.slabs, "slab")} (${formatBytes(e.bytes)}) against the manifest in ${formatMs(e.ms)}${e.reused ? ": reusing the cached slice, no download" : ""}`,
  corrupt: (e) =>
    e.reused
      ? `cached slice is corrupt (${e.error}); deleted, downloading again`
      : `sha256 mismatch (${e.error}); deleted, downloading again (attempt ${e.attempt + 1} of ${e.maxAttempts})`,
  loaded: (e) => {
    if (e.backend === "ts")
      return `loaded the TypeScript fallback in ${formatMs(e.ms)}${e.fallback ? ` (native unavailable: ${e.fallback})` : ""}`;
    return `loaded ${e.backend}${e.device && e.device !== "CPU" && e.device !== e.backend ? ` on ${e.device}` : ""} (${[e.cpu, e.threads !== undefined ? plural(e.threads, "thread") : undefined].filter(Boolean).join(", ")}) in ${formatMs(e.ms)}`;
  },
  connected: (e) => `connected to relay ${e.url}`,
  direct: (e) =>
    `direct endpoint ${e.endpoints.join(", ")} (port ${e.port}, certificate ${e.fingerprint.slice(0, 23)}...)`,
  "direct-unsupported": (e) => `the hub ${e.hub} has no direct links: serving through its relay only`,
  "direct-refused": (e) =>
    `refused a direct link${e.remote ? ` from ${e.remote}` : ""}: ${e.code}: ${e.error}`,
  "native-listening": (e) =>
    `native listener ${e.addresses.join(", ")} (port ${e.port}, certificate ${e.fingerprint.slice(0, 23)}...)`,
  "native-unavailable": (e) => `no native listener: ${e.code}: ${e.error}`,
  "native-refused": (e) =>
    `refused a native link${e.remote ? ` from ${e.remote}` : ""}: ${e.code}: ${e.error}`,
  "native-routes": (e) => `native listener serves ${plural(e.layers, "layer")}`,
  registered: (e) => {
    const more =
      e.slices !== undefined && e.slices > 1 && e.bytes !== undefined && e.capacityBytes !== undefined
        ? `; ${e.slices} slices, ${formatBytes(e.bytes)} of ${formatBytes(e.capacityBytes)}`
        : "";
    return `registered ${slice(e)} (${plural(e.cells, "expert")}${more})`;
  },
  serving: () => "serving",
  relay: (e) => {
    if (e.state === "reconnecting") {
      return e.delayMs === undefined
        ? `relay connection lost${e.error ? ` (${e.error})` : ""}`
        : `reconnecting to the relay in ${formatMs(e.delayMs)} (attempt ${e.attempt})`;
    }
    if (e.state === "connected") return "reconnected to the relay; registrations replayed";
    return `relay connection ${e.state}${e.error ? `: ${e.error}` : ""}`;
  },
  "dispatch-error": (e) => `dispatch from ${e.from} (layer ${e.layer}) failed: ${e.code}: ${e.error}`,
  drain: (e) => `drain requested (${e.reason}): finishing ${plural(e.inFlight, "in-flight request")}`,
  drained: (e) =>
    `drained: served ${plural(e.requests, "request")} (${plural(e.tokens, "token")})${e.failed ? `, ${e.failed} failed` : ""}${e.inFlightAbandoned ? `, ${e.inFlightAbandoned} abandoned at the drain timeout` : ""}; deregistered${e.slices !== undefined && e.slices > 1 ? ` ${e.slices} slices` : ""}`,
  paused: (e) => {
    if (e.by !== "self") {
      return `paused by the hub (${e.by})${e.reason ? `: ${e.reason}` : ""}; it routes this worker nothing new until resumed`;
    }
    const why =
      e.reason === "thermal"
        ? `too hot (${e.tempC?.toFixed(1)} °C)`
        : `battery low (${e.battery}%, discharging)`;
    return `paused: ${why}; the hub routes this worker nothing new until it recovers`;
  },
  resumed: (e) => {
    if (e.by !== "self") return `resumed by the hub (${e.by})`;
    const figures = [
      e.battery !== undefined ? `battery ${e.battery}%` : undefined,
      e.tempC !== undefined ? `${e.tempC.toFixed(1)} °C` : undefined,
    ].filter(Boolean);
    return `resumed${figures.length > 0 ? ` (${figures.join(", ")})` : ""}`;
  },
  "pause-unreported": (e) => `could not tell the hub of this pause (${e.code}: ${e.error})`,
  "grow-failed": (e) => `cannot take another slice (${e.code}: ${e.error}); serving the ones it has`,
  stopped: (e) => `stopped before serving (${e.reason})`,
  exit: (e) => `exit ${e.code}`,
  error: (e) => `error: ${e.code}: ${e.error}`,
};

/** The one line a person reads for an event (no time stamp). */
export function formatWorkerEvent(e: WorkerEventBody): string {
  return (FORMATTERS[e.event] as (e: WorkerEventBody) => string)(e);
}
