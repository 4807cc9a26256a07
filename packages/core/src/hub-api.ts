import { HubError } from "./errors.js";

// The hub's HTTP API bodies (README "Hub HTTP API"), written once for both sides: the hub builds
// and checks them (packages/hub market-http.ts, stats.ts), the clients (the worker runtime, the
// backbone's hub link, relay-client's HubClient) send and read them. Ranges travel as half-open
// "a:b" strings; paths are relative to the hub's base URL.

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Most bytes of a worker or backbone id (UTF-8). */
export const MAX_HUB_ID_BYTES = 128;

/** A worker or backbone id: a string of 1..128 UTF-8 bytes. */
export function isHubId(value: unknown): value is string {
  return typeof value === "string" && value.length > 0 && Buffer.byteLength(value) <= MAX_HUB_ID_BYTES;
}

// --- claims and leases ------------------------------------------------------------------------

/** What a worker offers when it claims (the `capacity` object of a claim). */
export interface ClaimCapacityJson {
  /** Host memory offered for expert weights, bytes. */
  readonly ramBytes?: number;
  /** Device memory offered, bytes. What a claim must fit: see {@link capacityWeightBytes}. */
  readonly vramBytes?: number;
  /** "cpu", "cuda", "hip", "vulkan", "metal"...: a GPU backend's claims are sized by `vramBytes`. */
  readonly backend?: string;
  /** Measured download bandwidth, bytes/s (informative). */
  readonly bandwidthBps?: number;
}

/** Capacity backends whose expert weights live in device memory (see {@link capacityWeightBytes}). */
export const GPU_CAPACITY_BACKENDS: readonly string[] = Object.freeze([
  "cuda",
  "hip",
  "vulkan",
  "metal",
  "sycl",
]);

/**
 * The bytes of expert weights a capacity holds, the one rule the hub's claims and the worker's
 * choices share: a GPU backend's weights are uploaded to the device (host memory only stages them
 * while loading), so they must fit `vramBytes` when it is given; any other backend computes from
 * host memory, `ramBytes + vramBytes` (as before device memory was counted apart).
 */
export function capacityWeightBytes(capacity: ClaimCapacityJson): number {
  const ram = capacity.ramBytes ?? 0;
  const vram = capacity.vramBytes ?? 0;
  const gpu =
    typeof capacity.backend === "string" && GPU_CAPACITY_BACKENDS.includes(capacity.backend.toLowerCase());
  return gpu && vram > 0 ? vram : ram + vram;
}

/** `POST /api/claims`: one rectangle of layers x experts of a model. */
export interface ClaimRequestJson {
  model: string;
  layers: string;
  experts: string;
  capacity: ClaimCapacityJson;
  /** Required when the token is not bound to a worker id. */
  worker?: string;
  ttlMs?: number;
  /** Give back every other lease of this worker first (it just started: they are a previous run's). */
  replaceLeases?: boolean;
}

/** `POST /api/claims/auto`: the hub picks what fits. */
export interface AutoClaimRequestJson {
  model?: string;
  capacity: ClaimCapacityJson;
  worker?: string;
  ttlMs?: number;
}

/** `POST /api/claims/:id/renew`. */
export interface RenewRequestJson {
  ttlMs?: number;
}

/** The shapes of the claim bodies, as the hub's 400 answers describe them. */
export const CLAIM_BODY_SHAPE =
  '{"model", "layers": "a:b", "experts": "c:d", "capacity": {...}, "worker"?, "ttlMs"?, "replaceLeases"?}';
export const AUTO_CLAIM_BODY_SHAPE = '{"model"?, "capacity": {...}, "worker"?, "ttlMs"?}';
export const RENEW_BODY_SHAPE = '{"ttlMs"?}';
export const CAPACITY_SHAPE = '{"ramBytes", "vramBytes"?, "backend"?, "bandwidthBps"?}';

