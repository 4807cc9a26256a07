// The bridge's trust "verify" (the default over an untrusted transport such as the hub's relay): a
// raw socket plays the plugin, functions behind a transport that does not say it is trusted play
// the workers. Verification itself is tested in @moeswarm/dispatch; this checks the plumbing: the
// fallback is the third opinion, the liar is quarantined and handed to onQuarantine (the hub link
// reports it), the counters are in the metrics, and quarantine reports reach the hub's endpoint.

import { createServer } from "node:http";
import { join } from "node:path";
import type { ExpertHandler, ExpertTransport, ResultFrame } from "@moeswarm/core";
import { InProcessTransport, Placement, type VerificationEvent } from "@moeswarm/dispatch";
import { afterAll, describe, expect, it } from "vitest";
import { HubHttp } from "../src/hub-http.js";
import { hubSettings } from "../src/hub-options.js";
import { QuarantineReporter, quarantineBody } from "../src/hub-reports.js";
import { serveBackboneBridge } from "../src/index.js";
import { askBridge as ask, toyFrame as frame, tempDir, toyWorker as worker } from "./helpers.js";

const MODEL = "unit";

/** In-process workers behind a transport that, like the relay's, does not say it is trusted. */
function strangers(workers: Record<string, ExpertHandler>): ExpertTransport {
  const inner = new InProcessTransport(workers);
  return { request: (to, req, o) => inner.request(to, req, o) };
}

const ALL = [0, 1, 2];

describe("serveBackboneBridge trust", () => {
  const tmp = tempDir("mswb-tr-");
  afterAll(() => tmp.remove());

  it("verifies by default over an untrusted transport: the fallback decides, the liar is quarantined", async () => {
    const liar = { n: 0 };
    const good = { n: 0 };
    const local = { n: 0 };
    const placement = Placement.fromRegistrations([
      { id: "liar", model: MODEL, layers: [0], experts: ALL },
      { id: "good", model: MODEL, layers: [0], experts: ALL },
    ]);
    const transport = strangers({ liar: worker(liar, 1.05), good: worker(good) });
    const events: VerificationEvent[] = [];
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "v.sock"),
      placement,
      transport,
      fallback: worker(local),
      onQuarantine: (e) => events.push(e),
    });
    await using plain = await serveBackboneBridge({
      socket: join(tmp.dir, "plain.sock"),
      placement: Placement.fromRegistrations([{ id: "good", model: MODEL, layers: [0], experts: ALL }]),
      transport: new InProcessTransport({ good: worker({ n: 0 }) }),
    });
    const want = ((await ask(plain.address, frame(1))) as ResultFrame).y;
    for (let i = 0; i < 3; i++) {
      const r = (await ask(bridge.address, frame(2 + i))) as ResultFrame;
      expect(r.t).toBe("result");
      expect([...r.y]).toEqual([...want]);
    }
    expect(events.map((e) => e.worker)).toEqual(["liar"]);
    expect(events[0]!.decidedBy).toBe("the reference");
    expect(liar.n).toBe(1);
    expect(bridge.verification.quarantined()).toEqual(["liar"]);
    const m = bridge.metrics();
    // the first request verified by the pair + the fallback; then "good" alone: served locally
    expect(m.verification).toMatchObject({
      disagreements: 1,
      thirdOpinions: 1,
      quarantines: 1,
      unverifiableLocal: 2,
    });
    expect(m.verification!.extraBytes).toBeGreaterThan(0);
    expect(m.liveness).toBeDefined();
    // a refused answer earns no receipt
    expect(Object.keys(bridge.takeStatsReport({ nExpert: 3 }).receipts)).not.toContain("liar");
  });

  it('trust "own" takes the answers as they come (a private swarm, explicitly)', async () => {
    const placement = Placement.fromRegistrations([{ id: "a", model: MODEL, layers: [0], experts: ALL }]);
    const calls = { n: 0 };
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "own.sock"),
      placement,
      transport: strangers({ a: worker(calls) }),
      trust: "own",
    });
    const r = (await ask(bridge.address, frame(1))) as ResultFrame;
    expect(r.t).toBe("result");
    expect(calls.n).toBe(1);
    // without "own": one owner, no fallback: the plugin gets the typed error saying what to do
    await using strict = await serveBackboneBridge({
      socket: join(tmp.dir, "strict.sock"),
      placement,
      transport: strangers({ a: worker(calls) }),
    });
    const e = await ask(strict.address, frame(2));
    expect(e).toMatchObject({ t: "error", code: "MOESWARM_VERIFY_UNAVAILABLE" });
    await expect(
      serveBackboneBridge({
        socket: join(tmp.dir, "bad.sock"),
        placement,
        transport: strangers({}),
        trust: "maybe" as "own",
      }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
  });

  it("quarantine reports: POST .../reports/quarantine with the evidence; a 404 is not fatal", async () => {
    const seen: { url: string; body: unknown; auth: string | undefined }[] = [];
    let status = 201;
    const server = createServer((req, res) => {
      let text = "";
      req.on("data", (c: Buffer) => {
        text += c.toString();
      });
      req.on("end", () => {
        seen.push({ url: req.url ?? "", body: JSON.parse(text || "null"), auth: req.headers.authorization });
        res.writeHead(status, { "content-type": "application/json" });
        res.end(status === 404 ? JSON.stringify({ error: "not found" }) : "{}");
      });
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    const port = (server.address() as { port: number }).port;
    try {
      const settings = await hubSettings({ url: `http://127.0.0.1:${port}`, token: "t0k", model: "m/x" });
      const http = new HubHttp({ base: settings.base, token: "t0k" });
      const emitted: string[] = [];
      const stop = new AbortController();
      const reporter = new QuarantineReporter({
        http,
        settings,
        emit: (e) => emitted.push(e.type),
        stop: stop.signal,
      });
      const event: VerificationEvent = {
        worker: "liar",
        layer: 3,
        experts: [1, 2],
        reason: "x".repeat(600),
        requestDigest: "a".repeat(64),
        expected: { norm: 2 },
        got: { norm: 2.1, cosine: 1 },
        decidedBy: "the reference",
        at: 1_700_000_000_000.5,
      };
      await reporter.report(event);
      expect(seen[0]!.url).toBe("/api/models/m%2Fx/reports/quarantine");
      expect(seen[0]!.auth).toBe("Bearer t0k");
      expect(seen[0]!.body).toEqual(quarantineBody(event));
      expect(seen[0]!.body).toMatchObject({
        worker: "liar",
        layer: 3,
        requestDigest: "a".repeat(64),
        expected: { norm: 2 },
        got: { norm: 2.1, cosine: 1 },
        at: 1_700_000_000_000,
      });
      expect(Buffer.byteLength((seen[0]!.body as { reason: string }).reason)).toBeLessThanOrEqual(512);
      expect(reporter.counters).toMatchObject({ quarantineReports: 1, quarantineReportErrors: 0 });
      status = 404;
      await reporter.report(event);
      await reporter.report(event);
      // an older hub: one try, counted, then no more
      expect(seen).toHaveLength(2);
      expect(reporter.counters).toMatchObject({
        quarantineReportErrors: 1,
        quarantineReportsUnsupported: true,
      });
      expect(emitted).toEqual(["quarantine-report", "error"]);
      await http.close();
    } finally {
      await new Promise((r) => server.close(r));
    }
  });
});
