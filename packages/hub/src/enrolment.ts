// Self-enrolment the operator allows: the operator issues a code for an owner (a person or
// organisation) with a number of uses and a lifetime (`moeswarm-hub enrol-code`); a worker trades
// it for a worker token bound to a fresh id under that owner (`POST /api/enrol`). Only the code's
// sha256 is kept. When a worker is quarantined, every unused code of its owner is revoked: a banned
// identity comes back under a new id only with a new code the operator chose to issue.
import { createHash, randomBytes } from "node:crypto";
import { HubError, InvalidArgumentError } from "@moeswarm/core";
import type { SqliteDatabase } from "./sqlite-driver.js";
import type { HubStore } from "./store.js";
import { openSideStore, type SideRun } from "./store-side.js";
import { mintToken, type TokenSecret } from "./token.js";
import { TokenBucket } from "./token-bucket.js";

/** An issued code as the store keeps it (never the code itself). */
export interface StoredEnrolCode {
  readonly hash: string;
  readonly owner: string;
  usesLeft: number;
  readonly expiresAt: number;
  readonly createdAt: number;
  revoked: boolean;
}

export interface EnrolStore {
  put(code: StoredEnrolCode): Promise<void>;
  get(hash: string): Promise<StoredEnrolCode | undefined>;
  /** Takes one use of a code and records the id it enrolled, in one transaction. */
  use(hash: string, id: string, owner: string, at: number): Promise<void>;
  /** The owner an enrolled id was issued for. */
  ownerOf(id: string): Promise<string | undefined>;
  /** Revokes the owner's codes that have uses left; returns how many. */
  revokeOwner(owner: string): Promise<number>;
  close(): Promise<void>;
}

const CODE_PREFIX = "mse1_";
/** Lifetime of a token bought with a code: a year (the operator revokes by banning). */
const ENROLLED_TOKEN_TTL_S = 365 * 24 * 3600;

export function hashCode(code: string): string {
  return createHash("sha256").update(code).digest("hex");
}

function memoryEnrol(): EnrolStore {
  const codes = new Map<string, StoredEnrolCode>();
  const ids = new Map<string, string>();
  return {
    put: async (c) => void codes.set(c.hash, { ...c }),
    get: async (hash) => {
      const c = codes.get(hash);
      return c && { ...c };
    },
    use: async (hash, id, owner) => {
      const c = codes.get(hash);
      if (c) c.usesLeft--;
      ids.set(id, owner);
    },
    ownerOf: async (id) => ids.get(id),
    revokeOwner: async (owner) => {
      let n = 0;
      for (const c of codes.values()) {
        if (c.owner === owner && !c.revoked && c.usesLeft > 0) {
          c.revoked = true;
          n++;
        }
      }
      return n;
    },
    close: async () => {},
  };
}

interface CodeRow {
  hash: string;
  owner: string;
  uses_left: number;
  expires_at: number;
  created_at: number;
  revoked: number;
}

function sqliteEnrol(db: SqliteDatabase, run: SideRun): EnrolStore {
  const q = {
    put: db.prepare<[string, string, number, number, number, number]>(
      "INSERT OR REPLACE INTO enrol_codes (hash, owner, uses_left, expires_at, created_at, revoked) VALUES (?, ?, ?, ?, ?, ?)",
    ),
    get: db.prepare<[string], CodeRow>("SELECT * FROM enrol_codes WHERE hash = ?"),
    take: db.prepare<[string]>("UPDATE enrol_codes SET uses_left = uses_left - 1 WHERE hash = ?"),
    enrolled: db.prepare<[string, string, number]>(
      "INSERT OR REPLACE INTO enrolled (id, owner, at) VALUES (?, ?, ?)",
    ),
    ownerOf: db.prepare<[string], { owner: string }>("SELECT owner FROM enrolled WHERE id = ?"),
    revoke: db.prepare<[string]>(
      "UPDATE enrol_codes SET revoked = 1 WHERE owner = ? AND revoked = 0 AND uses_left > 0",
    ),
  };
  const use = db.transaction((hash: string, id: string, owner: string, at: number) => {
    q.take.run(hash);
    q.enrolled.run(id, owner, at);
  });
  return {
    put: (c) =>
      run("storing an enrolment code", () => {
        q.put.run(c.hash, c.owner, c.usesLeft, c.expiresAt, c.createdAt, c.revoked ? 1 : 0);
      }),
    get: (hash) =>
      run("reading an enrolment code", () => {
        const r = q.get.get(hash);
        return (
          r && {
            hash: r.hash,
            owner: r.owner,
            usesLeft: r.uses_left,
            expiresAt: r.expires_at,
            createdAt: r.created_at,
            revoked: r.revoked !== 0,
          }
        );
      }),
    use: (hash, id, owner, at) => run("using an enrolment code", () => use.immediate(hash, id, owner, at)),
    ownerOf: (id) => run("reading an enrolled id", () => q.ownerOf.get(id)?.owner),
    revokeOwner: (owner) => run("revoking enrolment codes", () => q.revoke.run(owner).changes),
    close: async () => {
      db.close();
    },
  };
}