/** A lease as the hub answers claims, renewals and `GET /api/claims/:id`. */
export interface LeaseJson {
  leaseId: string;
  worker: string;
  model: string;
  layers: string;
  experts: string;
  bytes: number;
  grantedAt: number;
  expiresAt: number;
  /** Milliseconds left, by the hub's clock (renew well before it reaches 0). */
  ttlMs: number;
  /** The slice to download (relative to the hub's base URL). */
  url: string;
  /** The model's manifest (slab sha256s to verify the download against). */
  manifest: string;
  capacity: ClaimCapacityJson;
}

/** `DELETE /api/claims/:id`. */
export interface ReleasedJson {
  released: string;
}

/** The expert-shard download of a rectangle of a model. */
export function shardUrl(model: string, layers: string, experts: string): string {
  return `/api/models/${encodeURIComponent(model)}/expert-shard?layers=${layers}&experts=${experts}`;
}

/** A model's manifest. */
export function manifestUrl(model: string): string {
  return `/api/models/${encodeURIComponent(model)}/manifest`;
}

function unusable(what: string): HubError {
  return new HubError("MOESWARM_HUB_BAD_REQUEST", `the hub answered ${what} this client cannot use`);
}

/** Checks a lease body (the fields a client acts on); HubError MOESWARM_HUB_BAD_REQUEST otherwise. */
export function parseLeaseJson(v: unknown): LeaseJson {
  if (
    !isObject(v) ||
    typeof v.leaseId !== "string" ||
    typeof v.model !== "string" ||
    typeof v.layers !== "string" ||
    typeof v.experts !== "string" ||
    typeof v.url !== "string" ||
    typeof v.manifest !== "string" ||
    typeof v.ttlMs !== "number" ||
    typeof v.bytes !== "number"
  ) {
    throw unusable("a lease");
  }
  return v as unknown as LeaseJson;
}

// --- demand -----------------------------------------------------------------------------------

/** The market's policy, as `GET /api/demand` reports it. */
export interface DemandPolicyJson {
  halfLifeMs?: number;
  prior?: number;
  hotLoad?: number;
  maxReplicas?: number;
  uncoveredValue?: number;
  leaseTtlMs?: number;
}

/** One under-covered range of `GET /api/demand` (one layer, a run of experts). */
export interface DemandRangeJson {
  model: string;
  layer: number;
  /** "a:b" */
  layers: string;
  /** "a:b" */
  experts: string;
  count: number;
  target: number;
  coverage: number;
  pending: number;
  missing: number;
  hot: boolean;
  value: number;
  bytes: number;
  bytesPerExpert: number;
  /** Experts of the layer (hubs of this version list it). */
  nExpert?: number;
  /** Its download (`shardUrl`). */
  url: string;
}

/** `GET /api/demand?model=&limit=`. */
export interface DemandJson {
  time: number;
  policy?: DemandPolicyJson;
  /** Per-model market summaries (informative). */
  models?: unknown[];
  ranges: DemandRangeJson[];
}

/** Checks a demand body; HubError MOESWARM_HUB_BAD_REQUEST otherwise. */
export function parseDemandJson(v: unknown): DemandJson {
  if (!isObject(v) || !Array.isArray(v.ranges)) throw unusable("a demand");
  return v as unknown as DemandJson;
}

// --- placement --------------------------------------------------------------------------------

/** One slice a live worker registered. */
export interface PlacementRegistrationJson {
  id: string;
  model: string;
  layers: number[];
  experts: number[];
  /**
   * The principal the worker's token was issued to (`own` claim; the id when the token has none).
   * Replicas count, and verification pairs, only distinct principals.
   */
  owner?: string;
  /** How the worker computes (backend + ISA/build, e.g. "ggml-cpu-x86_64"), when it said at register. */
  computeClass?: string;
  /**
   * The activation dtypes the worker's compute takes (its hello's `caps.dtypes`), when it said:
   * a backbone sends q8_0 / q8_K rows at once to workers that list them, and f32 to workers that
   * list neither. Absent: an older worker, which a backbone tries once and learns from.
   */
  dtypes?: string[];
  /** Where a backbone may reach the worker directly, when it advertised endpoints. */
  direct?: DirectEndpointJson;
}

// --- direct links -------------------------------------------------------------------------------

