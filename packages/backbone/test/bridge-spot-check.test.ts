// The bridge's `spotCheck` option: a raw socket plays the plugin, functions play the workers
// (no llama.cpp). The spot check itself is tested in @moeswarm/dispatch; this checks the plumbing.

import { existsSync } from "node:fs";
import { join } from "node:path";
import { InvalidArgumentError, type ResultFrame } from "@moeswarm/core";
import { InProcessTransport, Placement } from "@moeswarm/dispatch";
import { afterAll, describe, expect, it } from "vitest";
import { serveBackboneBridge } from "../src/index.js";
import { askBridge as ask, toyFrame as frame, tempDir, toyWorker as worker } from "./helpers.js";

const MODEL = "unit";

describe("serveBackboneBridge spotCheck", () => {
  const tmp = tempDir("mswb-sc-");
  afterAll(() => tmp.remove());

  it("checks against the fallback, answers with its numbers, quarantines the liar and reports it", async () => {
    const liar = { n: 0 };
    const good = { n: 0 };
    const local = { n: 0 };
    const placement = Placement.fromRegistrations([
      { id: "liar", model: MODEL, layers: [0], experts: [0, 1, 2] },
      { id: "good", model: MODEL, layers: [0], experts: [0, 1, 2] },
    ]);
    const transport = new InProcessTransport({ liar: worker(liar, 1.05), good: worker(good) });
    const quarantined: string[] = [];
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "sc.sock"),
      placement,
      transport,
      fallback: worker(local),
      spotCheck: { fraction: 1, seed: 1, onQuarantine: (e) => quarantined.push(e.worker) },
    });
    // the honest answer: every request goes to "good" (a bridge without the liar)
    await using plain = await serveBackboneBridge({
      socket: join(tmp.dir, "plain.sock"),
      placement: Placement.fromRegistrations([{ id: "good", model: MODEL, layers: [0], experts: [0, 1, 2] }]),
      transport,
    });
    const want = ((await ask(plain.address, frame(1))) as ResultFrame).y;
    good.n = 0;

    const first = (await ask(bridge.address, frame(2))) as ResultFrame;
    expect(first.t).toBe("result");
    expect([...first.y]).toEqual([...want]);
    expect([liar.n, good.n, local.n]).toEqual([1, 0, 1]);
    expect(quarantined).toEqual(["liar"]);
    expect(bridge.spotCheck?.quarantined()).toEqual(["liar"]);

    const second = (await ask(bridge.address, frame(3))) as ResultFrame;
    expect([...second.y]).toEqual([...want]);
    expect([liar.n, good.n, local.n]).toEqual([1, 1, 2]);
    const m = bridge.metrics();
    expect(m.spotCheck).toMatchObject({ checks: 2, disagreements: 1, quarantined: ["liar"] });
    expect(m.dispatch).toMatchObject({ spotChecks: 2, spotDisagreements: 1, fallbacks: 0 });
    // the reference is not a worker to credit, nor is a refused answer
    expect(Object.keys(bridge.takeStatsReport({ nExpert: 3 }).receipts)).toEqual(["good"]);
  });

  it("validates the option before listening", async () => {
    const placement = Placement.fromRegistrations([{ id: "a", model: MODEL, layers: [0], experts: [0] }]);
    const transport = new InProcessTransport({ a: worker({ n: 0 }) });
    const socket = join(tmp.dir, "bad.sock");
    for (const spotCheck of [
      { fraction: 1.5 },
      { fraction: Number.NaN },
      { fraction: 0.5, minCosine: 2 },
      { fraction: 0.5, strikes: 0 },
      { fraction: 0.5, reference: worker({ n: 0 }) },
      null,
    ]) {
      await expect(
        serveBackboneBridge({
          socket,
          placement,
          transport,
          spotCheck: spotCheck as { fraction: number },
        }),
      ).rejects.toSatisfy(
        (e: unknown) => e instanceof InvalidArgumentError && e.code === "MOESWARM_INVALID_ARGUMENT",
      );
    }
    expect(existsSync(socket)).toBe(false);
  });
});