/** The enrolment tables for the hub's `store` option (a SQLite path, or the store object in memory). */
export function openEnrolStore(option: HubStore | string | undefined, store: HubStore): EnrolStore {
  return openSideStore(option, store, {
    name: "the enrolment tables",
    schema: `CREATE TABLE IF NOT EXISTS enrol_codes (
       hash TEXT PRIMARY KEY, owner TEXT NOT NULL, uses_left INTEGER NOT NULL,
       expires_at INTEGER NOT NULL, created_at INTEGER NOT NULL, revoked INTEGER NOT NULL DEFAULT 0
     );
     CREATE TABLE IF NOT EXISTS enrolled (id TEXT PRIMARY KEY, owner TEXT NOT NULL, at INTEGER NOT NULL);`,
    sqlite: sqliteEnrol,
    memory: memoryEnrol,
  });
}

export interface IssueOptions {
  /** Who the enrolled workers belong to (their tokens' `own`). */
  owner: string;
  /** How many workers may enrol with the code (default 1). */
  uses?: number;
  /** Lifetime, ms (default 24 h). */
  ttlMs?: number;
}

export interface IssuedCode {
  code: string;
  owner: string;
  uses: number;
  expiresAt: number;
}

export interface Enrolled {
  id: string;
  owner: string;
  token: string;
  expiresAt: number;
}

/** Issues an enrolment code into `store` (the hub's, or the CLI's own connection to its file). */
export async function issueEnrolCode(store: EnrolStore, o: IssueOptions, now: number): Promise<IssuedCode> {
  const { owner } = o;
  if (typeof owner !== "string" || owner.length === 0 || Buffer.byteLength(owner) > 64)
    throw new InvalidArgumentError("owner must be a string of 1..64 bytes");
  const uses = o.uses ?? 1;
  if (!Number.isInteger(uses) || uses < 1 || uses > 100_000)
    throw new InvalidArgumentError("uses must be an integer in 1..100000");
  const ttlMs = o.ttlMs ?? 24 * 3600_000;
  if (!Number.isFinite(ttlMs) || ttlMs <= 0)
    throw new InvalidArgumentError("the code's ttl must be positive");
  const code = CODE_PREFIX + randomBytes(18).toString("base64url");
  const expiresAt = Math.floor(now + ttlMs);
  await store.put({ hash: hashCode(code), owner, usesLeft: uses, expiresAt, createdAt: now, revoked: false });
  return { code, owner, uses, expiresAt };
}

/** Default redemptions an address may try at once (`enrolment.burst`). */
export const ENROL_BURST = 10;
/** Default refill of an address's tries, per minute (`enrolment.perMinute`). */
export const ENROL_PER_MINUTE = 10;
/** Addresses remembered at most; idle ones (bucket full again) are forgotten first. */
const MAX_ENROL_ADDRESSES = 10_000;

/**
 * How often one client address may try a code (hub option `enrolment`; `serve --enrol-burst`,
 * `--enrol-per-minute`): codes are guessed only by trying, so trying is rate-limited.
 */
export interface EnrolmentLimits {
  /** Tries at once (default {@link ENROL_BURST}). */
  readonly burst?: number;
  /** Tries regained per minute after the burst (default {@link ENROL_PER_MINUTE}). */
  readonly perMinute?: number;
}

/** Checks the limits (InvalidArgumentError), defaults filled in. */
export function checkEnrolmentLimits(limits: EnrolmentLimits | undefined): Required<EnrolmentLimits> {
  if (limits !== undefined && (typeof limits !== "object" || limits === null))
    throw new InvalidArgumentError("hub option enrolment must be an object");
  const int = (name: keyof EnrolmentLimits, fallback: number) => {
    const v = limits?.[name] ?? fallback;
    if (!Number.isSafeInteger(v) || v < 1 || v > 1_000_000)
      throw new InvalidArgumentError(`hub option enrolment.${name} must be an integer in 1..1000000`);
    return v;
  };
  return { burst: int("burst", ENROL_BURST), perMinute: int("perMinute", ENROL_PER_MINUTE) };
}

/** Trades codes for worker tokens; revokes an owner's codes when one of its workers is banned. */
export class Enrolment {
  readonly #o: { store: EnrolStore; secret: TokenSecret; clock: () => number };
  readonly #limits: Required<EnrolmentLimits>;
  /** Redemptions run one at a time: two racing for a code's last use cannot both get it. */
  #queue: Promise<unknown> = Promise.resolve();
  /** Per client address: codes are guessable only by trying, so trying is rate-limited. */
  readonly #buckets = new Map<string, TokenBucket>();

