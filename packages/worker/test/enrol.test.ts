// `--enrol CODE`: the token a code buys is kept in the cache dir and reused on later starts.
import { readFileSync, statSync } from "node:fs";
import { mintToken } from "@moeswarm/hub";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { enrolledToken, enrolmentFile } from "../src/enrol.js";
import { startTestHub, type TestHub } from "./fixtures.js";

const SECRET = "worker-enrol-secret-0123456789abcdef";
let t: TestHub;

beforeAll(async () => {
  t = await startTestHub({ secret: SECRET, model: "m", preset: "tiny", workPrefix: "msw-enrol-" });
}, 60_000);
afterAll(async () => {
  await t?.hub.close();
  t?.work.remove();
});

describe("enrolment", () => {
  it("buys a token with a code once, keeps it (0600) and reuses it; a wrong code is a typed refusal", async () => {
    const admin = mintToken({ role: "admin", id: "a", ttlS: 60 }, SECRET);
    const res = await fetch(`${t.url}/api/enrol-codes`, {
      method: "POST",
      headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
      body: JSON.stringify({ owner: "alice", uses: 1 }),
    });
    const { code } = (await res.json()) as { code: string };
    const cache = `${t.work.dir}/cache`;
    const token = await enrolledToken(t.url, code, cache);
    const saved = JSON.parse(readFileSync(enrolmentFile(cache), "utf8"));
    expect(saved).toMatchObject({ owner: "alice", token });
    expect(saved.id).toMatch(/^alice-/);
    expect(statSync(enrolmentFile(cache)).mode & 0o777).toBe(0o600);
    // the code had one use: a second start works only because the token was kept
    expect(await enrolledToken(t.url, code, cache)).toBe(token);
    await expect(enrolledToken(t.url, code, `${t.work.dir}/other`)).rejects.toMatchObject({
      code: "MOESWARM_HUB_ENROL_USED",
    });
  });
});
