import { createHash, createPublicKey, type KeyObject, sign, verify } from "node:crypto";
import { AuthError, type DirectKeyJson, InvalidArgumentError } from "@moeswarm/core";

/*
 * A direct-link ticket: the hub's word that backbone `sub` may dispatch to worker `wk`, so a
 * worker can admit a backbone that dials it without asking the hub (the relay checks the same
 * thing on every forwarded frame).
 *
 *   mswt1.<base64url(JSON claims)>.<base64url(Ed25519 signature of "mswt1." + claims part)>
 *
 * claims: {"kid": signing key id, "sub": backbone id, "own"?: its principal, "wk": worker id,
 * "iat": issued (unix ms), "exp": expiry (unix ms)}. Ed25519 (node:crypto) because the verifier
 * is a worker, which must not hold the hub's HMAC secret: it only needs the public key, fetched
 * once from `GET /api/direct/key`.
 */

export interface DirectTicketClaims {
  /** The signing key's id (DirectKeyJson.kid). */
  kid: string;
  /** The backbone's relay id. */
  sub: string;
  /** The backbone's principal, when its token named one. */
  own?: string;
  /** The worker the ticket admits the backbone to. */
  wk: string;
  /** Issued, unix ms. */
  iat: number;
  /** Expiry, unix ms. */
  exp: number;
}

const PREFIX = "mswt1.";
const MAX_TICKET_CHARS = 2048;

/** The key id of a public key: the first 16 hex digits of SHA-256 of its SPKI DER. */
export function directKeyId(publicKey: KeyObject): string {
  const der = publicKey.export({ format: "der", type: "spki" });
  return createHash("sha256").update(der).digest("hex").slice(0, 16);
}

/** The public half of a signing key as the hub publishes it. */
export function directKeyJson(publicKey: KeyObject): DirectKeyJson {
  const der = publicKey.export({ format: "der", type: "spki" });
  return { alg: "Ed25519", kid: directKeyId(publicKey), spki: Buffer.from(der).toString("base64") };
}

/** Reads the hub's published key; a malformed answer is an InvalidArgumentError. */
export function parseDirectKey(json: unknown): { kid: string; key: KeyObject } {
  const j = json as Partial<DirectKeyJson> | null;
  if (j?.alg !== "Ed25519" || typeof j.spki !== "string" || typeof j.kid !== "string") {
    throw new InvalidArgumentError("the hub's direct-link key is not an Ed25519 key");
  }
  let key: KeyObject;
  try {
    key = createPublicKey({ key: Buffer.from(j.spki, "base64"), format: "der", type: "spki" });
  } catch (cause) {
    throw new InvalidArgumentError("the hub's direct-link key does not parse", { cause });
  }
  if (key.asymmetricKeyType !== "ed25519" || directKeyId(key) !== j.kid) {
    throw new InvalidArgumentError("the hub's direct-link key does not match its id");
  }
  return { kid: j.kid, key };
}

/** Signs a ticket with the hub's private key (`kid` is taken from `publicKey`). */
export function signDirectTicket(
  claims: Omit<DirectTicketClaims, "kid">,
  privateKey: KeyObject,
  publicKey: KeyObject,
): string {
  const body: DirectTicketClaims = { kid: directKeyId(publicKey), ...claims };
  const part = Buffer.from(JSON.stringify(body)).toString("base64url");
  const signature = sign(null, Buffer.from(PREFIX + part), privateKey);
  return `${PREFIX}${part}.${signature.toString("base64url")}`;
}

function invalid(message: string): AuthError {
  return new AuthError("MOESWARM_AUTH_TICKET_INVALID", `direct-link ticket refused: ${message}`);
}

/** The key id a ticket claims, before any check (undefined when it does not parse). */
export function ticketKeyId(ticket: string): string | undefined {
  try {
    const part = ticket.slice(PREFIX.length).split(".")[0] ?? "";
    const kid = (JSON.parse(Buffer.from(part, "base64url").toString("utf8")) as { kid?: unknown }).kid;
    return typeof kid === "string" ? kid : undefined;
  } catch {
    return undefined;
  }
}

export interface VerifyTicketOptions {
  /** The hub's public keys by id. */
  keys: ReadonlyMap<string, KeyObject>;
  /** This worker's id: a ticket for another worker is refused. */
  worker: string;
  /** The id the backbone said hello with: a ticket minted for another backbone is refused. */
  backbone: string;
  /** Now, unix ms (default Date.now()). */
  now?: number;
}

/**
 * Checks a ticket: the signature (first, before the claims are trusted), the worker, the backbone
 * and the expiry. Refusals are AuthErrors with MOESWARM_AUTH_TICKET_INVALID or _EXPIRED.
 */
export function verifyDirectTicket(ticket: unknown, o: VerifyTicketOptions): DirectTicketClaims {
  if (typeof ticket !== "string" || ticket.length > MAX_TICKET_CHARS || !ticket.startsWith(PREFIX)) {
    throw invalid("not a direct-link ticket");
  }
  const parts = ticket.slice(PREFIX.length).split(".");
  if (parts.length !== 2) throw invalid("malformed");
  const [part, sig] = parts as [string, string];
  const kid = ticketKeyId(ticket);
  const key = kid === undefined ? undefined : o.keys.get(kid);
  if (!key) throw invalid(`signed by a key this worker does not know (${kid ?? "none"})`);
  if (!verify(null, Buffer.from(PREFIX + part), key, Buffer.from(sig, "base64url"))) {
    throw invalid("bad signature");
  }
  const c = JSON.parse(Buffer.from(part, "base64url").toString("utf8")) as DirectTicketClaims;
  if (c.wk !== o.worker) throw invalid(`it admits to worker ${JSON.stringify(c.wk)}, not this one`);
  if (c.sub !== o.backbone) throw invalid(`it was issued to backbone ${JSON.stringify(c.sub)}`);
  if (!Number.isFinite(c.exp) || c.exp <= (o.now ?? Date.now())) {
    throw new AuthError(
      "MOESWARM_AUTH_TICKET_EXPIRED",
      "direct-link ticket expired: ask the hub for a new one",
    );
  }
  return c;
}
