// Leases and credits across a kill -9 of the real bin: every answered change is on disk (one
// SQLite transaction each), so a restarted hub has exactly the live leases (no replaced or
// released one comes back) and every acknowledged credit.
import { type ChildProcess, spawn } from "node:child_process";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { connectRelay } from "@moeswarm/relay-client";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { mintToken, SQLITE_DRIVERS } from "../src/index.js";
import { call, copyModel, json, syntheticModel, type TempDir, tempDir, waitFor } from "./hub-helpers.js";

const BIN = fileURLToPath(new URL("../dist/cli.js", import.meta.url));
const SECRET = "kill9-test-secret-0123456789abcdef";
const ID = "tiny";

let tmp: TempDir;
let modelPath: string;
beforeAll(async () => {
  tmp = tempDir("moeswarm-hub-kill9-");
  modelPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
  writeFileSync(join(tmp.dir, "secret"), SECRET);
});
afterAll(() => tmp?.remove());

const token = (role: "worker" | "backbone", id: string) => mintToken({ role, id, ttlS: 600 }, SECRET);

/** The bin on the data directory; resolves with its URLs once it listens. */
async function startHub(
  driver: string,
  data: string,
): Promise<{ child: ChildProcess; url: string; relayUrl: string; store: string }> {
  const child = spawn(
    process.execPath,
    [
      BIN,
      "serve",
      ...["--model", modelPath, "--port", "0", "--json", "--lease-ttl", "600", "--trust-reports"],
      ...["--data-dir", join(tmp.dir, data), "--secret-file", join(tmp.dir, "secret")],
      ...["--sqlite-driver", driver],
    ],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  let out = "";
  let err = "";
  child.stdout?.on("data", (c: Buffer) => {
    out += c.toString();
  });
  child.stderr?.on("data", (c: Buffer) => {
    err += c.toString();
  });
  await waitFor(
    () => out.includes('"event":"listening"'),
    () => `the hub to listen (stderr: ${err})`,
    20_000,
  );
  const listening = JSON.parse(out.split("\n").find((l) => l.includes('"listening"')) as string);
  return { child, url: listening.url, relayUrl: listening.relayUrl, store: listening.storeDriver };
}

async function req(
  base: string,
  path: string,
  options: { method?: string; body?: unknown; token?: string } = {},
) {
  const a = await call(`${base}${path}`, {
    method: options.method ?? "GET",
    headers: {
      "content-type": "application/json",
      ...(options.token === undefined ? {} : { authorization: `Bearer ${options.token}` }),
    },
    body: options.body === undefined ? undefined : JSON.stringify(options.body),
  });
  return { status: a.status, body: a.body.byteLength > 0 ? (json(a) as Record<string, unknown>) : {} };
}

/** Which of the leases the hub holds now (by id, as their holder asks). */
async function liveLeases(base: string, granted: Array<{ id: string; worker: string }>): Promise<string[]> {
  const live: string[] = [];
  for (const g of granted) {
    const r = await req(base, `/api/claims/${g.id}`, { token: token("worker", g.worker) });
    expect([200, 404]).toContain(r.status);
    if (r.status === 200) live.push(g.id);
  }
  return live;
}

async function killed(child: ChildProcess): Promise<void> {
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  child.kill("SIGKILL");
  await exited;
}

// every driver this Node has (node:sqlite: Node 22.5+); each keeps what it answered
const drivers = SQLITE_DRIVERS.flatMap((d) => {
  try {
    d.load();
    return [d.name];
  } catch (error) {
    console.log(
      `kill -9 test: the ${d.name} driver is not available here, skipped: ${(error as Error).message}`,
    );
    return [];
  }
});

describe.each(drivers)("a kill -9 of the hub on %s", (driver) => {
  it("loses no answered lease change and no acknowledged credit", async () => {
    const data = `data-${driver.replace(/\W/g, "-")}`;
    const first = await startHub(driver, data);
    expect(first.store).toBe(driver);
    const granted: Array<{ id: string; worker: string }> = [];
    let credited = 0;
    try {
      // a worker the hub knows, for the backbone's receipts to credit
      const w = await connectRelay(first.relayUrl, {
        role: "worker",
        id: "earner",
        token: token("worker", "earner"),
        reconnect: false,
        onDispatch: () => ({ y: new Float32Array(0) }),
      });
      // 48 claims by 4 workers, each on its own experts: a claim over the worker's lease of the
      // same cells replaces it, and every third one replaces all of the worker's leases
      for (let i = 0; i < 48; i++) {
        const k = i % 4;
        const worker = `claimer-${k}`;
        const layer = Math.floor(i / 4) % 2;
        const r = await req(first.url, "/api/claims", {
          method: "POST",
          token: token("worker", worker),
          body: {
            model: ID,
            layers: `${layer}:${layer + 1}`,
            experts: `${2 * k}:${2 * k + 1 + (i % 2)}`,
            capacity: { ramBytes: 1 << 30 },
            ...(i % 3 === 0 ? { replaceLeases: true } : {}),
          },
        });
        expect(r.status, JSON.stringify(r.body)).toBe(201);
        granted.push({ id: r.body.leaseId as string, worker });
        // and some released by their holder
        if (i % 7 === 6) {
          const released = await req(first.url, `/api/claims/${r.body.leaseId}`, {
            method: "DELETE",
            token: token("worker", worker),
          });
          expect(released.status).toBe(200);
        }
      }
      // 30 backbone reports, each crediting the worker
      for (let i = 0; i < 30; i++) {
        const n = 100 + i;
        const r = await req(first.url, `/api/models/${ID}/stats`, {
          method: "POST",
          token: token("backbone", "bb"),
          body: { counts: { "0": [1, 0, 0, 0, 0, 0, 0, i] }, receipts: { earner: { expertTokens: n } } },
        });
        expect(r.body).toMatchObject({ accepted: true, credited: ["earner"] });
        credited += n;
      }
      const live = await liveLeases(first.url, granted);
      expect(live.length).toBeGreaterThan(0);
      expect(live.length).toBeLessThan(granted.length);
      await w.close();
      // at once after the last answer: no flush interval has passed
      await killed(first.child);

      const second = await startHub(driver, data);
      try {
        expect(await liveLeases(second.url, granted)).toEqual(live);
        const workers = (await req(second.url, "/api/workers")).body.workers as Array<
          Record<string, unknown>
        >;
        expect(workers.find((x) => x.id === "earner")).toMatchObject({
          credits: { expertTokens: credited, byModel: { [ID]: credited } },
        });
      } finally {
        await killed(second.child);
      }
    } finally {
      if (first.child.exitCode === null) first.child.kill("SIGKILL");
    }
    // two hub starts and ~80 durable transactions per driver: slow on a busy CI machine
  }, 120_000);
});
