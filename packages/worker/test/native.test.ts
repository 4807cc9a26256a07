// The worker's native listener (runWorker `native`, `--listen-native`; protocol section 10.9) in
// this process against a real hub on loopback (tiny model, the native addon): its options and
// usage errors; a plugin-side client that dispatches natively while the worker serves, gets
// MOESWARM_TRANSPORT_DRAINING while the hub pauses it and results again after the resume; and which
// layers a worker's slices let it serve natively (one slice alone per layer).
import { join } from "node:path";
import type { PlacementRegistrationJson, ResultFrame } from "@moeswarm/core";
import { type Hub, mintToken } from "@moeswarm/hub";
import { type TempDir, waitFor } from "@moeswarm/testkit";
import { type ExpertCompute, probeNative } from "@moeswarm/worker-native";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runWorkerCli } from "../src/cli.js";
import type { WorkerEvent } from "../src/events.js";
import { runWorker } from "../src/run-worker.js";
import { SliceRouter } from "../src/slice-router.js";
import { startTestHub, waitPlacement } from "./fixtures.js";
import { dial, ticketFor } from "./native-fixtures.js";

const MODEL = "qwen3moe-tiny";
const SECRET = "worker-native-e2e-secret-0123456789";
const EMBD = 64;

const native = await probeNative();
if (!native.available) {
  if (process.env.CI) throw new Error(`CI must build the native addon:\n${native.message}`);
  console.warn(`skipping the native listener runs: ${native.message}`);
}

let hub: Hub;
let url: string;
let work: TempDir;

beforeAll(async () => {
  ({ hub, url, work } = await startTestHub({
    secret: SECRET,
    model: MODEL,
    preset: "tiny",
    workPrefix: "moeswarm-worker-native-",
  }));
});
afterAll(async () => {
  await hub?.close();
  work?.remove();
});

const sink = () => ({
  text: "",
  write(t: string) {
    this.text += t;
    return true;
  },
});

describe("the native listener's options", () => {
  it("moeswarm-worker: --listen-native HOST:PORT, --advertise-native with it, one TLS pair; in --help", async () => {
    const out = sink();
    const err = sink();
    const io = { stdout: out as never, stderr: err as never, env: {} };
    const base = ["--hub", url, "--token", "t", "--cache-dir", `${work.dir}/cli`];
    const signal = AbortSignal.abort();
    const usage = async (args: string[], text: string) => {
      err.text = "";
      expect(await runWorkerCli([...base, ...args], io, signal), args.join(" ")).toBe(2);
      expect(err.text).toContain(text);
    };
    await usage(["--advertise-native", "me:7444"], "--advertise-native goes with --listen-native");
    await usage(["--listen-native", "7444"], "--listen-native must be host:port");
    await usage(["--listen-native", "0.0.0.0:7444", "--advertise-native", "wss://me:7444"], "host:port");
    await usage(
      ["--listen-native", "0.0.0.0:7444", "--tls-key", "k.pem"],
      "give both --tls-cert and --tls-key",
    );
    await usage(["--tls-cert", "c.pem", "--tls-key", "k.pem"], "--listen-native HOST:PORT");
    await usage(["--direct-report", "5"], "--direct-report goes with --listen HOST:PORT or --listen-native");
    await usage(
      ["--listen-native", "0.0.0.0:0", "--direct-report", "9999"],
      "--direct-report must be at most 600",
    );
    out.text = "";
    expect(await runWorkerCli(["--help"], io, signal)).toBe(0);
    expect(out.text).toContain("--listen-native HOST:PORT");
    expect(out.text).toContain("--advertise-native HOST:PORT");
  });

  it("runWorker checks `native`: host:port, advertised addresses, the same certificate as `direct`", async () => {
    const base = {
      hub: url,
      token: mintToken({ role: "worker", id: "wx", ttlS: 600 }, SECRET),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: `${work.dir}/cache-x`,
      signal: AbortSignal.abort(),
    };
    const refused = { code: "MOESWARM_INVALID_ARGUMENT" };
    await expect(runWorker({ ...base, native: { listen: "no-port" } })).rejects.toMatchObject(refused);
    await expect(
      runWorker({ ...base, native: { listen: "0.0.0.0:0", advertise: "me" } }),
    ).rejects.toMatchObject(refused);
    // the served reports' interval of a worker without `direct`
    await expect(runWorker({ ...base, native: { listen: "0.0.0.0:0", reportMs: 50 } })).rejects.toMatchObject(
      {
        ...refused,
        message: expect.stringContaining("native.reportMs must be 100..600000 ms"),
      },
    );
    await expect(
      runWorker({
        ...base,
        direct: { listen: "0.0.0.0:0", tlsCert: "A", tlsKey: "a" },
        native: { listen: "0.0.0.0:0", tlsCert: "B", tlsKey: "b" },
      }),
    ).rejects.toMatchObject(refused);
  });
});

