// The dead-peer error names the peer that went silent: the relay on a relay connection, the worker
// and its link on a backbone's direct link (whose relay may be fine). Fake timers drive the clock.
import { afterEach, describe, expect, it, vi } from "vitest";
import { Heartbeat, RELAY_PEER } from "../src/heartbeat.js";
import { connectRelay } from "../src/index.js";

afterEach(() => {
  vi.useRealTimers();
});

/** A heartbeat on a live link whose peer never answers; returns the dead-peer error it reports. */
async function silence(peer?: string) {
  vi.useFakeTimers({ toFake: ["setInterval", "clearInterval", "performance"] });
  const dead: Error[] = [];
  const pings: number[] = [];
  const hb = new Heartbeat(
    1000,
    4000,
    { live: () => true, ping: (seq) => pings.push(seq), dead: (e) => dead.push(e) },
    ...(peer === undefined ? [] : [peer]),
  );
  hb.start();
  await vi.advanceTimersByTimeAsync(3900);
  // pinged along the way, not yet dead
  expect(pings.length).toBeGreaterThanOrEqual(3);
  expect(dead).toEqual([]);
  await vi.advanceTimersByTimeAsync(1100);
  hb.stop();
  expect(dead).toHaveLength(1);
  return dead[0] as Error & { code: string; details: Record<string, unknown> };
}

describe("the dead-peer error", () => {
  it("on a relay connection says the relay was silent", async () => {
    const e = await silence();
    expect(e.code).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    expect(e.message).toMatch(/^no frame from the relay for \d+ ms \(deadPeerMs 4000\)$/);
    expect(e.details).toMatchObject({ peer: RELAY_PEER, deadPeerMs: 4000 });
  });

  it("on a direct link names the worker and its link, never the relay", async () => {
    const e = await silence("worker w1 on its direct link wss://w1.example:7443");
    expect(e.code).toBe("MOESWARM_TRANSPORT_TIMEOUT");
    expect(e.message).toMatch(
      /^no frame from worker w1 on its direct link wss:\/\/w1\.example:7443 for \d+ ms \(deadPeerMs 4000\)$/,
    );
    expect(e.message).not.toContain("relay");
    expect(e.details).toMatchObject({ peer: "worker w1 on its direct link wss://w1.example:7443" });
  });

  it("a silent peer that shows bytes is not dead", async () => {
    vi.useFakeTimers({ toFake: ["setInterval", "clearInterval", "performance"] });
    const dead: Error[] = [];
    const hb = new Heartbeat(1000, 4000, { live: () => true, ping: () => {}, dead: (e) => dead.push(e) });
    hb.start();
    for (let i = 0; i < 10; i++) {
      await vi.advanceTimersByTimeAsync(2000);
      hb.seen();
    }
    hb.stop();
    expect(dead).toEqual([]);
  });

  it("connectRelay checks peerName", async () => {
    await expect(
      connectRelay("ws://127.0.0.1:1", { role: "backbone", id: "b", token: "t", peerName: "" }),
    ).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
      message: expect.stringContaining("peerName"),
    });
  });
});
