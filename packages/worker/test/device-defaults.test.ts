import { autoBackendFor } from "@moeswarm/worker-native";
import { describe, expect, it } from "vitest";
import { isPhone, PHONE_THREADS, workerDefaults } from "../src/device-defaults.js";

const GiB = 2 ** 30;
const desktop = {
  platform: "linux" as const,
  env: {},
  freeBytes: 20 * GiB,
  totalBytes: 64 * GiB,
  cpus: 16,
  diskFreeBytes: 500 * GiB,
};
const phone = {
  platform: "android" as const,
  env: {},
  freeBytes: 6 * GiB,
  totalBytes: 12 * GiB,
  cpus: 8,
  diskFreeBytes: 40 * GiB,
};

describe("participant defaults", () => {
  it("a desktop offers half its free memory, all its cores and an unbounded cache", () => {
    expect(workerDefaults(desktop)).toEqual({
      phone: false,
      ramBytes: 10 * GiB,
      threads: undefined,
      cacheMaxBytes: undefined,
    });
  });

  it("a phone keeps most of itself: a quarter of its memory at most, its big cores, half its free storage", () => {
    expect(workerDefaults(phone)).toEqual({
      phone: true,
      ramBytes: 3 * GiB,
      threads: PHONE_THREADS,
      cacheMaxBytes: 20 * GiB,
    });
    // little free memory: half of it, below the quarter
    expect(workerDefaults({ ...phone, freeBytes: 2 * GiB }).ramBytes).toBe(GiB);
    expect(workerDefaults({ ...phone, cpus: 2 }).threads).toBe(2);
    expect(workerDefaults({ ...phone, diskFreeBytes: undefined }).cacheMaxBytes).toBeUndefined();
  });

  it("Termux counts as a phone whatever Node reports as platform", () => {
    expect(isPhone({ platform: "linux", env: { TERMUX_VERSION: "0.118.0" } })).toBe(true);
    expect(isPhone({ platform: "linux", env: {} })).toBe(false);
    expect(isPhone({ platform: "android", env: {} })).toBe(true);
  });
});

describe('backend "auto"', () => {
  it("takes the addon when it loads, else the static executable where there is one, else TypeScript", () => {
    expect(autoBackendFor(true, "/x/moeswarm-expert-worker")).toBe("native");
    expect(autoBackendFor(false, "/x/moeswarm-expert-worker")).toBe("worker"); // Android, musl
    expect(autoBackendFor(false, undefined)).toBe("ts");
  });
});