  constructor(o: {
    store: EnrolStore;
    secret: TokenSecret;
    clock: () => number;
    limits?: EnrolmentLimits | undefined;
  }) {
    this.#limits = checkEnrolmentLimits(o.limits);
    this.#o = { store: o.store, secret: o.secret, clock: o.clock };
  }

  issue(o: IssueOptions): Promise<IssuedCode> {
    return issueEnrolCode(this.#o.store, o, this.#o.clock());
  }

  /**
   * Trades a code for a token. `address` (the client's) is rate-limited: HubError
   * MOESWARM_HUB_ENROL_RATE (429) past the limits' burst, refilled at their rate.
   */
  redeem(code: unknown, address?: string): Promise<Enrolled> {
    if (address !== undefined && !this.#take(address)) {
      const { burst, perMinute } = this.#limits;
      return Promise.reject(
        new HubError(
          "MOESWARM_HUB_ENROL_RATE",
          `too many enrolment attempts from ${address}: at most ${burst} at once, then ${perMinute} a minute; wait a minute and try again`,
          { details: { burst, perMinute, retryAfterMs: Math.ceil(60_000 / perMinute) } },
        ),
      );
    }
    const next = this.#queue.then(() => this.#redeem(code));
    this.#queue = next.catch(() => {});
    return next;
  }

  #take(address: string): boolean {
    let bucket = this.#buckets.get(address);
    if (!bucket) {
      if (this.#buckets.size >= MAX_ENROL_ADDRESSES) this.#forgetIdle();
      bucket = new TokenBucket(this.#limits.perMinute / 60, this.#limits.burst, this.#o.clock);
      this.#buckets.set(address, bucket);
    }
    return bucket.take();
  }

  /** Forgets addresses whose bucket has refilled (idle a full refill); else the oldest half. */
  #forgetIdle(): void {
    const now = this.#o.clock();
    const full = (this.#limits.burst / this.#limits.perMinute) * 60_000;
    for (const [a, b] of this.#buckets) if (now - b.lastUsed >= full) this.#buckets.delete(a);
    if (this.#buckets.size < MAX_ENROL_ADDRESSES) return;
    let drop = this.#buckets.size / 2;
    for (const a of this.#buckets.keys()) {
      if (drop-- <= 0) break;
      this.#buckets.delete(a);
    }
  }

  async #redeem(code: unknown): Promise<Enrolled> {
    if (typeof code !== "string" || !code.startsWith(CODE_PREFIX) || code.length > 128) {
      throw new HubError("MOESWARM_HUB_ENROL_INVALID", "this is not an enrolment code this hub issued");
    }
    const now = this.#o.clock();
    const c = await this.#o.store.get(hashCode(code));
    if (!c) throw new HubError("MOESWARM_HUB_ENROL_INVALID", "this is not an enrolment code this hub issued");
    if (c.revoked) {
      throw new HubError(
        "MOESWARM_HUB_ENROL_REVOKED",
        `the enrolment code of ${JSON.stringify(c.owner)} was revoked (one of its workers was quarantined)`,
      );
    }
    if (now >= c.expiresAt) {
      throw new HubError(
        "MOESWARM_HUB_ENROL_EXPIRED",
        `the enrolment code expired at ${new Date(c.expiresAt).toISOString()}`,
      );
    }
    if (c.usesLeft <= 0) throw new HubError("MOESWARM_HUB_ENROL_USED", "the enrolment code has no uses left");
    const id = `${c.owner}-${randomBytes(4).toString("hex")}`;
    await this.#o.store.use(c.hash, id, c.owner, now);
    // tokens are checked against the wall clock (the hub's clock is the market's, injectable)
    const issuedAt = Date.now();
    const token = mintToken(
      { role: "worker", id, owner: c.owner, ttlS: ENROLLED_TOKEN_TTL_S, now: issuedAt },
      this.#o.secret,
    );
    return { id, owner: c.owner, token, expiresAt: issuedAt + ENROLLED_TOKEN_TTL_S * 1000 };
  }

  /** A worker was banned: its owner's unused codes are revoked. Returns how many. */
  /** The owner an enrolled worker id was issued for (undefined: not enrolled here). */
  ownerOf(worker: string): Promise<string | undefined> {
    return this.#o.store.ownerOf(worker);
  }

  async revokeFor(worker: string, liveOwner: string | undefined): Promise<number> {
    const owner = (await this.#o.store.ownerOf(worker)) ?? liveOwner;
    return owner === undefined ? 0 : this.#o.store.revokeOwner(owner);
  }

  close(): Promise<void> {
    return this.#o.store.close();
  }
}