describe("which layers go on the native plane", () => {
  it("only a layer that one slice holds alone: a layer split over two slices is left out", () => {
    const compute = (name: string) => ({ name, info: { nEmbd: 64 } }) as unknown as ExpertCompute;
    const [a, b, c] = [compute("a"), compute("b"), compute("c")];
    const router = new SliceRouter(MODEL);
    router.add({ layers: { start: 0, end: 2 }, experts: { start: 0, end: 8 }, compute: a });
    router.add({ layers: { start: 2, end: 3 }, experts: { start: 0, end: 4 }, compute: b });
    router.add({ layers: { start: 2, end: 4 }, experts: { start: 4, end: 8 }, compute: c });
    expect(router.soleSlices()).toEqual([
      { layer: 0, compute: a },
      { layer: 1, compute: a },
      { layer: 3, compute: c },
    ]);
    router.remove(b);
    expect(router.soleSlices().map((s) => s.layer)).toEqual([0, 1, 2, 3]);
  });
});

describe.skipIf(!native.available)("runWorker with `native`", () => {
  it("serves natively, answers DRAINING while the hub pauses it, serves again after the resume", async () => {
    const events: WorkerEvent[] = [];
    const stop = new AbortController();
    const run = runWorker({
      hub: url,
      token: mintToken({ role: "worker", id: "wn", ttlS: 600 }, SECRET),
      capacity: { ramBytes: 10_000_000 },
      cacheDir: join(work.dir, "cache-native"),
      backend: "native",
      pollMs: 50,
      power: false,
      native: { listen: "127.0.0.1:0" },
      log: (e) => events.push(e),
      signal: stop.signal,
    });
    const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
    const hubPost = (path: string, body: unknown = {}) =>
      fetch(`${url}${path}`, {
        method: "POST",
        headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
        body: JSON.stringify(body),
      });
    const count = (name: string) => events.filter((e) => e.event === name).length;
    try {
      const p = await waitPlacement(url, MODEL, "wn's native address", (pl) =>
        pl.registrations.some((r) => r.id === "wn" && (r as PlacementRegistrationJson).direct?.native),
      );
      const reg = p.registrations.find((r) => r.id === "wn") as PlacementRegistrationJson;
      const c = await dial(reg.direct!.native![0]!);
      const bb = mintToken({ role: "backbone", id: "bb", ttlS: 600 }, SECRET);
      c.send({ t: "hello", v: 1, role: "backbone", id: "bb", token: await ticketFor(url, "wn", bb) });
      expect(await c.next()).toMatchObject({ t: "hello" });
      let id = 0;
      const ask = async () => {
        const ids = Int32Array.from([reg.experts[0]!, reg.experts[1]!]);
        const x = Float32Array.from({ length: EMBD }, (_, i) => Math.sin(i));
        c.send({
          t: "dispatch",
          v: 1,
          id: ++id,
          model: MODEL,
          layer: reg.layers[0]!,
          n: 1,
          embd: EMBD,
          dtype: "f32",
          x,
          k: 2,
          ids,
          w: Float32Array.from([0.6, 0.4]),
          mode: "sum",
        });
        return (await c.next()) as ResultFrame | { t: "error"; code: string };
      };
      expect(await ask()).toMatchObject({ t: "result", id: 1 });

      expect((await hubPost("/api/workers/wn/pause", { reason: "test" })).status).toBe(200);
      await waitFor(() => count("paused") === 1, "the worker hears of the pause", 10_000);
      expect(await ask()).toMatchObject({ t: "error", id: 2, code: "MOESWARM_TRANSPORT_DRAINING" });
      const routes = events.filter((e) => e.event === "native-routes");
      expect(routes.at(-1)).toMatchObject({ layers: 0 });
      expect(routes.at(-2)).toMatchObject({ layers: reg.layers.length });

      expect((await hubPost("/api/workers/wn/resume")).status).toBe(200);
      await waitFor(() => count("resumed") === 1, "the worker hears of the resume", 10_000);
      expect(await ask()).toMatchObject({ t: "result", id: 3 });
      c.close();
    } finally {
      stop.abort("test done");
    }
    expect(await run).toMatchObject({ served: true });
    // the drain emptied the table before the listener closed
    expect(events.filter((e) => e.event === "native-routes").at(-1)).toMatchObject({ layers: 0 });
  }, 60_000);
});
