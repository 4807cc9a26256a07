// A phone's own pause (issue 19): sysfs read from a temporary directory laid out as Linux and
// Android lay out /sys, polled under fake timers; thresholds with hysteresis.
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterEach, beforeEach, describe, expect, it, vi } from "vitest";
import { type PowerState, PowerWatch, readPower } from "../src/power.js";

let root: string;
let remove: () => void;

function battery(capacity: number, status: string, tempTenths?: number, name = "battery"): void {
  const dir = join(root, "class", "power_supply", name);
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "type"), "Battery\n");
  writeFileSync(join(dir, "capacity"), `${capacity}\n`);
  writeFileSync(join(dir, "status"), `${status}\n`);
  if (tempTenths !== undefined) writeFileSync(join(dir, "temp"), `${tempTenths}\n`);
}

function zone(i: number, milli: number | string): void {
  const dir = join(root, "class", "thermal", `thermal_zone${i}`);
  mkdirSync(dir, { recursive: true });
  writeFileSync(join(dir, "temp"), `${milli}\n`);
}

beforeEach(() => {
  ({ dir: root, remove } = tempDir("moeswarm-sysfs-"));
  vi.useFakeTimers();
});

afterEach(() => {
  vi.useRealTimers();
  remove();
});

describe("readPower", () => {
  it("reads the battery (a Mains supply is not one) and the hottest thermal zone", () => {
    const ac = join(root, "class", "power_supply", "AC");
    mkdirSync(ac, { recursive: true });
    writeFileSync(join(ac, "type"), "Mains\n");
    writeFileSync(join(ac, "online"), "1\n");
    battery(57, "Discharging", 312);
    zone(0, 41_500);
    zone(1, 63_000);
    zone(2, -273_000); // a zone switched off
    zone(3, "garbage");
    expect(readPower(root)).toEqual({
      battery: { capacity: 57, discharging: true, tempC: 31.2 },
      hottestZoneC: 63,
    });
  });

  it("says nothing where the files are absent", () => {
    expect(readPower(join(root, "nowhere"))).toEqual({});
    mkdirSync(join(root, "class", "power_supply", "usb"), { recursive: true });
    expect(readPower(root)).toEqual({});
  });
});

describe("PowerWatch", () => {
  function watch(options: ConstructorParameters<typeof PowerWatch>[0] = {}) {
    const changes: PowerState[] = [];
    const w = new PowerWatch({ sysfsRoot: root, ...options }, (s) => changes.push(s));
    return { w, changes };
  }

  it("pauses at 20% while discharging, every 30 s, and resumes 5 points above (or when charging)", async () => {
    battery(50, "Discharging");
    const { w, changes } = watch();
    w.start();
    expect(w.paused).toBe(false);
    battery(20, "Discharging");
    await vi.advanceTimersByTimeAsync(29_999);
    expect(changes).toEqual([]); // not read again before the interval
    await vi.advanceTimersByTimeAsync(1);
    expect(changes).toEqual([{ paused: true, reason: "battery", battery: 20, discharging: true }]);
    // hysteresis: 21..24% keep it paused
    battery(24, "Discharging");
    await vi.advanceTimersByTimeAsync(30_000);
    expect(w.paused).toBe(true);
    battery(25, "Discharging");
    await vi.advanceTimersByTimeAsync(30_000);
    expect(changes.at(-1)).toEqual({ paused: false, battery: 25, discharging: true });
    // low again, then plugged in: charging ends the pause at any charge
    battery(12, "Discharging");
    await vi.advanceTimersByTimeAsync(30_000);
    expect(w.paused).toBe(true);
    battery(12, "Charging");
    await vi.advanceTimersByTimeAsync(30_000);
    expect(w.paused).toBe(false);
    expect(changes.map((c) => c.paused)).toEqual([true, false, true, false]);
    w.stop();
    battery(5, "Discharging");
    await vi.advanceTimersByTimeAsync(120_000);
    expect(changes).toHaveLength(4); // stopped: never read again
  });

  it("never pauses on a low battery that is charging, nor with pauseBattery false", () => {
    battery(3, "Charging");
    expect(watch().w.check().paused).toBe(false);
    battery(3, "Discharging");
    expect(watch({ pauseBattery: false }).w.check()).toMatchObject({ paused: false, battery: 3 });
    expect(watch({ pauseBattery: 2 }).w.check().paused).toBe(false);
    expect(watch({ pauseBattery: 3 }).w.check().paused).toBe(true);
  });

  it("pauses at 45 °C of the battery and resumes 5 degrees below; heat comes first", async () => {
    battery(80, "Discharging", 449);
    zone(0, 90_000); // the SoC runs hotter: the battery's own temperature is the one read
    const { w, changes } = watch({ intervalMs: 1000 });
    w.start();
    expect(w.paused).toBe(false);
    battery(80, "Discharging", 450);
    await vi.advanceTimersByTimeAsync(1000);
    expect(changes).toEqual([{ paused: true, reason: "thermal", battery: 80, discharging: true, tempC: 45 }]);
    battery(15, "Discharging", 410); // cooler, but now the battery is low too
    await vi.advanceTimersByTimeAsync(1000);
    expect(w.paused).toBe(true);
    expect(changes).toHaveLength(1); // still hot (above 40 °C): nothing changed
    battery(15, "Discharging", 400);
    await vi.advanceTimersByTimeAsync(1000);
    // cooled down, still low: paused for the battery now
    expect(changes.at(-1)).toMatchObject({ paused: true, reason: "battery", tempC: 40 });
  });

  it("without a battery, thermal zones pause only when --pause-temp is given", () => {
    zone(0, 80_000);
    expect(watch().w.check()).toEqual({ paused: false, tempC: 80 });
    expect(watch({ pauseTemp: 75 }).w.check()).toEqual({ paused: true, reason: "thermal", tempC: 80 });
    expect(watch({ pauseTemp: false }).w.check().paused).toBe(false);
  });

  it("never pauses where sysfs has nothing, and validates its options", () => {
    rmSync(join(root, "class"), { recursive: true, force: true });
    expect(watch({ pauseTemp: 1, pauseBattery: 100 }).w.check()).toEqual({ paused: false });
    expect(() => watch({ pauseBattery: 101 })).toThrow(/pauseBattery/);
    expect(() => watch({ pauseTemp: -1 })).toThrow(/pauseTemp/);
    expect(() => watch({ intervalMs: 0 })).toThrow(/intervalMs/);
  });

  it("stops when its signal aborts", async () => {
    battery(50, "Discharging");
    const { w, changes } = watch();
    const ac = new AbortController();
    w.start(ac.signal);
    ac.abort();
    battery(1, "Discharging");
    await vi.advanceTimersByTimeAsync(90_000);
    expect(changes).toEqual([]);
  });
});
