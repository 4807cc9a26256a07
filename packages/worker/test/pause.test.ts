// A worker paused and resumed, end to end (issue 19): runWorker in this process against a real hub
// on loopback (tiny model, TypeScript compute). The hub's pause reaches the worker through the
// relay's notice; the worker's own pause (a fake sysfs: its battery runs low) reaches the hub,
// which leaves it out of the placement meanwhile and lists it again once it recovers.
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { type Hub, mintToken } from "@moeswarm/hub";
import { type TempDir, waitFor } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runWorkerCli } from "../src/cli.js";
import { formatWorkerEvent, type WorkerEvent } from "../src/events.js";
import { runWorker } from "../src/run-worker.js";
import { placement, startTestHub } from "./fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-pause-e2e-secret-0123456789";

let hub: Hub;
let url: string;
let work: TempDir;

beforeAll(async () => {
  ({ hub, url, work } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "tiny",
    workPrefix: "moeswarm-worker-pause-",
  }));
});

afterAll(async () => {
  await hub?.close();
  work?.remove();
});

function battery(root: string, capacity: number, status: string): void {
  const dir = join(root, "class", "power_supply", "battery");
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "type"), "Battery\n");
  writeFileSync(join(dir, "capacity"), `${capacity}\n`);
  writeFileSync(join(dir, "status"), `${status}\n`);
}

async function hubSays(path: string, method = "GET", body?: unknown) {
  const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
  const res = await fetch(`${url}${path}`, {
    method,
    headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
    ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
  });
  expect(res.status).toBe(200);
  return (await res.json()) as Record<string, unknown>;
}

const placed = async () =>
  ((await placement(url, MODEL)) as { registrations: Array<{ id: string }> }).registrations;

describe("runWorker paused", () => {
  it("by the hub (told within the relay's round trip) and by its own battery (the hub is told)", async () => {
    const sysfs = join(work.dir, "sys");
    battery(sysfs, 60, "Discharging");
    const events: WorkerEvent[] = [];
    const stop = new AbortController();
    const run = runWorker({
      hub: url,
      token: mintToken({ role: "worker", id: "phone", owner: "alice", ttlS: 600 }, SECRET),
      capacity: { ramBytes: 100_000_000 },
      cacheDir: join(work.dir, "cache"),
      backend: "ts",
      pollMs: 50,
      power: { sysfsRoot: sysfs, intervalMs: 50 },
      log: (e) => events.push(e),
      signal: stop.signal,
    });
    const seen = (name: string, n = 1) => events.filter((e) => e.event === name).length >= n;
    try {
      await waitFor(() => seen("serving"), "serving", 60_000);
      await waitFor(async () => (await placed()).some((r) => r.id === "phone"), "phone in the placement");

      // the owner's laptop pauses the phone through the hub
      const laptop = mintToken({ role: "worker", id: "laptop", owner: "alice", ttlS: 600 }, SECRET);
      const paused = await fetch(`${url}/api/workers/phone/pause`, {
        method: "POST",
        headers: { authorization: `Bearer ${laptop}`, "content-type": "application/json" },
        body: JSON.stringify({ reason: "on a call" }),
      });
      expect(paused.status).toBe(200);
      await waitFor(() => seen("paused"), "the worker hears of the pause", 10_000);
      expect(events.find((e) => e.event === "paused")).toMatchObject({ by: "owner", reason: "on a call" });
      expect(await placed()).toEqual([]);
      await hubSays("/api/workers/phone/resume", "POST");
      await waitFor(() => seen("resumed"), "the worker hears of the resume", 10_000);
      expect(events.find((e) => e.event === "resumed")).toMatchObject({ by: "operator" });
      expect((await placed()).some((r) => r.id === "phone")).toBe(true);

      // its battery runs low: it pauses itself and the hub is told
      battery(sysfs, 15, "Discharging");
      await waitFor(() => seen("paused", 2), "the battery pause", 10_000);
      expect(events.filter((e) => e.event === "paused")[1]).toMatchObject({
        by: "self",
        reason: "battery",
        battery: 15,
      });
      await waitFor(
        async () => (await hubSays("/api/workers/phone/pause")).paused === true,
        "the hub hears of the battery pause",
        10_000,
      );
      expect(await hubSays("/api/workers/phone/pause")).toMatchObject({ self: { reason: "battery" } });
      expect(await placed()).toEqual([]);
      // plugged in: it resumes, and so does the hub
      battery(sysfs, 16, "Charging");
      await waitFor(() => seen("resumed", 2), "the battery resume", 10_000);
      await waitFor(
        async () => (await hubSays("/api/workers/phone/pause")).paused === false,
        "the hub hears of the resume",
        10_000,
      );
      expect((await placed()).some((r) => r.id === "phone")).toBe(true);
      // served on throughout: the same slices, no second download
      expect(events.filter((e) => e.event === "claimed").length).toBe(
        events.filter((e) => e.event === "registered").length,
      );
    } finally {
      stop.abort();
      await run.catch(() => undefined);
    }
    const summary = await run;
    expect(summary.served).toBe(true);
  });
});

