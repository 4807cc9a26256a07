// The native data plane's path of `roundtrip`: the plugin's C++ TLS client (moeswarm-native-ping, its
// code without llama.cpp around it) -> the worker addon's native listener (serveNative) in this
// process, computing a synthetic quantised one-layer slice. Unlike the echo paths, this worker
// computes; each result's `ms` (the worker's compute time) is taken off its round trip, which leaves
// what the goal bounds: "native above compute". Its floor is the same client against
// `moeswarm-native-ping --serve-echo`: the same TLS code at both ends and the same frames, nothing
// decoded or computed, which is what TLS itself costs on this machine.
import { type ChildProcess, execFile, spawn } from "node:child_process";
import { once } from "node:events";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { promisify } from "node:util";
import { GgmlType } from "@moeswarm/shard";
import {
  type ExpertCompute,
  loadExpertCompute,
  type NativeServer,
  nativeSliceOf,
  prebuiltPath,
  serveNative,
} from "@moeswarm/worker-native";
import { nativeOrSkip, type SliceSpec, THREADS, writeExpertSlice } from "../native-slice.js";

const run = promisify(execFile);
// round trips per size: 300 at 1 token, fewer as the compute grows (64 tokens take ~70 ms each on
// one thread), so that the largest size stays a few seconds
const ITERS = Number(process.env.MOESWARM_BENCH_NATIVE_ITERS ?? 300);
const iters = (n: number) => Math.max(50, Math.round(ITERS / Math.sqrt(n)));
const warmup = (n: number) => Math.max(5, Math.round(30 / Math.sqrt(n)));

/** p50/p90 of one-at-a-time native round trips, and p50 of each round trip less its compute. */
export interface NativeSample {
  p10: number;
  p50: number;
  p90: number;
  aboveComputeP50: number;
  computeP50: number;
}

/** p10/p50/p90 of the TLS echo's round trips, microseconds. */
export interface EchoSample {
  p10: number;
  p50: number;
  p90: number;
}

export interface NativeMeasure {
  native: NativeSample;
  echo: EchoSample;
  held: EchoSample;
}

export interface NativePath {
  /**
   * The native path at n tokens, and its floors with the same frames: the TLS echo answering at
   * once, and held for the native worker's compute p50 (less that hold), so that the client's
   * core sleeps as long as it does for the worker.
   */
  measure(n: number): Promise<NativeMeasure>;
  close(): Promise<void>;
}

function pct(sorted: number[], p: number): number {
  return sorted[Math.min(sorted.length - 1, Math.floor((p / 100) * sorted.length))]!;
}

/** Sorted percentile figures of the ping's JSON line (rtUs, workerMs). */
export function nativeSample(rtUs: number[], workerMs: number[]): NativeSample {
  if (rtUs.length === 0 || rtUs.length !== workerMs.length)
    throw new Error("moeswarm-native-ping measured nothing");
  const rt = [...rtUs].sort((a, b) => a - b);
  const above = rtUs.map((us, i) => us - workerMs[i]! * 1000).sort((a, b) => a - b);
  const compute = workerMs.map((ms) => ms * 1000).sort((a, b) => a - b);
  return {
    p10: pct(rt, 10),
    p50: pct(rt, 50),
    p90: pct(rt, 90),
    aboveComputeP50: pct(above, 50),
    computeP50: pct(compute, 50),
  };
}

/** A TLS echo (moeswarm-native-ping --serve-echo) on an ephemeral port, and its pin. */
interface Echo {
  child: ChildProcess;
  addr: string;
  fp: string;
}

/** The echo with the certificate in `dir`, holding each answer `holdUs` (busy, as a worker computes). */
async function startEcho(ping: string, dir: string, holdUs: number): Promise<Echo> {
  const child = spawn(
    ping,
    [
      ["--serve-echo", "127.0.0.1"],
      ["--cert", join(dir, "cert.pem")],
      ["--key", join(dir, "key.pem")],
      ["--hold-us", String(Math.round(holdUs))],
    ].flat(),
    { stdio: ["ignore", "pipe", "inherit"] },
  );
  const [line] = (await Promise.race([
    once(child.stdout!, "data"),
    once(child, "exit").then(() => {
      throw new Error("moeswarm-native-ping --serve-echo exited before it listened");
    }),
  ])) as [Buffer];
  const { port, fingerprint } = JSON.parse(line.toString().split("\n")[0]!) as {
    port: number;
    fingerprint: string;
  };
  return { child, addr: `127.0.0.1:${port}`, fp: fingerprint };
}

