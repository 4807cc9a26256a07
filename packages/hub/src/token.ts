import { createHmac, timingSafeEqual } from "node:crypto";
import { AuthError, InvalidArgumentError } from "@moeswarm/core";

/*
 * Token format (v1), compact and URL-safe:
 *
 *   msw1.<base64url(JSON claims)>.<base64url(HMAC-SHA256(secret, "msw1." + claims part))>
 *
 * claims: {"r": role, "sub"?: peer id, "own"?: principal, "iat": issued (unix s), "exp": expiry (unix s)}.
 * `own` names who the identity belongs to (a person or organisation the operator enrolled): the
 * hub counts replicas, and backbones pair answers, by distinct principals. Absent: the id.
 * The signature covers the prefix so a future format cannot be confused with this one; it is
 * checked (in constant time) before the claims are parsed. See README.md "Tokens".
 */

export type TokenRole = "worker" | "backbone" | "admin";

export interface TokenClaims {
  role: TokenRole;
  /** The peer id the token is bound to; any id when absent. */
  id?: string;
  /** The principal the identity belongs to (`own`); the id when absent. */
  owner?: string;
  /** Issued at, unix seconds. */
  iat: number;
  /** Expires at, unix seconds. */
  exp: number;
}

/** One secret, or several during a rotation (tokens signed with any of them verify). */
export type TokenSecret = string | Uint8Array | ReadonlyArray<string | Uint8Array>;

const PREFIX = "msw1.";
const MAX_TOKEN_CHARS = 2048;
const MIN_SECRET_BYTES = 16;
const ROLES: readonly TokenRole[] = ["worker", "backbone", "admin"];

function secretsOf(secret: TokenSecret): Buffer[] {
  const list =
    typeof secret === "string" || secret instanceof Uint8Array
      ? [secret]
      : Array.isArray(secret)
        ? [...(secret as ReadonlyArray<string | Uint8Array>)]
        : [];
  if (list.length === 0) throw new InvalidArgumentError("no token secret given");
  return list.map((s) => {
    const b =
      typeof s === "string"
        ? Buffer.from(s, "utf8")
        : s instanceof Uint8Array
          ? Buffer.from(s)
          : Buffer.alloc(0);
    if (b.byteLength < MIN_SECRET_BYTES) {
      throw new InvalidArgumentError(
        `a token secret needs at least ${MIN_SECRET_BYTES} bytes (32 random bytes recommended)`,
      );
    }
    return b;
  });
}

/** Throws InvalidArgumentError when `secret` cannot sign tokens (missing, shorter than 16 bytes). */
export function checkSecret(secret: TokenSecret): void {
  secretsOf(secret);
}

function sign(key: Buffer, body: string): Buffer {
  return createHmac("sha256", key).update(body).digest();
}

export interface MintTokenOptions {
  role: TokenRole;
  /** Bind the token to this peer id. */
  id?: string;
  /** The principal the identity belongs to (default: the id): replicas count distinct owners. */
  owner?: string;
  /** Lifetime in seconds. */
  ttlS: number;
  /** Clock override, unix ms (tests). */
  now?: number;
}

/** Signs a token with the first secret. */
export function mintToken(options: MintTokenOptions, secret: TokenSecret): string {
  const { role, id, owner, ttlS } = options ?? ({} as MintTokenOptions);
  if (!ROLES.includes(role)) {
    throw new InvalidArgumentError(`token role must be one of ${ROLES.join(", ")}`);
  }
  if (id !== undefined && (typeof id !== "string" || id.length === 0 || Buffer.byteLength(id) > 128)) {
    throw new InvalidArgumentError("token id must be a string of 1..128 bytes");
  }
  if (
    owner !== undefined &&
    (typeof owner !== "string" || owner.length === 0 || Buffer.byteLength(owner) > 128)
  ) {
    throw new InvalidArgumentError("token owner must be a string of 1..128 bytes");
  }
  if (typeof ttlS !== "number" || !Number.isFinite(ttlS) || ttlS <= 0) {
    throw new InvalidArgumentError("ttlS must be a positive number of seconds");
  }
  const iat = Math.floor((options.now ?? Date.now()) / 1000);
  const claims: Record<string, unknown> = { r: role };
  if (id !== undefined) claims.sub = id;
  if (owner !== undefined) claims.own = owner;
  claims.iat = iat;
  claims.exp = iat + Math.ceil(ttlS);
  const body = PREFIX + Buffer.from(JSON.stringify(claims)).toString("base64url");
  const key = secretsOf(secret)[0] as Buffer;
  return `${body}.${sign(key, body).toString("base64url")}`;
}