describe("moeswarm-worker paused", () => {
  const sink = () => ({
    text: "",
    write(t: string) {
      this.text += t;
      return true;
    },
  });

  it("starts paused on a low battery (--pause-battery): prints why, tells the hub, claims nothing", async () => {
    const sysfs = join(work.dir, "sys-cli");
    battery(sysfs, 25, "Discharging");
    const out = sink();
    const err = sink();
    const io = { stdout: out as never, stderr: err as never, env: { MOESWARM_SYSFS_ROOT: sysfs } };
    const stop = new AbortController();
    const token = mintToken({ role: "worker", id: "cli-phone", ttlS: 600 }, SECRET);
    const args = [
      "--hub",
      url,
      "--token",
      token,
      "--cache-dir",
      join(work.dir, "cli-cache"),
      "--backend",
      "ts",
    ];
    const run = runWorkerCli([...args, "--pause-battery", "30", "--capacity", "100MB"], io, stop.signal);
    try {
      await waitFor(
        () => out.text.includes("paused:"),
        () => `the pause line in ${out.text}${err.text}`,
        20_000,
      );
      expect(out.text).toContain(
        "paused: battery low (25%, discharging); the hub routes this worker nothing new",
      );
      await waitFor(
        async () => (await hubSays("/api/workers/cli-phone/pause")).paused === true,
        "the hub hears of it",
      );
      expect(out.text).not.toContain("claimed");
    } finally {
      stop.abort();
    }
    expect(await run).toBe(0);
    // started again on a charged battery: its own pause, left on the hub by the run before, is lifted
    battery(sysfs, 80, "Charging");
    const again = new AbortController();
    const second = runWorkerCli([...args, "--capacity", "1B"], io, again.signal);
    try {
      await waitFor(
        async () => (await hubSays("/api/workers/cli-phone/pause")).paused === false,
        "the hub hears it is not paused",
      );
    } finally {
      again.abort();
    }
    expect(await second).toBe(0);
    // usage errors name the option
    for (const bad of [
      ["--pause-battery", "120"],
      ["--pause-temp", "hot"],
    ]) {
      err.text = "";
      expect(await runWorkerCli([...args, ...bad], io, AbortSignal.abort())).toBe(2);
      expect(err.text).toContain(`${bad[0]} must be a number`);
    }
    out.text = "";
    expect(await runWorkerCli(["--help"], io, AbortSignal.abort())).toBe(0);
    expect(out.text).toContain("--pause-battery PCT");
  });

  it("prints the hub's pause as the phone owner reads it", () => {
    expect(formatWorkerEvent({ event: "paused", by: "owner" })).toBe(
      "paused by the hub (owner); it routes this worker nothing new until resumed",
    );
    expect(formatWorkerEvent({ event: "paused", by: "operator", reason: "maintenance" })).toMatch(
      /^paused by the hub \(operator\): maintenance;/,
    );
    expect(formatWorkerEvent({ event: "resumed", by: "owner" })).toBe("resumed by the hub (owner)");
    expect(formatWorkerEvent({ event: "paused", by: "self", reason: "thermal", tempC: 46.25 })).toMatch(
      /^paused: too hot \(46\.3 °C\)/,
    );
    expect(formatWorkerEvent({ event: "resumed", by: "self", battery: 26, tempC: 30 })).toBe(
      "resumed (battery 26%, 30.0 °C)",
    );
  });
});
