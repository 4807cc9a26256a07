// `moeswarm-hub enrol-code`: issues a self-enrolment code for an owner into the hub's SQLite file
// (the running hub reads it at redemption; only its sha256 is kept).
import { join, resolve as resolvePath } from "node:path";
import { InvalidArgumentError } from "@moeswarm/core";
import { issueEnrolCode, openEnrolStore } from "../enrolment.js";
import { openSqliteStore } from "../store-sqlite.js";

type Values = Record<string, string | boolean | string[] | undefined>;

const str = (values: Values, name: string) => {
  const v = values[name];
  return typeof v === "string" ? v : undefined;
};

/** A mistake in the command line (exit status 2), as run.ts tells them apart. */
const usageError = (message: string) => new InvalidArgumentError(message, { details: { usage: true } });

/** "90s", "30m", "24h", "7d" or plain seconds, as ms. */
export function parseDuration(text: string): number {
  const m = /^(\d+)(s|m|h|d)?$/.exec(text);
  if (!m) throw usageError(`--ttl must be a duration like 90s, 30m, 24h or 7d, got ${JSON.stringify(text)}`);
  const unit = { s: 1, m: 60, h: 3600, d: 86_400 }[(m[2] ?? "s") as "s" | "m" | "h" | "d"];
  const ms = Number(m[1]) * unit * 1000;
  if (ms <= 0 || ms > 366 * 86_400_000) throw usageError("--ttl must be between 1s and 366d");
  return ms;
}

export const enrolCode = {
  name: "enrol-code",
  summary: "issue a code with which workers of one owner enrol themselves",
  usage: "enrol-code (--data-dir <dir> | --db <file>) --owner <principal> [--uses <n>] [--ttl 24h] [--json]",
  options: {
    "data-dir": { type: "string", description: "the hub's data directory (its moeswarm-hub.db)" },
    db: { type: "string", description: "the hub's SQLite file (instead of --data-dir)" },
    owner: { type: "string", description: "who the enrolled workers belong to (their tokens' owner)" },
    uses: { type: "string", description: "how many workers may enrol with the code (default 1)" },
    ttl: { type: "string", description: "how long the code is valid: 90s, 30m, 24h, 7d (default 24h)" },
    json: { type: "boolean", description: "print {code, owner, uses, expiresAt} as JSON" },
  } as Record<string, { type: "string" | "boolean"; description: string }>,
  async run(values: Values, io: { stdout: NodeJS.WritableStream }): Promise<void> {
    const dir = str(values, "data-dir");
    const db =
      str(values, "db") ?? (dir === undefined ? undefined : join(resolvePath(dir), "moeswarm-hub.db"));
    if (db === undefined) throw usageError("--data-dir or --db is required (where the hub keeps its state)");
    const owner = str(values, "owner");
    if (owner === undefined) throw usageError("--owner <principal> is required");
    const usesText = str(values, "uses") ?? "1";
    if (!/^\d+$/.test(usesText) || Number(usesText) < 1 || Number(usesText) > 100_000)
      throw usageError(`--uses must be an integer in 1..100000, got ${JSON.stringify(usesText)}`);
    const ttlMs = parseDuration(str(values, "ttl") ?? "24h");
    // the hub's schema first (a fresh data dir), then the enrolment tables beside it
    const store = openSqliteStore(db);
    const codes = openEnrolStore(db, store);
    try {
      const issued = await issueEnrolCode(codes, { owner, uses: Number(usesText), ttlMs }, Date.now());
      io.stdout.write(
        values.json === true
          ? `${JSON.stringify(issued)}\n`
          : `${issued.code}\n(owner ${owner}, ${issued.uses} use(s), valid until ${new Date(issued.expiresAt).toISOString()}; workers run: moeswarm-worker --hub <url> --enrol <code>)\n`,
      );
    } finally {
      await codes.close();
      await store.close();
    }
  },
};
