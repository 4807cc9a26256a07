// A run's pause (issue 19) against a stand-in hub client, under fake timers: what it tells the hub
// and when, the hub's notices, and a reconnect to a hub that forgot its pause.
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { HubError } from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import type { WorkerEventBody } from "../src/events.js";
import type { Settings } from "../src/options.js";
import { RunPause } from "../src/pause.js";

let root: string;
let remove: () => void;

function battery(capacity: number, status: string): void {
  const dir = join(root, "class", "power_supply", "BAT0");
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "type"), "Battery\n");
  writeFileSync(join(dir, "capacity"), `${capacity}\n`);
  writeFileSync(join(dir, "status"), `${status}\n`);
}

beforeEach(() => {
  ({ dir: root, remove } = tempDir("moeswarm-run-pause-"));
  vi.useFakeTimers();
});

afterEach(() => {
  vi.useRealTimers();
  remove();
});

function setup(answer: (path: string, body: unknown) => unknown = () => ({})) {
  const calls: Array<{ path: string; method: string | undefined; body: unknown }> = [];
  const hub = {
    request: async (path: string, o: { method?: string; body?: unknown } = {}) => {
      calls.push({ path, method: o.method, body: o.body });
      return { status: 200, json: answer(path, o.body) };
    },
  };
  const s = { id: "phone", hub, power: { sysfsRoot: root } } as unknown as Settings;
  const events: WorkerEventBody[] = [];
  const stop = new AbortController();
  const pause = new RunPause({ s, emit: (e) => events.push(e), stop: stop.signal });
  return { pause, calls, events, stop };
}

describe("RunPause", () => {
  it("tells the hub its battery pause at once and every 30 s while it lasts, then the resume once", async () => {
    battery(18, "Discharging");
    const { pause, calls, events, stop } = setup();
    pause.start();
    await vi.advanceTimersByTimeAsync(0);
    expect(pause.paused).toBe(true);
    expect(events).toEqual([{ event: "paused", by: "self", reason: "battery", battery: 18 }]);
    expect(calls).toEqual([
      { path: "/api/workers/phone/pause", method: "POST", body: { self: true, reason: "battery" } },
    ]);
    let resumed = false;
    void pause.whenResumed().then(() => {
      resumed = true;
    });
    await vi.advanceTimersByTimeAsync(30_000);
    expect(calls).toHaveLength(2); // told again (a restarted hub forgot it)
    battery(23, "Discharging"); // hysteresis: still paused below 25%
    await vi.advanceTimersByTimeAsync(30_000);
    expect(resumed).toBe(false);
    battery(23, "Charging");
    await vi.advanceTimersByTimeAsync(30_000);
    expect(resumed).toBe(true);
    expect(events.at(-1)).toEqual({ event: "resumed", by: "self", battery: 23 });
    expect(calls.at(-1)).toEqual({ path: "/api/workers/phone/resume", method: "POST", body: { self: true } });
    const n = calls.length;
    await vi.advanceTimersByTimeAsync(90_000);
    expect(calls).toHaveLength(n); // nothing more to say
    stop.abort();
  });

  it("starts by lifting a pause of its own an earlier run left, and says nothing where sysfs is empty", async () => {
    battery(80, "Discharging");
    const first = setup();
    first.pause.start();
    await vi.advanceTimersByTimeAsync(0);
    expect(first.calls).toEqual([
      { path: "/api/workers/phone/resume", method: "POST", body: { self: true } },
    ]);
    first.stop.abort();
    remove();
    const bare = setup();
    bare.pause.start();
    await vi.advanceTimersByTimeAsync(60_000);
    expect(bare.calls).toEqual([]);
    bare.stop.abort();
  });

  it("stops telling a hub that has no pause API (404)", async () => {
    battery(10, "Discharging");
    const { pause, calls, events, stop } = setup(() => {
      throw new HubError("MOESWARM_HUB_NOT_FOUND", "no such resource");
    });
    pause.start();
    await vi.advanceTimersByTimeAsync(90_000);
    expect(calls).toHaveLength(1);
    expect(events.map((e) => e.event)).toEqual(["paused"]);
    expect(pause.paused).toBe(true); // it still claims nothing new
    stop.abort();
  });

  it("takes the hub's notices, and ends the hub's pause when a reconnected hub has none", async () => {
    const hubState = { worker: "phone", paused: true, hub: { by: "owner", at: 1 } };
    const { pause, events, stop } = setup((path) => (path.endsWith("/pause") ? hubState : {}));
    expect(pause.onNotice("MOESWARM_HUB_PAUSED", "paused by the hub (owner): on a call")).toBe(true);
    expect(pause.onNotice("MOESWARM_HUB_PAUSED", "paused by the hub (owner): on a call")).toBe(true);
    expect(pause.onNotice("MOESWARM_TRANSPORT_LIMIT", "slow down")).toBe(false);
    expect(events).toEqual([{ event: "paused", by: "owner", reason: "on a call" }]);
    pause.onReconnect(); // the hub still has it: nothing changes
    await vi.advanceTimersByTimeAsync(0);
    expect(pause.paused).toBe(true);
    Object.assign(hubState, { paused: false, hub: undefined });
    pause.onReconnect(); // a restarted hub forgot it
    await vi.advanceTimersByTimeAsync(0);
    expect(pause.paused).toBe(false);
    expect(events.at(-1)).toEqual({ event: "resumed", by: "owner" });
    pause.onNotice("MOESWARM_HUB_PAUSED", "paused by the hub (operator)");
    pause.onNotice("MOESWARM_HUB_RESUMED", "resumed by the hub (operator)");
    expect(events.slice(-2)).toEqual([
      { event: "paused", by: "operator" },
      { event: "resumed", by: "operator" },
    ]);
    stop.abort();
  });
});