export interface VerifyTokenOptions {
  /** The role the bearer wants to act as; an admin token may act as any role. */
  role?: TokenRole;
  /** The peer id the bearer claims; must match a bound token. */
  id?: string;
  /** Clock override, unix ms (tests). */
  now?: number;
  /** Accepted clock skew on expiry, seconds (default 0). */
  leewayS?: number;
}

/** Verifies signature, expiry, role and id binding; throws AuthError with the reason's code. */
export function verifyToken(
  token: unknown,
  secret: TokenSecret,
  options: VerifyTokenOptions = {},
): TokenClaims {
  const keys = secretsOf(secret);
  if (token === undefined || token === null || token === "") {
    throw new AuthError("MOESWARM_AUTH_MISSING", "no token presented");
  }
  if (typeof token !== "string" || token.length > MAX_TOKEN_CHARS || !token.startsWith(PREFIX)) {
    throw new AuthError("the token is not a moeswarm v1 token");
  }
  const dot = token.lastIndexOf(".");
  if (dot <= PREFIX.length) throw new AuthError("the token is not a moeswarm v1 token");
  const body = token.slice(0, dot);
  const sig = Buffer.from(token.slice(dot + 1), "base64url");
  let ok = false;
  for (const key of keys) {
    const expected = sign(key, body);
    // timingSafeEqual needs equal lengths; a wrong length is no secret
    if (sig.byteLength === expected.byteLength && timingSafeEqual(sig, expected)) ok = true;
  }
  if (!ok) throw new AuthError("the token's signature does not verify");

  let raw: unknown;
  try {
    raw = JSON.parse(Buffer.from(body.slice(PREFIX.length), "base64url").toString("utf8"));
  } catch {
    throw new AuthError("the token's claims are not JSON");
  }
  if (typeof raw !== "object" || raw === null) throw new AuthError("the token's claims are not an object");
  const c = raw as Record<string, unknown>;
  if (
    !ROLES.includes(c.r as TokenRole) ||
    !Number.isInteger(c.iat) ||
    !Number.isInteger(c.exp) ||
    (c.sub !== undefined && typeof c.sub !== "string") ||
    (c.own !== undefined && (typeof c.own !== "string" || c.own.length === 0))
  ) {
    throw new AuthError("the token's claims are malformed");
  }
  const claims: TokenClaims = { role: c.r as TokenRole, iat: c.iat as number, exp: c.exp as number };
  if (c.sub !== undefined) claims.id = c.sub as string;
  if (c.own !== undefined) claims.owner = c.own as string;

  const nowS = (options.now ?? Date.now()) / 1000;
  if (nowS >= claims.exp + (options.leewayS ?? 0)) {
    throw new AuthError(
      "MOESWARM_AUTH_EXPIRED",
      `the token expired at ${new Date(claims.exp * 1000).toISOString()}`,
      {
        details: { exp: claims.exp },
      },
    );
  }
  if (options.role !== undefined && claims.role !== options.role && claims.role !== "admin") {
    throw new AuthError("MOESWARM_AUTH_ROLE", `a ${claims.role} token cannot act as ${options.role}`, {
      details: { tokenRole: claims.role, role: options.role },
    });
  }
  if (options.id !== undefined && claims.id !== undefined && claims.id !== options.id) {
    throw new AuthError("MOESWARM_AUTH_ROLE", `the token is bound to peer ${JSON.stringify(claims.id)}`, {
      details: { tokenId: claims.id, id: options.id },
    });
  }
  return claims;
}

/** Why an unbound worker or backbone token is refused, and how to mint one that is bound. */
export function unboundMessage(role: TokenRole): string {
  return (
    `this ${role} token is not bound to a peer id: mint one with \`moeswarm-hub token --role ${role} --id <id>\`` +
    " (mintToken({ role, id })), or start the hub with --allow-unbound-tokens (allowUnboundTokens: a private swarm only)"
  );
}

/** The principal of a token's identity: its `own` claim, else its id, else `fallback`. */
export function principalOf(claims: TokenClaims, fallback: string): string {
  return claims.owner ?? claims.id ?? fallback;
}
