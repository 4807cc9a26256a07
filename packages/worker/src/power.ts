import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { InvalidArgumentError, onAbort } from "@moeswarm/core";

// A phone pauses itself on low battery or heat (issue 19): the battery and thermal state Linux and
// Android publish in sysfs, read every 30 s, with hysteresis so a phone at the threshold does not
// flap. Absent or unreadable files mean "unknown", and unknown never pauses.

/** What sysfs says now; a field is absent when the device does not tell it. */
export interface PowerReading {
  /** The first battery (`power_supply/<name>` with `type` Battery, else with a `capacity` file). */
  battery?: {
    /** Charge, percent. */
    capacity: number;
    /** `status` is "Discharging" (false also while the status is not told). */
    discharging: boolean;
    /** The battery's own temperature (`temp`, tenths of a degree), °C. */
    tempC?: number;
  };
  /** The hottest `thermal/thermal_zone*` (`temp`, millidegrees), °C. */
  hottestZoneC?: number;
}

export interface PowerOptions {
  /** Where sysfs is (default "/sys"; tests use a temporary directory). */
  sysfsRoot?: string;
  /** Pause at or below this charge while discharging, percent (default 20; false: never). */
  pauseBattery?: number | false;
  /**
   * Pause at or above this temperature, °C (false: never): the battery's temperature when the
   * battery tells one, else the hottest thermal zone. Default 45 where a battery is found; on a
   * machine without one (a desktop, whose CPU zones run hotter than 45 °C under load) only when
   * given.
   */
  pauseTemp?: number | false;
  /** How often sysfs is read, ms (default 30000). */
  intervalMs?: number;
}

/** Resume only this far past the threshold: a percent of charge, a degree. */
export const RESUME_BATTERY_MARGIN = 5;
export const RESUME_TEMP_MARGIN_C = 5;

export type PowerCause = "battery" | "thermal";

/** The power side of a worker's pause: whether it is to pause, why, and the figures behind it. */
export interface PowerState {
  paused: boolean;
  /** Why it pauses (heat first when both). */
  reason?: PowerCause;
  battery?: number;
  discharging?: boolean;
  tempC?: number;
}

function readNumber(path: string): number | undefined {
  try {
    const v = Number(readFileSync(path, "utf8").trim());
    return Number.isFinite(v) ? v : undefined;
  } catch {
    return undefined;
  }
}

function readText(path: string): string | undefined {
  try {
    return readFileSync(path, "utf8").trim();
  } catch {
    return undefined;
  }
}

function list(dir: string): string[] {
  try {
    return readdirSync(dir).sort();
  } catch {
    return [];
  }
}

/**
 * Reads the battery and the thermal zones. Synchronous on purpose: sysfs files are the kernel's
 * values read from memory (no disk), and a read that cannot wait on I/O keeps the poll's timing
 * exact under fake timers.
 */
export function readPower(sysfsRoot = "/sys"): PowerReading {
  const out: PowerReading = {};
  const supplies = join(sysfsRoot, "class", "power_supply");
  const names = list(supplies);
  const batteries = names.filter((n) => readText(join(supplies, n, "type")) === "Battery");
  for (const name of batteries.length > 0 ? batteries : names) {
    const capacity = readNumber(join(supplies, name, "capacity"));
    if (capacity === undefined || capacity < 0 || capacity > 100) continue;
    const tenths = readNumber(join(supplies, name, "temp"));
    out.battery = {
      capacity,
      discharging: readText(join(supplies, name, "status"))?.toLowerCase() === "discharging",
      ...(tenths !== undefined && tenths > 0 ? { tempC: tenths / 10 } : {}),
    };
    break;
  }
  const thermal = join(sysfsRoot, "class", "thermal");
  for (const zone of list(thermal).filter((n) => n.startsWith("thermal_zone"))) {
    const milli = readNumber(join(thermal, zone, "temp"));
    // a zone switched off reads 0 or a negative sentinel; anything past 150 °C is no reading
    if (milli === undefined || milli <= 0 || milli > 150_000) continue;
    const c = milli / 1000;
    if (out.hottestZoneC === undefined || c > out.hottestZoneC) out.hottestZoneC = c;
  }
  return out;
}

