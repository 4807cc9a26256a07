// The dispatcher waits for its hub: transient failures (unreachable, 5xx) are retried with backoff,
// refusals are thrown at once, and the wait ends with the signal.
import { createServer } from "node:net";
import { AbortError, HubError, TransportError } from "@moeswarm/core";
import { captureStream } from "@moeswarm/testkit";
import { afterEach, describe, expect, it, vi } from "vitest";
import { waitForHub } from "../src/cli/hub-wait.js";
import { runDispatcherCli } from "../src/cli/run.js";

afterEach(() => {
  vi.useRealTimers();
});

describe("waitForHub", () => {
  it("retries a hub that cannot be reached, with growing delays, until it answers", async () => {
    vi.useFakeTimers();
    const delays: number[] = [];
    let calls = 0;
    const start = async () => {
      calls++;
      if (calls < 4) throw new TransportError("MOESWARM_TRANSPORT_CONNECT", "connect ECONNREFUSED");
      return "linked";
    };
    const signal = new AbortController().signal;
    const done = waitForHub(start, { signal, onRetry: (_e, ms) => delays.push(ms) });
    await vi.runAllTimersAsync();
    expect(await done).toBe("linked");
    expect(calls).toBe(4);
    expect(delays).toHaveLength(3);
    // 1 s, 2 s, 4 s, each less up to 20% jitter
    expect(delays[0]).toBeGreaterThanOrEqual(800);
    expect(delays[0]).toBeLessThanOrEqual(1000);
    expect(delays[2]).toBeGreaterThanOrEqual(3200);
    expect(delays[2]).toBeLessThanOrEqual(4000);
  });

  it("throws a refusal at once and ends with the signal while waiting", async () => {
    const refusal = new HubError("MOESWARM_HUB_NOT_FOUND", "no such model", { details: { status: 404 } });
    const retries: number[] = [];
    await expect(
      waitForHub(() => Promise.reject(refusal), {
        signal: new AbortController().signal,
        onRetry: (_e, ms) => retries.push(ms),
      }),
    ).rejects.toBe(refusal);
    expect(retries).toEqual([]);

    vi.useFakeTimers();
    const stop = new AbortController();
    const waiting = waitForHub(
      () => Promise.reject(new TransportError("MOESWARM_TRANSPORT_CONNECT", "down")),
      {
        signal: stop.signal,
        onRetry: () => stop.abort(new AbortError("stopped")),
      },
    );
    const outcome = expect(waiting).rejects.toThrow(/stopped/);
    await vi.runAllTimersAsync();
    await outcome;
  });
});

describe("moeswarm-dispatcher --hub before the hub is up", () => {
  it("keeps waiting with a line that says so instead of exiting", async () => {
    // a port nobody listens on
    const port = await new Promise<number>((resolve) => {
      const s = createServer().listen(0, "127.0.0.1", () => {
        const p = (s.address() as { port: number }).port;
        s.close(() => resolve(p));
      });
    });
    const out = captureStream();
    const err = captureStream();
    const stop = new AbortController();
    const status = runDispatcherCli(
      [
        "--socket",
        `/tmp/mswb-hubwait-${process.pid}.sock`,
        "--hub",
        `http://127.0.0.1:${port}`,
        "--model-id",
        "m",
        "--token",
        "t",
      ],
      { stdout: out.stream, stderr: err.stream },
      stop.signal,
    );
    await vi.waitFor(
      () => expect(err.text()).toMatch(/cannot reach the hub at http:\/\/127\.0\.0\.1:\d+ .*retrying in/),
      {
        timeout: 15_000,
      },
    );
    stop.abort();
    await status;
    expect(err.text()).not.toMatch(/Error:/);
  });
});
