// A compute process that dies (issue #19: lavapipe's heap corruption kills the Vulkan worker) must
// not take the participant down: WorkerProcessCompute fails the requests the dead process held with
// a typed error the dispatcher fails over on, starts the process again on the same slice, and gives
// up with a typed error past its restart budget. The processes here really die (kill -SEGV, -ABRT
// in flight); the executable is the static CPU build, which loads in a moment.

import { getEventListeners } from "node:events";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { spawnExpertWorker, type WorkerProcessCompute } from "../src/index.js";
import { bitsEqual, normals, randomIds } from "./fixtures.js";
import { binary, K, missing, N_EMBD, sliceExperts, writeTestSlice } from "./worker-exe-fixture.js";

const BIG = 2048; // rows enough that the process is still computing when the signal comes

function bigRun(worker: WorkerProcessCompute, seed: number): Promise<Float32Array> {
  return worker.run({
    layer: 2,
    x: normals(BIG * N_EMBD, seed),
    ids: randomIds(BIG, K, sliceExperts, seed + 1),
    k: K,
    mode: "each",
  });
}

describe.skipIf(Boolean(missing))("the worker process restarts after a crash", () => {
  const tmp = tempDir("moeswarm-wn-restart-");
  let slicePath: string;
  beforeAll(async () => {
    ({ slicePath } = await writeTestSlice(tmp.dir));
  });
  afterAll(() => tmp.remove());

  const x = normals(N_EMBD, 2);
  const small = { layer: 1, x, ids: new Int32Array([5]), k: 1, mode: "each" as const };

  it("fails the request in flight with MOESWARM_NATIVE_WORKER_CRASHED, reloads the slice, then gives up past its budget", async () => {
    const events: { restarts: number; error: Error }[] = [];
    await using worker = await spawnExpertWorker(binary!, slicePath, {
      threads: 1,
      restart: { max: 2, backoffMs: 5, onRestart: (e) => events.push(e) },
    });
    const before = await worker.run(small);
    const firstPid = worker.pid;

    const doomed = bigRun(worker, 10);
    process.kill(worker.pid!, "SIGSEGV");
    await expect(doomed).rejects.toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_WORKER_CRASHED",
      message: expect.stringMatching(/signal SIGSEGV/),
    });
    // asked while the new process loads: it waits for it, and the reloaded slice answers the same bits
    const after = await worker.run(small);
    expect(bitsEqual(after, before)).toBe(true);
    expect(worker.pid).not.toBe(firstPid);
    expect(worker.restarts).toBe(1);
    expect(events.map((e) => [e.restarts, (e.error as { code?: string }).code])).toEqual([
      [1, "MOESWARM_NATIVE_WORKER_CRASHED"],
    ]);

    const doomed2 = bigRun(worker, 20);
    process.kill(worker.pid!, "SIGABRT");
    await expect(doomed2).rejects.toMatchObject({ code: "MOESWARM_NATIVE_WORKER_CRASHED" });
    expect(bitsEqual(await worker.run(small), before)).toBe(true);
    expect(worker.restarts).toBe(2);

    // the third death within the window is past the budget of 2: no restart, a typed refusal
    const doomed3 = bigRun(worker, 30);
    process.kill(worker.pid!, "SIGSEGV");
    await expect(doomed3).rejects.toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_WORKER_RESTARTS_EXHAUSTED",
      message: expect.stringMatching(/3 times .*signal SIGSEGV/),
    });
    await expect(worker.run(small)).rejects.toMatchObject({
      code: "MOESWARM_NATIVE_WORKER_RESTARTS_EXHAUSTED",
    });
    expect(worker.restarts).toBe(2);
  }, 60_000);

  it("a request waiting for the restart honours its signal, and close() during the backoff ends it", async () => {
    const worker = await spawnExpertWorker(binary!, slicePath, {
      threads: 1,
      restart: { backoffMs: 30_000 }, // never reached: close() and the signal come first
    });
    await worker.run(small);
    const doomed = bigRun(worker, 40);
    process.kill(worker.pid!, "SIGKILL");
    await expect(doomed).rejects.toMatchObject({ code: "MOESWARM_NATIVE_WORKER_CRASHED" });
    const ctl = new AbortController();
    const waiting = worker.run(small, { signal: ctl.signal });
    const waiting2 = worker.run(small);
    ctl.abort(new Error("enough"));
    await expect(waiting).rejects.toThrow("enough");
    expect(getEventListeners(ctl.signal, "abort")).toHaveLength(0);
    await worker.close();
    await expect(waiting2).rejects.toMatchObject({ code: "MOESWARM_NATIVE_CLOSED" });
    expect(worker.restarts).toBe(1);
  }, 60_000);

  it("restart: false keeps the old contract: the process's death closes the compute", async () => {
    await using worker = await spawnExpertWorker(binary!, slicePath, { threads: 1, restart: false });
    const doomed = bigRun(worker, 50);
    process.kill(worker.pid!, "SIGSEGV");
    await expect(doomed).rejects.toMatchObject({ name: "TransportError", code: "MOESWARM_TRANSPORT_CLOSED" });
    await expect(worker.run(small)).rejects.toMatchObject({ code: "MOESWARM_TRANSPORT_CLOSED" });
    await expect(spawnExpertWorker(binary!, slicePath, { restart: { max: -1 } })).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
      message: expect.stringMatching(/restart.max/),
    });
  }, 60_000);
});