/**
 * A worker's direct endpoints (`PUT /api/workers/:id/direct`, and each placement registration's
 * `direct`): `wss://` URLs serving the relay's frames, and the SHA-256 fingerprint of the TLS
 * certificate they present, which a backbone pins (no CA involved).
 */
export interface DirectEndpointJson {
  /** `wss://host:port` URLs, tried in order (may be empty when `native` lists addresses). */
  endpoints: string[];
  /** SHA-256 of the certificate's DER, uppercase hex pairs joined by `:` (as Node's fingerprint256). */
  fingerprint: string;
  /**
   * The worker's native listener (`moeswarm-worker --listen-native`, protocol section 10.9): plain
   * `host:port` addresses (IPv6 as `[::1]:port`), at most {@link MAX_NATIVE_ADDRESSES}, behind the
   * same certificate. Absent: none (an older worker or hub).
   */
  native?: string[];
}

/** At most this many `native` addresses per worker. */
export const MAX_NATIVE_ADDRESSES = 8;
/** The longest `native` address (characters). */
export const MAX_NATIVE_ADDRESS_CHARS = 300;

/**
 * Whether `s` is a native listener's address as `DirectEndpointJson.native` lists it: `host:port`
 * with a host name or IPv4 address, or `[v6]:port`, port 1..65535, at most 300 characters.
 */
export function isNativeAddress(s: unknown): s is string {
  if (typeof s !== "string" || s.length > MAX_NATIVE_ADDRESS_CHARS) return false;
  const m = /^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})$/.exec(s);
  const port = m ? Number(m[2]) : 0;
  return m !== null && port >= 1 && port <= 65_535 && !/^0\d/.test(m[2] as string);
}

/** `GET /api/direct/key`: the hub's Ed25519 key that signs direct-link tickets. */
export interface DirectKeyJson {
  alg: "Ed25519";
  /** Key id: the first 16 hex digits of SHA-256 of the SPKI DER. */
  kid: string;
  /** The public key, SPKI DER in base64. */
  spki: string;
}

/** `POST /api/direct/tickets` with `{worker}` (a backbone token): a ticket for that worker. */
export interface DirectTicketJson {
  ticket: string;
  /** Expiry, unix ms. */
  exp: number;
}

/**
 * `POST /api/workers/:id/direct/served` (that worker's token): what it answered over direct links
 * since its last report, per backbone and model. The hub credits each pair the minimum of this and
 * what the backbone's own stats receipts accepted beyond the relay's forwards (docs/trust.md).
 */
export interface DirectServedJson {
  /** Increases with every report of this worker; a report not above the last one is a retry. */
  seq: number;
  served: Array<{
    backbone: string;
    model: string;
    /** Filled expert slots answered (ids != -1), as in the backbone's receipts. */
    expertTokens: number;
    requests?: number;
  }>;
}

/** The hub's answer to a DirectServedJson. */
export interface DirectServedOutcomeJson {
  worker: string;
  accepted: boolean;
  credited: Array<{ backbone: string; model: string; expertTokens: number }>;
  /** Entries naming a backbone that was never given a ticket to this worker: not counted. */
  refused: Array<{ backbone: string; model: string }>;
}

/** `GET /api/models/:model/placement?since=&wait=` (a long-poll; 304 when `since` is current). */
export interface PlacementJson {
  model: string;
  /** Changes whenever the registrations change; increases, also across restarts (it is >= the clock). */
  version: number;
  /** The MoE layers. */
  layers: number[];
  /** Experts per layer (the largest layer's). */
  experts: number;
  /**
   * Live, non-draining workers' slices, by worker id then in the order registered, one entry per
   * slice (a worker may have several): `Placement.fromRegistrations(registrations)` merges them.
   */
  registrations: PlacementRegistrationJson[];
  /** The same, per cell: runs of experts of one layer with the same owners. */
  owners: Array<{ layer: number; experts: string; workers: string[] }>;
  /** Experts nobody serves, per layer (`a:b,c:d`), as dispatch's `Placement.missing` reports them. */
  missing: Array<{ layer: number; experts: string; count: number }>;
}

