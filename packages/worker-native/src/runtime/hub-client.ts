import { HubError, InvalidArgumentError } from "@moeswarm/core";
import { parseManifest, type SliceManifest } from "@moeswarm/shard";
import { type CaOption, hubAnswerError, openRequest, readBody } from "./http.js";

/** What a worker offers when it claims (the hub's `capacity` object). */
export interface ClaimCapacity {
  ramBytes: number;
  vramBytes?: number;
  backend?: string;
  bandwidthBps?: number;
}

/** One under-covered range of `GET /api/demand`. */
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
  url: string;
}

export interface DemandJson {
  time: number;
  policy?: { leaseTtlMs?: number };
  ranges: DemandRangeJson[];
}

/** A lease as `POST /api/claims` answers it. */
export interface LeaseJson {
  leaseId: string;
  worker: string;
  model: string;
  layers: string;
  experts: string;
  bytes: number;
  grantedAt: number;
  expiresAt: number;
  ttlMs: number;
  url: string;
  manifest: string;
}

const JSON_LIMIT = 16 * 1024 * 1024;
const MANIFEST_LIMIT = 256 * 1024 * 1024;

function bad(what: string): HubError {
  return new HubError("MOESWARM_HUB_BAD_REQUEST", `the hub answered ${what} this worker cannot use`);
}

function isObject(v: unknown): v is Record<string, unknown> {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

function checkLease(v: unknown): LeaseJson {
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
    throw bad("a lease");
  }
  return v as unknown as LeaseJson;
}

/** The hub's market API as a worker uses it: demand, claims, leases, manifests. */
export class HubClient {
  readonly base: URL;
  readonly #token: string;
  readonly #ca: CaOption | undefined;

  constructor(hub: string | URL, token: string, ca?: CaOption) {
    let base: URL;
    try {
      base = new URL(String(hub));
    } catch {
      throw new InvalidArgumentError(
        "MOESWARM_INVALID_ARGUMENT",
        `hub ${JSON.stringify(String(hub))} is not a URL`,
      );
    }
    if (base.protocol !== "http:" && base.protocol !== "https:") {
      throw new InvalidArgumentError(
        "MOESWARM_INVALID_ARGUMENT",
        `hub must be an http(s) URL, got ${base.href}`,
      );
    }
    this.base = base;
    this.#token = token;
    this.#ca = ca;
  }

  /** An absolute URL for a path the hub answered (relative to its base). */
  resolve(path: string): URL {
    return new URL(path, this.base);
  }

  /** The relay's URL on this hub: ws(s)://host/relay. */
  relayUrl(): string {
    const u = new URL("/relay", this.base);
    u.protocol = this.base.protocol === "https:" ? "wss:" : "ws:";
    return u.href;
  }

  get ca(): CaOption | undefined {
    return this.#ca;
  }

  /** The Authorization header of this worker's token. */
  authHeader(): Record<string, string> {
    return { authorization: `Bearer ${this.#token}` };
  }

  async #json(
    method: string,
    path: string,
    options: { body?: unknown; signal?: AbortSignal | undefined; limit?: number } = {},
  ): Promise<unknown> {
    const url = this.resolve(path);
    const res = await openRequest(url, {
      method,
      headers: { accept: "application/json", ...this.authHeader() },
      ca: this.#ca,
      signal: options.signal,
      ...(options.body === undefined ? {} : { body: JSON.stringify(options.body) }),
    });
    const body = await readBody(res, options.limit ?? JSON_LIMIT, url);
    const status = res.statusCode ?? 0;
    if (status < 200 || status >= 300) throw hubAnswerError(status, body, url);
    try {
      return JSON.parse(body.toString("utf8"));
    } catch {
      throw new HubError("MOESWARM_HUB_BAD_REQUEST", `${url.pathname} answered ${status} without JSON`);
    }
  }

  async demand(
    options: { model?: string | undefined; signal?: AbortSignal | undefined } = {},
  ): Promise<DemandJson> {
    const q = options.model === undefined ? "" : `?model=${encodeURIComponent(options.model)}`;
    const v = await this.#json("GET", `/api/demand${q}`, { signal: options.signal });
    if (!isObject(v) || !Array.isArray(v.ranges)) throw bad("a demand");
    return v as unknown as DemandJson;
  }

  async claim(
    body: {
      model: string;
      layers: string;
      experts: string;
      capacity: ClaimCapacity;
      worker?: string;
      ttlMs?: number;
      /** Give back every other lease of this worker first (it just started: they are a previous run's). */
      replaceLeases?: boolean;
    },
    signal?: AbortSignal,
  ): Promise<LeaseJson> {
    return checkLease(await this.#json("POST", "/api/claims", { body, signal }));
  }

  async claimAuto(
    body: { model?: string; capacity: ClaimCapacity; worker?: string; ttlMs?: number },
    signal?: AbortSignal,
  ): Promise<LeaseJson> {
    return checkLease(await this.#json("POST", "/api/claims/auto", { body, signal }));
  }

  async renew(leaseId: string, ttlMs: number | undefined, signal?: AbortSignal): Promise<LeaseJson> {
    return checkLease(
      await this.#json("POST", `/api/claims/${encodeURIComponent(leaseId)}/renew`, {
        body: ttlMs === undefined ? {} : { ttlMs },
        signal,
      }),
    );
  }

  async release(leaseId: string, signal?: AbortSignal): Promise<void> {
    await this.#json("DELETE", `/api/claims/${encodeURIComponent(leaseId)}`, { signal });
  }

  async manifest(path: string, signal?: AbortSignal): Promise<SliceManifest> {
    return parseManifest(await this.#json("GET", path, { signal, limit: MANIFEST_LIMIT }));
  }
}