/** p10/p50/p90 of the echo's round trips less the time it held each answer. */
function echoSample(rtUs: number[], holdUs: number): EchoSample {
  const { p10, p50, p90 } = nativeSample(
    rtUs.map((us) => us - holdUs),
    rtUs.map(() => 0),
  );
  return { p10, p50, p90 };
}

/**
 * The native path with a slice of n_embd `embd` (so the frames are the other paths' frames), or the
 * note that says why it is not measured (no addon, no moeswarm-native-ping in the prebuilds).
 */
export async function startNativePath(o: {
  embd: number;
  k: number;
  model: string;
  tls: { cert: string; key: string };
}): Promise<NativePath | string> {
  const native = await nativeOrSkip();
  if (native.skipped) return "native addon unavailable: no native path row";
  let ping: string;
  try {
    ping = prebuiltPath("linux-x64", "moeswarm-native-ping");
  } catch {
    return "moeswarm-native-ping is not built (a linux-x64 native build makes it): no native path row";
  }
  const spec: SliceSpec = { type: GgmlType.Q8_0, nEmbd: o.embd, nFf: 256, nExpert: 16, layer: 0 };
  const dir = await mkdtemp(join(tmpdir(), "moeswarm-bench-native-"));
  let compute: ExpertCompute | undefined;
  let server: NativeServer | undefined;
  try {
    await writeFile(join(dir, "cert.pem"), o.tls.cert);
    await writeFile(join(dir, "key.pem"), o.tls.key);
    const path = join(dir, "slice.gguf");
    await writeExpertSlice(path, spec);
    compute = await loadExpertCompute(path, { backend: "native", threads: THREADS });
    // the bench owns both ends, so every hello is admitted (a worker checks the hub's ticket here)
    server = await serveNative({ host: "127.0.0.1", ...o.tls, id: "native-bench", admit: () => {} });
    const slice = nativeSliceOf(compute);
    if (!slice || server.setRoutes([{ model: o.model, layer: 0, slice }]).length !== 1) {
      throw new Error("the native listener did not take the bench's slice");
    }
  } catch (error) {
    server?.close();
    await compute?.close();
    await rm(dir, { recursive: true, force: true });
    throw error;
  }
  const args = (n: number, to: { addr: string; fp: string } | undefined) =>
    [
      ...(to === undefined
        ? [
            ["--addr", `127.0.0.1:${server!.port}`],
            ["--fp", server!.fingerprint],
            ["--backbone", "bench"],
            ["--ticket", "bench"],
          ]
        : [
            ["--addr", to.addr],
            ["--fp", to.fp],
            ["--echo", "1"],
          ]),
      ["--model", o.model],
      ["--layer", "0"],
      ["--n", String(n)],
      ["--embd", String(o.embd)],
      ["--k", String(o.k)],
      ["--experts", String(spec.nExpert)],
      ["--iters", String(iters(n))],
      ["--warmup", String(warmup(n))],
    ].flat();
  const trips = async (n: number, to?: Echo) => {
    const { stdout } = await run(ping, args(n, to), { maxBuffer: 16 * 1024 * 1024 });
    return JSON.parse(stdout) as { rtUs: number[]; workerMs: number[] };
  };
  const echoTrips = async (n: number, holdUs: number) => {
    const echo = await startEcho(ping, dir, holdUs);
    try {
      return echoSample((await trips(n, echo)).rtUs, holdUs);
    } finally {
      echo.child.kill();
    }
  };
  return {
    async measure(n) {
      const out = await trips(n);
      const sample = nativeSample(out.rtUs, out.workerMs);
      return {
        native: sample,
        echo: await echoTrips(n, 0),
        held: await echoTrips(n, sample.computeP50),
      };
    },
    async close() {
      server!.close();
      await compute!.close();
      await rm(dir, { recursive: true, force: true });
    },
  };
}