// --- pausing a worker ---------------------------------------------------------------------------

/** Who paused a worker: its owner or the hub's operator (the hub's pause), or the worker itself. */
export type WorkerPauseBy = "owner" | "operator" | "self";

/** One pause in force: when (unix ms), and why when the pauser said. */
export interface WorkerPauseRecordJson {
  at: number;
  reason?: string;
}

/**
 * `GET /api/workers/:id/pause` (and the answer of `POST .../pause` and `.../resume`): whether the
 * hub leaves the worker out of placements. Two pauses are kept apart: the hub's (set by the
 * worker's owner or the operator, lifted by either) and the worker's own (battery, heat), so a
 * phone that cools down never lifts its owner's pause.
 */
export interface WorkerPauseJson {
  worker: string;
  paused: boolean;
  hub?: WorkerPauseRecordJson & { by: "owner" | "operator" };
  self?: WorkerPauseRecordJson;
  /**
   * Set while the paused worker is not connected: when the hub last saw it (absent: not since the
   * pause was set), whether `GET /api/workers` still lists it (the hub forgets workers unseen for
   * its `forgetWorkersAfterMs`), and when the pause is dropped unless the worker comes back (the
   * hub's `pauseRetentionMs`, counted from the later of the pause and the last sighting).
   */
  away?: { lastSeen?: number; listed: boolean; dropsAt: number };
}

/** The path of a worker's pause: state (GET), pause and resume (POST). */
export function workerPauseUrl(worker: string, action: "pause" | "resume" = "pause"): string {
  return `/api/workers/${encodeURIComponent(worker)}/${action}`;
}

/**
 * The message of the relay notice (a connection-level `error` frame, code MOESWARM_HUB_PAUSED or
 * MOESWARM_HUB_RESUMED) that tells a worker of the hub's pause, and the line it prints:
 * "paused by the hub (owner): <reason>".
 */
export function workerPauseNotice(paused: boolean, by: "owner" | "operator", reason?: string): string {
  return `${paused ? "paused" : "resumed"} by the hub (${by})${reason ? `: ${reason}` : ""}`;
}

/** Reads a workerPauseNotice message back; undefined when it is not one. */
export function parseWorkerPauseNotice(
  msg: string,
): { paused: boolean; by: "owner" | "operator"; reason?: string } | undefined {
  const m = /^(paused|resumed) by the hub \((owner|operator)\)(?:: ([\s\S]*))?$/.exec(msg);
  if (!m) return undefined;
  const by = m[2] as "owner" | "operator";
  return { paused: m[1] === "paused", by, ...(m[3] !== undefined ? { reason: m[3] } : {}) };
}

/** Checks a worker pause body; HubError MOESWARM_HUB_BAD_REQUEST otherwise. */
export function parseWorkerPauseJson(v: unknown): WorkerPauseJson {
  if (!isObject(v) || !isHubId(v.worker) || typeof v.paused !== "boolean") throw unusable("a worker pause");
  for (const r of [v.hub, v.self]) {
    if (r !== undefined && (!isObject(r) || typeof r.at !== "number")) throw unusable("a worker pause");
  }
  if (isObject(v.hub) && v.hub.by !== "owner" && v.hub.by !== "operator") throw unusable("a worker pause");
  return v as unknown as WorkerPauseJson;
}

/** `GET /api/pauses`: every worker under a pause (the hub's, its own, or both), ordered by id. */
export interface WorkerPauseListJson {
  pauses: WorkerPauseJson[];
}

/** The path of the list of pauses in force. */
export const WORKER_PAUSES_PATH = "/api/pauses";

/** Checks a `GET /api/pauses` body; HubError MOESWARM_HUB_BAD_REQUEST otherwise. */
export function parseWorkerPauseListJson(v: unknown): WorkerPauseListJson {
  if (!isObject(v) || !Array.isArray(v.pauses)) throw unusable("a list of worker pauses");
  return { pauses: v.pauses.map(parseWorkerPauseJson) };
}

// --- reputation -------------------------------------------------------------------------------

