// Direct links on the hub's side: the Ed25519 key that signs tickets (a backbone shows one to a
// worker it dials directly), and the check of the endpoints a worker advertises.
import { generateKeyPairSync, type KeyObject } from "node:crypto";
import {
  type DirectEndpointJson,
  type DirectKeyJson,
  type DirectTicketJson,
  isNativeAddress,
  MAX_NATIVE_ADDRESS_CHARS,
  MAX_NATIVE_ADDRESSES,
} from "@moeswarm/core";
import { directKeyJson, signDirectTicket } from "@moeswarm/relay-client";
import { badRequest } from "./http-errors.js";
import type { DirectPairRow, DirectWrite } from "./store-direct.js";

/** How long a ticket admits its backbone (it is asked again before every dial). */
export const TICKET_TTL_MS = 5 * 60_000;
const MAX_ENDPOINTS = 8;
const MAX_URL_BYTES = 512;
/** Pairs remembered for ticketed(); the oldest are forgotten first. */
const MAX_PAIRS = 100_000;
const FINGERPRINT = /^([0-9A-F]{2}:){31}[0-9A-F]{2}$/;

/**
 * The hub's ticket key. A new one per hub process: tickets live minutes and backbones ask for one
 * before every dial, and a worker fetches the key again when a ticket names one it has not seen.
 */
export class DirectKeys {
  readonly #privateKey: KeyObject;
  readonly #publicKey: KeyObject;
  readonly json: DirectKeyJson;
  /**
   * Backbone-worker pairs a ticket was minted for, oldest first (bounded), with the time. Kept in
   * the store (store-direct.ts): a direct link outlives the hub process that admitted it.
   */
  readonly #ticketed = new Map<string, DirectPairRow>();
  /** Pairs minted, and forgotten, since the last takeChanges. */
  #minted = new Map<string, DirectPairRow>();
  #forgotten = new Map<string, { backbone: string; worker: string }>();

  constructor() {
    const { privateKey, publicKey } = generateKeyPairSync("ed25519");
    this.#privateKey = privateKey;
    this.#publicKey = publicKey;
    this.json = directKeyJson(publicKey);
  }

  /**
   * Whether this hub admitted `backbone` to dial `worker` directly: the direct counterpart of
   * "the relay forwarded a request of this backbone to this worker", which a quarantine report
   * needs (a backbone may accuse only a worker it could have asked).
   */
  ticketed(backbone: string, worker: string): boolean {
    return this.#ticketed.has(`${backbone}\n${worker}`);
  }

  /** A ticket admitting backbone `backbone` (principal `owner`) to `worker`. */
  mint(backbone: string, owner: string | undefined, worker: string, now = Date.now()): DirectTicketJson {
    this.#remember({ backbone, worker, at: now }, true);
    const exp = now + TICKET_TTL_MS;
    const claims = {
      sub: backbone,
      ...(owner !== undefined ? { own: owner } : {}),
      wk: worker,
      iat: now,
      exp,
    };
    return { ticket: signDirectTicket(claims, this.#privateKey, this.#publicKey), exp };
  }

  /** The pairs the store kept (a restart), oldest first. */
  load(pairs: readonly DirectPairRow[]): void {
    for (const p of [...pairs].sort((a, b) => a.at - b.at)) this.#remember(p, false);
  }

  /** Pairs minted and forgotten since the last call, for the store (undefined: none). */
  takeChanges(): Pick<DirectWrite, "pairs" | "forgetPairs"> | undefined {
    if (this.#minted.size === 0 && this.#forgotten.size === 0) return undefined;
    const change = { pairs: [...this.#minted.values()], forgetPairs: [...this.#forgotten.values()] };
    this.#minted = new Map();
    this.#forgotten = new Map();
    return change;
  }

  /** A write of `takeChanges` failed: written with the next one (unless changed since). */
  restoreChanges(change: Pick<DirectWrite, "pairs" | "forgetPairs">): void {
    for (const p of change.pairs) {
      const k = `${p.backbone}\n${p.worker}`;
      if (this.#ticketed.has(k) && !this.#minted.has(k)) this.#minted.set(k, p);
    }
    for (const p of change.forgetPairs) {
      const k = `${p.backbone}\n${p.worker}`;
      if (!this.#ticketed.has(k)) this.#forgotten.set(k, p);
    }
  }

  #remember(p: DirectPairRow, changed: boolean): void {
    const k = `${p.backbone}\n${p.worker}`;
    this.#ticketed.delete(k);
    this.#ticketed.set(k, { ...p });
    if (changed) {
      this.#minted.set(k, { ...p });
      this.#forgotten.delete(k);
    }
    if (this.#ticketed.size > MAX_PAIRS) {
      const [oldest, o] = this.#ticketed.entries().next().value as [string, DirectPairRow];
      this.#ticketed.delete(oldest);
      this.#minted.delete(oldest);
      this.#forgotten.set(oldest, { backbone: o.backbone, worker: o.worker });
    }
  }
}

/**
 * Checks a `PUT /api/workers/:id/direct` body: `wss://` endpoints, a SHA-256 fingerprint, and the
 * native listener's `host:port` addresses (optional). Undefined withdraws: both lists empty.
 */
export function parseDirectEndpoint(body: unknown): DirectEndpointJson | undefined {
  const shape =
    '{"endpoints": ["wss://host:port", ...], "fingerprint": "AA:BB:...", "native"?: ["host:port", ...]}';
  if (typeof body !== "object" || body === null || Array.isArray(body)) {
    throw badRequest(`the body must be ${shape}`);
  }
  const { endpoints, fingerprint, native } = body as Record<string, unknown>;
  if (native !== undefined) {
    if (!Array.isArray(native) || native.length > MAX_NATIVE_ADDRESSES) {
      throw badRequest(`"native" must list 0..${MAX_NATIVE_ADDRESSES} host:port addresses`);
    }
    for (const a of native) {
      if (!isNativeAddress(a)) {
        throw badRequest(
          `native address ${JSON.stringify(a)} is not host:port (IPv6 as [::1]:port, at most ${MAX_NATIVE_ADDRESS_CHARS} characters)`,
        );
      }
    }
  }
  const nativeList = (native as string[] | undefined) ?? [];
  if (Array.isArray(endpoints) && endpoints.length === 0 && nativeList.length === 0) return undefined;
  if (!Array.isArray(endpoints) || endpoints.length > MAX_ENDPOINTS) {
    throw badRequest(`"endpoints" must list 0..${MAX_ENDPOINTS} wss:// URLs`);
  }
  for (const e of endpoints) {
    let url: URL | undefined;
    try {
      url = typeof e === "string" && Buffer.byteLength(e) <= MAX_URL_BYTES ? new URL(e) : undefined;
    } catch {
      url = undefined;
    }
    if (url?.protocol !== "wss:" || url.username !== "" || url.password !== "") {
      throw badRequest(`endpoint ${JSON.stringify(e)} is not a wss:// URL`);
    }
  }
  if (typeof fingerprint !== "string" || !FINGERPRINT.test(fingerprint)) {
    throw badRequest('"fingerprint" must be a SHA-256 fingerprint, 32 uppercase hex pairs joined by ":"');
  }
  return {
    endpoints: [...(endpoints as string[])],
    fingerprint,
    ...(nativeList.length > 0 ? { native: [...nativeList] } : {}),
  };
}