function threshold(name: string, v: number | false | undefined, min: number, max: number): void {
  if (v === undefined || v === false) return;
  if (typeof v !== "number" || !Number.isFinite(v) || v < min || v > max) {
    throw new InvalidArgumentError(`${name} must be a number in ${min}..${max}, or false`);
  }
}

/** Checks PowerOptions eagerly (InvalidArgumentError). */
export function checkPowerOptions(o: PowerOptions): void {
  if (typeof o !== "object" || o === null) throw new InvalidArgumentError("power must be an object");
  threshold("power.pauseBattery", o.pauseBattery, 0, 100);
  threshold("power.pauseTemp", o.pauseTemp, 0, 150);
  if (o.intervalMs !== undefined && (!Number.isFinite(o.intervalMs) || o.intervalMs < 10)) {
    throw new InvalidArgumentError("power.intervalMs must be a number >= 10");
  }
  if (o.sysfsRoot !== undefined && (typeof o.sysfsRoot !== "string" || o.sysfsRoot.length === 0)) {
    throw new InvalidArgumentError("power.sysfsRoot must be a directory path");
  }
}

/**
 * Watches sysfs and says when the worker is to pause or may resume. Battery: pause at or below
 * `pauseBattery` while discharging; resume once charging or `RESUME_BATTERY_MARGIN` points above.
 * Heat: pause at or above `pauseTemp`; resume `RESUME_TEMP_MARGIN_C` degrees below it.
 */
export class PowerWatch {
  readonly #root: string;
  readonly #battery: number | false;
  readonly #temp: number | false | undefined;
  readonly #intervalMs: number;
  readonly #onChange: (state: PowerState) => void;
  #low = false;
  #hot = false;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #unlisten: Disposable | undefined;

  constructor(options: PowerOptions, onChange: (state: PowerState) => void) {
    checkPowerOptions(options);
    this.#root = options.sysfsRoot ?? "/sys";
    this.#battery = options.pauseBattery ?? 20;
    this.#temp = options.pauseTemp;
    this.#intervalMs = options.intervalMs ?? 30_000;
    this.#onChange = onChange;
  }

  get paused(): boolean {
    return this.#low || this.#hot;
  }

  /** Reads sysfs once and applies the thresholds; calls onChange when the pause or its reason changed. */
  check(): PowerState {
    const r = readPower(this.#root);
    const was = this.#hot ? "thermal" : this.#low ? "battery" : "";
    const b = r.battery;
    if (this.#battery === false || !b) this.#low = false;
    else if (this.#low) this.#low = b.discharging && b.capacity < this.#battery + RESUME_BATTERY_MARGIN;
    else this.#low = b.discharging && b.capacity <= this.#battery;
    // the default threshold holds where a battery is found (a phone, a laptop), see PowerOptions
    const limit = this.#temp ?? (b ? 45 : false);
    const tempC = b?.tempC ?? r.hottestZoneC;
    if (limit === false || tempC === undefined) this.#hot = false;
    else if (this.#hot) this.#hot = tempC > limit - RESUME_TEMP_MARGIN_C;
    else this.#hot = tempC >= limit;
    const state: PowerState = {
      paused: this.paused,
      ...(this.#hot ? { reason: "thermal" as const } : this.#low ? { reason: "battery" as const } : {}),
      ...(b ? { battery: b.capacity, discharging: b.discharging } : {}),
      ...(tempC !== undefined ? { tempC } : {}),
    };
    if (was !== (state.reason ?? "")) {
      try {
        this.#onChange(state);
      } catch {
        // the listener's failure is its own
      }
    }
    return state;
  }

  /** Checks now, then every `intervalMs` until `signal` aborts or stop(). */
  start(signal?: AbortSignal): void {
    if (signal?.aborted) return;
    const tick = () => {
      this.check();
      this.#timer = setTimeout(tick, this.#intervalMs);
      this.#timer.unref?.();
    };
    this.#unlisten = onAbort(signal, () => this.stop());
    tick();
  }

  stop(): void {
    clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#unlisten?.[Symbol.dispose]();
    this.#unlisten = undefined;
  }
}