/** One quarantined worker, as `GET /api/quarantines` lists it. */
export interface QuarantineJson {
  worker: string;
  /** When the hub took the report, unix ms. */
  at: number;
  /** The backbone that reported it. */
  by: string;
  model: string;
  reason: string;
}

/** `GET /api/quarantines`: every worker quarantined on the hub (backbones seed their own from it). */
export interface QuarantinesJson {
  quarantined: QuarantineJson[];
}

export const QUARANTINES_PATH = "/api/quarantines";

/** Checks a `GET /api/quarantines` body; HubError MOESWARM_HUB_BAD_REQUEST otherwise. */
export function parseQuarantinesJson(v: unknown): QuarantinesJson {
  if (!isObject(v) || !Array.isArray(v.quarantined)) throw unusable("a quarantine list");
  for (const q of v.quarantined) {
    if (!isObject(q) || !isHubId(q.worker)) throw unusable("a quarantine list");
  }
  return v as unknown as QuarantinesJson;
}

/** The placement path of a model, with the long-poll's query when `since` is given. */
export function placementUrl(model: string, since?: number, waitS?: number): string {
  const q = since === undefined ? "" : `?since=${since}${waitS === undefined ? "" : `&wait=${waitS}`}`;
  return `/api/models/${encodeURIComponent(model)}/placement${q}`;
}

// --- backbone stats ---------------------------------------------------------------------------

/** What one worker served a backbone during a report's span. */
export interface ReceiptJson {
  /** (token, expert) pairs the worker computed and returned. */
  expertTokens: number;
  /** Mean round trip the backbone measured, ms. */
  ms?: number;
}

/**
 * A backbone's periodic report (`POST /api/models/:model/stats`), as sent. Field by field in the
 * hub's README "Backbone stats".
 */
export interface StatsReportJson {
  /** The backbone's id when its token is not bound to one. */
  backbone?: string;
  /** Report sequence number of this backbone; a report whose seq is not above the last is a retry and ignored. */
  seq?: number;
  /** Tokens the backbone decoded (or prefilled) during the report's span. */
  tokens?: number;
  /** The span, ms. tokens/s = tokens / (ms / 1000). */
  ms?: number;
  /** Routing selections per MoE layer: one count per expert, or base64 of little-endian uint32. */
  counts?: Record<string, number[] | string>;
  receipts?: Record<string, ReceiptJson>;
}

/** A stats report as the hub checked it: counts per layer, receipts per worker. */
export interface StatsReport {
  backbone?: string;
  seq?: number;
  tokens?: number;
  ms?: number;
  /** Routing selections per MoE layer: one count per expert. */
  counts: Map<number, Uint32Array>;
  /** What each worker served the backbone during the span. */
  receipts: Map<string, ReceiptJson>;
}

/** The hub's answer to a stats report. */
export interface StatsOutcomeJson {
  model: string;
  backbone: string;
  /** false for a retry (seq not above the last one seen): nothing was counted again. */
  accepted: boolean;
  layers: number;
  credited: string[];
  /** Receipts for workers this hub has never seen (not credited). */
  ignored: string[];
}

/** Most workers one report may name. */
export const MAX_RECEIPTS = 4096;
const U32_MAX = 0xffff_ffff;
const BASE64 = /^[A-Za-z0-9+/]*={0,2}$/;

function badStats(message: string): HubError {
  return new HubError("MOESWARM_HUB_BAD_REQUEST", `stats: ${message}`);
}

function u32(v: unknown, what: string): number {
  if (!Number.isInteger(v) || (v as number) < 0 || (v as number) > U32_MAX) {
    throw badStats(`${what} must be an integer in 0..${U32_MAX}`);
  }
  return v as number;
}

