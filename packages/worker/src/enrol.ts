import { chmod, mkdir, readFile, writeFile } from "node:fs/promises";
import { join } from "node:path";
import { HubClient } from "@moeswarm/relay-client";

// `moeswarm-worker --enrol CODE`: trades an enrolment code the hub's operator issued for a worker
// token bound to a fresh id (`POST /api/enrol`), and keeps it in the worker's cache dir (its only
// state across restarts), so a restart uses the same identity instead of spending another use.

interface Saved {
  hub: string;
  id: string;
  owner: string;
  token: string;
}

/** Where the enrolled token is kept: `<cacheDir>/enrolment.json` (mode 0600). */
export function enrolmentFile(cacheDir: string): string {
  return join(cacheDir, "enrolment.json");
}

/** The token saved for this hub, else the one `code` buys (saved before it is used). */
export async function enrolledToken(
  hub: string,
  code: string,
  cacheDir: string,
  ca?: string,
): Promise<string> {
  const file = enrolmentFile(cacheDir);
  const base = new URL(hub).href;
  try {
    const saved = JSON.parse(await readFile(file, "utf8")) as Partial<Saved>;
    if (saved.hub === base && typeof saved.token === "string" && saved.token.length > 0) return saved.token;
  } catch {
    // none yet (or unreadable): enrol
  }
  const client = new HubClient({ base, ...(ca !== undefined ? { ca } : {}) });
  try {
    const r = await client.request("/api/enrol", { method: "POST", body: { code }, maxBodyBytes: 8192 });
    const e = r.json as Partial<Saved>;
    if (typeof e?.token !== "string" || typeof e.id !== "string") {
      throw new Error("the hub's enrolment answer has no token");
    }
    await mkdir(cacheDir, { recursive: true });
    const saved: Saved = { hub: base, id: e.id, owner: String(e.owner), token: e.token };
    await writeFile(file, `${JSON.stringify(saved)}\n`, { mode: 0o600 });
    await chmod(file, 0o600);
    return e.token;
  } finally {
    await client.close();
  }
}
