// The worker's report of what it answered directly (DirectServedReport), against a scripted hub:
// filled slots counted per backbone and model, a rising seq, counts kept over a failed send and
// sent with the next one, and nothing more sent to a hub without the route (404).
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { tmpdir } from "node:os";
import type { DirectServedJson } from "@moeswarm/core";
import { HubClient } from "@moeswarm/relay-client";
import { afterEach, describe, expect, it } from "vitest";
import { runWorkerCli, workerOptions } from "../src/cli.js";
import { DIRECT_REPORT_MS, DirectServedReport, directSettings } from "../src/direct.js";

const servers: Server[] = [];
afterEach(async () => {
  await Promise.all(servers.splice(0).map((s) => new Promise((r) => s.close(r))));
});

/** A hub answering each POST with the next status of `statuses` (then 200), recording the bodies. */
async function scriptedHub(statuses: number[]) {
  const bodies: Array<{ path: string; body: DirectServedJson }> = [];
  const server = createServer((req, res) => {
    let text = "";
    req.setEncoding("utf8").on("data", (c: string) => {
      text += c;
    });
    req.on("end", () => {
      bodies.push({ path: req.url ?? "", body: JSON.parse(text) as DirectServedJson });
      const status = statuses.shift() ?? 200;
      res.writeHead(status, { "content-type": "text/plain" }).end(status === 200 ? "{}" : "no");
    });
  });
  servers.push(server);
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const hub = new HubClient({
    base: `http://127.0.0.1:${(server.address() as AddressInfo).port}`,
    token: "t",
  });
  return { hub, bodies };
}

const signal = () => new AbortController().signal;

describe("DirectServedReport", () => {
  it("counts filled slots per backbone and model, keeps them over a failed send, sends them with the next", async () => {
    const { hub, bodies } = await scriptedHub([503]);
    const r = new DirectServedReport(hub, "w 1");
    await r.flush(signal()); // nothing counted: nothing sent
    expect(bodies).toEqual([]);
    r.add("bb", "m", Int32Array.from([0, 1, -1, 3]));
    r.add("bb", "m", Int32Array.from([2, -1]));
    r.add("bb2", "m", Int32Array.from([5]));
    await expect(r.flush(signal())).rejects.toMatchObject({ code: "MOESWARM_HUB_INTERNAL" });
    r.add("bb", "m2", Int32Array.from([1, 2]));
    await r.flush(signal());
    expect(bodies).toHaveLength(2);
    expect(bodies[1]!.path).toBe("/api/workers/w%201/direct/served");
    expect(bodies[1]!.body.seq).toBeGreaterThan(bodies[0]!.body.seq);
    expect(bodies[1]!.body.served).toEqual(
      expect.arrayContaining([
        { backbone: "bb", model: "m", expertTokens: 4, requests: 2 },
        { backbone: "bb2", model: "m", expertTokens: 1, requests: 1 },
        { backbone: "bb", model: "m2", expertTokens: 2, requests: 1 },
      ]),
    );
    expect(bodies[1]!.body.served).toHaveLength(3);
    // sent: the next report starts from zero
    r.add("bb", "m", Int32Array.from([7]));
    await r.flush(signal());
    expect(bodies[2]!.body.served).toEqual([{ backbone: "bb", model: "m", expertTokens: 1, requests: 1 }]);
  });

  it("stops sending to a hub without the route (404)", async () => {
    const { hub, bodies } = await scriptedHub([404]);
    const r = new DirectServedReport(hub, "w1");
    r.add("bb", "m", Int32Array.from([0]));
    await r.flush(signal()); // no error: an older hub
    r.add("bb", "m", Int32Array.from([0]));
    await r.flush(signal());
    expect(bodies).toHaveLength(1);
  });
});

describe("moeswarm-worker --direct-report SECONDS", () => {
  const base = { hub: "http://127.0.0.1:9", token: "t", "cache-dir": tmpdir(), listen: "127.0.0.1:0" };
  const options = (values: Record<string, string>) => workerOptions({ ...base, ...values }, {});

  it("sets the report interval, checked: seconds in 0.1..600, only with --listen or --listen-native", async () => {
    expect((await options({ "direct-report": "2.5" })).direct?.reportMs).toBe(2500);
    expect((await options({ "direct-report": "600" })).direct?.reportMs).toBe(600_000);
    // not given: the default
    expect((await options({})).direct?.reportMs).toBeUndefined();
    expect(directSettings((await options({})).direct)?.reportMs).toBe(DIRECT_REPORT_MS);
    for (const [bad, says] of [
      ["0", "--direct-report must be a number of seconds >= 0.1"],
      ["0.05", "--direct-report must be a number of seconds >= 0.1"],
      ["-1", "--direct-report must be a number of seconds >= 0.1"],
      ["ten", "--direct-report must be a number of seconds >= 0.1"],
      ["601", "--direct-report must be at most 600 seconds"],
    ] as const) {
      await expect(options({ "direct-report": bad }), bad).rejects.toMatchObject({
        code: "MOESWARM_INVALID_ARGUMENT",
        message: expect.stringContaining(says),
        details: { usage: true },
      });
    }
    const { listen: _, ...noListen } = base;
    await expect(workerOptions({ ...noListen, "direct-report": "5" }, {})).rejects.toMatchObject({
      message: expect.stringContaining("--direct-report goes with --listen HOST:PORT or --listen-native"),
    });
    // the API option is checked the same way
    for (const reportMs of [0, 99, 600_001, Number.NaN]) {
      expect(() => directSettings({ listen: "127.0.0.1:0", reportMs }), String(reportMs)).toThrow(
        expect.objectContaining({ code: "MOESWARM_INVALID_ARGUMENT" }),
      );
    }
  });

  it("is in --help", async () => {
    let text = "";
    const out = {
      write(s: string) {
        text += s;
        return true;
      },
    };
    const io = { stdout: out as never, stderr: out as never, env: {} };
    expect(await runWorkerCli(["--help"], io, AbortSignal.abort())).toBe(0);
    expect(text).toMatch(/--direct-report SECONDS\s+how often to tell the hub what was answered directly/);
  });
});
