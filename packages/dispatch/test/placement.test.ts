import { DispatchError, InvalidArgumentError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import { Placement, type WorkerRegistration } from "../src/index.js";

const reg = (id: string, experts: number[], layers = [0, 1], model = "m"): WorkerRegistration => ({
  id,
  model,
  layers,
  experts,
});

describe("Placement", () => {
  it("maps (layer, expert) to owners from registrations, replicas in registration order", () => {
    const p = Placement.fromRegistrations([reg("a", [0, 1, 2]), reg("b", [2, 3]), reg("c", [3], [1])]);
    expect(p.model).toBe("m");
    expect(p.owners(0, 2)).toEqual(["a", "b"]);
    expect(p.owners(0, 3)).toEqual(["b"]);
    expect(p.owners(1, 3)).toEqual(["b", "c"]);
    expect(p.owners(2, 0)).toEqual([]);
    expect(p.workers()).toEqual(["a", "b", "c"]);
  });

  it("validate reports every expert without an owner, per layer, before decoding", () => {
    const p = Placement.fromRegistrations([reg("a", [0, 1, 5]), reg("b", [7], [1])]);
    let err: unknown;
    try {
      p.validate({ layers: [0, 1, 2], nExpert: 8 });
    } catch (e) {
      err = e;
    }
    expect(err).toBeInstanceOf(DispatchError);
    const e = err as DispatchError;
    expect(e.code).toBe("MOESWARM_DISPATCH_NO_OWNER");
    expect(e.details?.missing).toEqual([
      { layer: 0, experts: "2:5,6:8", count: 5 },
      { layer: 1, experts: "2:5,6:7", count: 4 },
      { layer: 2, experts: "0:8", count: 8 },
    ]);
    expect(e.message).toMatch(/17 expert\(s\) of model m have no owner/);
    expect(() =>
      Placement.fromRegistrations([reg("a", [0, 1, 2, 3])]).validate({ layers: [0, 1], nExpert: 4 }),
    ).not.toThrow();
  });

  it("register replaces a worker's previous registration; unregister removes it", () => {
    const p = Placement.fromRegistrations([reg("a", [0, 1]), reg("b", [1])]);
    p.register(reg("a", [2]));
    expect(p.owners(0, 0)).toEqual([]);
    expect(p.owners(0, 1)).toEqual(["b"]);
    expect(p.owners(0, 2)).toEqual(["a"]);
    expect(p.unregister("b")).toBe(true);
    expect(p.unregister("b")).toBe(false);
    expect(p.owners(0, 1)).toEqual([]);
  });

  it("merges several registrations of one worker (one per slice, as the hub lists them)", () => {
    // reg(id, experts, layers): worker a holds layers 0:3 x experts 0:2 and layer 3 x experts 0:4
    const p = Placement.fromRegistrations([
      reg("a", [0, 1], [0, 1, 2]),
      reg("b", [2, 3], [0, 1, 2]),
      reg("a", [0, 1, 2, 3], [3]),
      reg("a", [0, 1], [0, 1, 2]), // the same slice again: idempotent
    ]);
    expect(p.workers()).toEqual(["a", "b"]);
    for (const layer of [0, 1, 2]) {
      expect([0, 1, 2, 3].map((e) => p.owners(layer, e))).toEqual([["a"], ["a"], ["b"], ["b"]]);
    }
    expect([0, 1, 2, 3].map((e) => p.owners(3, e))).toEqual([["a"], ["a"], ["a"], ["a"]]);
    expect(p.missing({ layers: [0, 1, 2, 3], nExpert: 4 })).toEqual([]);
    // overlapping slices of one worker: still one owner per cell, and unregister removes them all
    p.add(reg("b", [1, 2], [0]));
    expect(p.owners(0, 1)).toEqual(["a", "b"]);
    expect(p.owners(0, 2)).toEqual(["b"]);
    expect(p.unregister("a")).toBe(true);
    expect(p.owners(3, 0)).toEqual([]);
    expect(p.owners(0, 1)).toEqual(["b"]);
    expect(p.missing({ layers: [0, 1, 2, 3], nExpert: 4 })).toEqual([
      { layer: 0, experts: "0:1", count: 1 },
      { layer: 1, experts: "0:2", count: 2 },
      { layer: 2, experts: "0:2", count: 2 },
      { layer: 3, experts: "0:4", count: 4 },
    ]);
    // register (unlike add) replaces everything the worker had
    p.register(reg("b", [3], [3]));
    expect(p.owners(0, 2)).toEqual([]);
    expect(p.owners(3, 3)).toEqual(["b"]);
  });

  it("keeps the dtypes each worker advertised (undefined: it did not say), and forgets them with it", () => {
    const p = Placement.fromRegistrations([
      { ...reg("cpu", [0, 1]), dtypes: ["f32", "q8_0", "q8_K"] },
      reg("old", [2, 3]),
    ]);
    expect(p.dtypes("cpu")).toEqual(["f32", "q8_0", "q8_K"]);
    expect(p.dtypes("old")).toBeUndefined();
    p.unregister("cpu");
    expect(p.dtypes("cpu")).toBeUndefined();
    expect(() => p.register({ ...reg("bad", [0]), dtypes: [""] })).toThrow(InvalidArgumentError);
    expect(() => p.register({ ...reg("bad", [0]), dtypes: "q8_0" as never })).toThrow(InvalidArgumentError);
  });

  it("rejects registrations for another model and malformed ones", () => {
    const p = new Placement({ model: "m" });
    expect(() => p.register(reg("a", [0], [0], "other"))).toThrow(InvalidArgumentError);
    expect(() => p.register(reg("", [0]))).toThrow(InvalidArgumentError);
    expect(() => p.register(reg("x".repeat(129), [0]))).toThrow(InvalidArgumentError);
    expect(() => p.register(reg("a", [-1]))).toThrow(InvalidArgumentError);
    expect(() => p.register(reg("a", [0.5]))).toThrow(InvalidArgumentError);
    expect(() =>
      p.register({ id: "a", model: "m", layers: [0], experts: "0:4" as unknown as number[] }),
    ).toThrow(InvalidArgumentError);
    expect(() => Placement.fromRegistrations([])).toThrow(InvalidArgumentError);
    expect(p.workers()).toEqual([]);
  });

  it("choose: fewest in-flight first, then an owner already used in the call, then round robin", () => {
    const p = Placement.fromRegistrations([reg("a", [0, 1]), reg("b", [0, 1]), reg("c", [0, 1])]);
    // rotation spreads successive calls over the replicas
    expect([0, 1, 2, 3].map((rotation) => p.choose(0, 0, { rotation }))).toEqual(["a", "b", "c", "a"]);
    // a worker already picked in this call wins a tie, so one call sends as few requests as it can
    expect(p.choose(0, 1, { rotation: 0, chosen: new Set(["c"]) })).toBe("c");
    // load beats both
    p.acquire("a");
    p.acquire("c");
    expect(p.choose(0, 0, { rotation: 0, chosen: new Set(["c"]) })).toBe("b");
    p.release("a");
    p.release("c");
    expect(p.inFlight("a")).toBe(0);
    expect(p.choose(0, 0, { rotation: 0, exclude: new Set(["a", "b", "c"]) })).toBeUndefined();
    expect(p.choose(5, 0, { rotation: 0 })).toBeUndefined();
  });

  it("nextRotation advances once per call, starting at 0", () => {
    const p = new Placement({ model: "m" });
    expect([p.nextRotation(), p.nextRotation(), p.nextRotation()]).toEqual([0, 1, 2]);
  });
});