function countsOf(value: unknown, n: number, layer: number): Uint32Array {
  if (typeof value === "string") {
    // base64 of n little-endian u32: 4/3 of the binary size, where a JSON array of large counts takes ~11 bytes each
    const expected = Math.ceil((4 * n) / 3) * 4;
    if (value.length !== expected || !BASE64.test(value)) {
      throw badStats(
        `counts of layer ${layer}: a base64 string must hold ${n} little-endian uint32 (${expected} characters)`,
      );
    }
    const bytes = Buffer.from(value, "base64");
    if (bytes.byteLength !== 4 * n) throw badStats(`counts of layer ${layer}: expected ${4 * n} bytes`);
    const out = new Uint32Array(n);
    for (let i = 0; i < n; i++) out[i] = bytes.readUInt32LE(4 * i);
    return out;
  }
  if (!Array.isArray(value)) throw badStats(`counts of layer ${layer} must be an array or a base64 string`);
  if (value.length !== n)
    throw badStats(`counts of layer ${layer} must have ${n} entries, not ${value.length}`);
  const out = new Uint32Array(n);
  for (let i = 0; i < n; i++) out[i] = u32(value[i], `counts[${layer}][${i}]`);
  return out;
}

/** The model a report is checked against: its id and the experts of each MoE layer. */
export interface StatsModelShape {
  readonly id: string;
  readonly layers: ReadonlyArray<{ readonly layer: number; readonly nExpert: number }>;
}

function parseReceipts(value: unknown, report: StatsReport): void {
  if (!isObject(value)) throw badStats('receipts must be an object {"<worker id>": {"expertTokens": n}}');
  const entries = Object.entries(value);
  if (entries.length > MAX_RECEIPTS) throw badStats(`receipts may name at most ${MAX_RECEIPTS} workers`);
  for (const [worker, r] of entries) {
    if (!isHubId(worker)) throw badStats("receipts: worker ids are 1..128 bytes");
    if (!isObject(r)) throw badStats(`receipts[${JSON.stringify(worker)}] must be an object`);
    const receipt: ReceiptJson = {
      expertTokens: u32(r.expertTokens, `receipts[${JSON.stringify(worker)}].expertTokens`),
    };
    if (r.ms !== undefined) {
      if (typeof r.ms !== "number" || !Number.isFinite(r.ms) || r.ms < 0 || r.ms > 3_600_000) {
        throw badStats(`receipts[${JSON.stringify(worker)}].ms must be a number of milliseconds`);
      }
      receipt.ms = r.ms;
    }
    report.receipts.set(worker, receipt);
  }
}

/** Parses and checks a report body; HubError MOESWARM_HUB_BAD_REQUEST says what is wrong. */
export function parseStatsReport(body: unknown, model: StatsModelShape): StatsReport {
  if (!isObject(body)) throw badStats("the body must be a JSON object");
  const report: StatsReport = { counts: new Map(), receipts: new Map() };
  if (body.backbone !== undefined) {
    if (!isHubId(body.backbone)) throw badStats("backbone must be an id of 1..128 bytes");
    report.backbone = body.backbone;
  }
  if (body.seq !== undefined) {
    if (!Number.isSafeInteger(body.seq) || (body.seq as number) < 0)
      throw badStats("seq must be an integer >= 0");
    report.seq = body.seq as number;
  }
  if (body.tokens !== undefined || body.ms !== undefined) {
    report.tokens = u32(body.tokens, "tokens");
    const ms = body.ms;
    if (typeof ms !== "number" || !Number.isFinite(ms) || ms <= 0 || ms > 86_400_000) {
      throw badStats(
        "ms (the span the report covers) must be a number in (0, 86400000] when tokens is given",
      );
    }
    report.ms = ms;
  }
  if (body.counts !== undefined) {
    if (!isObject(body.counts)) throw badStats('counts must be an object {"<layer>": [count per expert]}');
    const byLayer = new Map(model.layers.map((l) => [l.layer, l]));
    for (const [key, value] of Object.entries(body.counts)) {
      const layer = /^(0|[1-9][0-9]{0,8})$/.test(key) ? Number(key) : -1;
      const l = byLayer.get(layer);
      if (!l) throw badStats(`counts: ${JSON.stringify(key.slice(0, 32))} is not a MoE layer of ${model.id}`);
      report.counts.set(layer, countsOf(value, l.nExpert, layer));
    }
  }
  if (body.receipts !== undefined) parseReceipts(body.receipts, report);
  return report;
}
