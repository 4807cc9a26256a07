// The pause's wire shapes (issue 19): the notice text the relay sends and the worker reads back,
// and the state body of GET /api/workers/:id/pause.
import { describe, expect, it } from "vitest";
import {
  parseWorkerPauseJson,
  parseWorkerPauseListJson,
  parseWorkerPauseNotice,
  WORKER_PAUSES_PATH,
  workerPauseNotice,
  workerPauseUrl,
} from "../src/index.js";

describe("worker pause", () => {
  it("reads back the notice it writes, reasons with colons and newlines included", () => {
    for (const [paused, by, reason] of [
      [true, "owner", undefined],
      [true, "operator", "maintenance: disk swap\nback at 10"],
      [false, "owner", undefined],
    ] as const) {
      const text = workerPauseNotice(paused, by, reason);
      expect(parseWorkerPauseNotice(text)).toEqual({ paused, by, ...(reason ? { reason } : {}) });
    }
    expect(workerPauseNotice(true, "owner", "on a call")).toBe("paused by the hub (owner): on a call");
    expect(parseWorkerPauseNotice("paused by the hub (mallory)")).toBeUndefined();
    expect(parseWorkerPauseNotice("slice withdrawn")).toBeUndefined();
  });

  it("checks the state body and builds the paths", () => {
    const ok = {
      worker: "phone",
      paused: true,
      hub: { by: "owner", at: 1 },
      self: { at: 2, reason: "battery" },
    };
    expect(parseWorkerPauseJson(ok)).toEqual(ok);
    expect(parseWorkerPauseJson({ worker: "phone", paused: false })).toEqual({
      worker: "phone",
      paused: false,
    });
    for (const bad of [
      {},
      { worker: "", paused: true },
      { worker: "w", paused: "yes" },
      { worker: "w", paused: true, hub: { by: "mallory", at: 1 } },
      { worker: "w", paused: true, self: { reason: "battery" } },
    ]) {
      expect(() => parseWorkerPauseJson(bad)).toThrow(
        expect.objectContaining({ code: "MOESWARM_HUB_BAD_REQUEST" }),
      );
    }
    expect(workerPauseUrl("a b")).toBe("/api/workers/a%20b/pause");
    expect(workerPauseUrl("w", "resume")).toBe("/api/workers/w/resume");
  });

  it("checks the list of pauses (GET /api/pauses) entry by entry", () => {
    const list = {
      pauses: [
        { worker: "a", paused: true, hub: { by: "operator", at: 1, reason: "maintenance" } },
        { worker: "b", paused: true, self: { at: 2 } },
      ],
    };
    expect(parseWorkerPauseListJson(list)).toEqual(list);
    expect(parseWorkerPauseListJson({ pauses: [] })).toEqual({ pauses: [] });
    for (const bad of [{}, { pauses: {} }, { pauses: [{ worker: "a" }] }, null]) {
      expect(() => parseWorkerPauseListJson(bad)).toThrow(
        expect.objectContaining({ code: "MOESWARM_HUB_BAD_REQUEST" }),
      );
    }
    expect(WORKER_PAUSES_PATH).toBe("/api/pauses");
  });
});
