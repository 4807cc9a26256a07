import { afterEach, describe, expect, it, vi } from "vitest";
import {
  AbortError,
  abortable,
  InvalidArgumentError,
  isMoeswarmError,
  linkedSignal,
  onAbort,
  sleep,
} from "../src/index.js";

afterEach(() => {
  vi.useRealTimers();
});

describe("sleep", () => {
  it("resolves after the time, with fake timers", async () => {
    vi.useFakeTimers();
    let done = false;
    const p = sleep(1000).then(() => {
      done = true;
    });
    await vi.advanceTimersByTimeAsync(999);
    expect(done).toBe(false);
    await vi.advanceTimersByTimeAsync(1);
    await p;
    expect(done).toBe(true);
  });

  it("rejects at once when the signal is already aborted, with its reason", async () => {
    const reason = new Error("stop");
    await expect(sleep(10, AbortSignal.abort(reason))).rejects.toBe(reason);
  });

  it("rejects mid-way and leaves no timer or listener behind", async () => {
    vi.useFakeTimers();
    const controller = new AbortController();
    const add = vi.spyOn(controller.signal, "addEventListener");
    const remove = vi.spyOn(controller.signal, "removeEventListener");
    const p = sleep(1000, controller.signal);
    controller.abort("why");
    const error = await p.catch((e: unknown) => e);
    expect(isMoeswarmError(error, "MOESWARM_ABORTED")).toBe(true);
    expect((error as Error).cause).toBe("why");
    expect(vi.getTimerCount()).toBe(0);
    expect(add).toHaveBeenCalledTimes(1);
    expect(remove).toHaveBeenCalledTimes(1);
  });

  it("removes its listener when the time runs out", async () => {
    vi.useFakeTimers();
    const controller = new AbortController();
    const remove = vi.spyOn(controller.signal, "removeEventListener");
    const p = sleep(5, controller.signal);
    await vi.advanceTimersByTimeAsync(5);
    await p;
    expect(remove).toHaveBeenCalledTimes(1);
  });
});

describe("onAbort", () => {
  it("fires once with the abort reason and is disposable", () => {
    const controller = new AbortController();
    const seen: unknown[] = [];
    const registration = onAbort(controller.signal, (r) => seen.push(r));
    const err = new Error("x");
    controller.abort(err);
    controller.abort(err);
    expect(seen).toEqual([err]);
    registration[Symbol.dispose]();
  });

  it("does not fire after disposal", () => {
    const controller = new AbortController();
    const seen: unknown[] = [];
    {
      using _r = onAbort(controller.signal, (r) => seen.push(r));
    }
    controller.abort();
    expect(seen).toEqual([]);
  });

  it("fires in a microtask for an already-aborted signal", async () => {
    const seen: unknown[] = [];
    onAbort(AbortSignal.abort(), (r) => seen.push(r));
    expect(seen).toEqual([]);
    await Promise.resolve();
    expect(seen).toHaveLength(1);
    expect(seen[0]).toBeInstanceOf(Error);
  });

  it("accepts an undefined signal", () => {
    expect(() => onAbort(undefined, () => {})[Symbol.dispose]()).not.toThrow();
  });
});

describe("linkedSignal", () => {
  it("aborts with the first parent's reason and unlinks on dispose", () => {
    const a = new AbortController();
    const b = new AbortController();
    const linked = linkedSignal([a.signal, b.signal]);
    const reason = new Error("b");
    b.abort(reason);
    expect(linked.signal.reason).toBe(reason);
    linked.dispose();
    const c = new AbortController();
    const other = linkedSignal([c.signal]);
    other.dispose();
    c.abort();
    expect(other.signal.aborted).toBe(false);
  });

  it("times out with the supplied reason", async () => {
    vi.useFakeTimers();
    const linked = linkedSignal([], { ms: 50, reason: () => new AbortError("late") });
    await vi.advanceTimersByTimeAsync(49);
    expect(linked.signal.aborted).toBe(false);
    await vi.advanceTimersByTimeAsync(1);
    expect((linked.signal.reason as Error).message).toBe("late");
    linked.dispose();
    expect(vi.getTimerCount()).toBe(0);
  });
});

describe("default error codes", () => {
  it("takes a message alone for an area with a default code", () => {
    const e = new InvalidArgumentError("layer must be >= 0", { details: { layer: -1 } });
    expect(e.code).toBe("MOESWARM_INVALID_ARGUMENT");
    expect(e.message).toBe("layer must be >= 0");
    expect(e.details).toEqual({ layer: -1 });
  });

  it("still takes an explicit code, and refuses another area's code", () => {
    expect(new InvalidArgumentError("MOESWARM_INVALID_RANGE", "bad").code).toBe("MOESWARM_INVALID_RANGE");
    expect(() => new InvalidArgumentError("MOESWARM_HUB_CONFLICT" as never, "x")).toThrow(TypeError);
  });
});

describe("abortable", () => {
  it("settles as the promise does when the signal stays quiet, and removes its listener", async () => {
    const controller = new AbortController();
    const remove = vi.spyOn(controller.signal, "removeEventListener");
    await expect(abortable(Promise.resolve(7), controller.signal)).resolves.toBe(7);
    const why = new Error("no");
    await expect(abortable(Promise.reject(why), controller.signal)).rejects.toBe(why);
    expect(remove).toHaveBeenCalledTimes(2);
    await expect(abortable(Promise.resolve(8), undefined)).resolves.toBe(8);
  });

  it("rejects at once when the signal is already aborted, and the promise's rejection is handled", async () => {
    const reason = new Error("stop");
    const unhandled: unknown[] = [];
    const onUnhandled = (e: unknown) => unhandled.push(e);
    process.on("unhandledRejection", onUnhandled);
    try {
      const late = new Promise<number>((_, reject) => setTimeout(() => reject(new Error("late")), 1));
      await expect(abortable(late, AbortSignal.abort(reason))).rejects.toBe(reason);
      await new Promise((r) => setTimeout(r, 20));
    } finally {
      process.off("unhandledRejection", onUnhandled);
    }
    expect(unhandled).toEqual([]);
  });

  it("rejects mid-way with the signal's reason and leaves no listener behind", async () => {
    const controller = new AbortController();
    const remove = vi.spyOn(controller.signal, "removeEventListener");
    const p = abortable(new Promise<never>(() => {}), controller.signal);
    controller.abort("why");
    const error = await p.catch((e: unknown) => e);
    expect(isMoeswarmError(error, "MOESWARM_ABORTED")).toBe(true);
    expect((error as Error).cause).toBe("why");
    expect(remove).toHaveBeenCalledTimes(1);
  });
});
