// The decode benchmark's third swarm: the native data plane as the product runs it. A hub on
// loopback TLS, two real `moeswarm-worker --listen-native 127.0.0.1:0` processes (llama-cpu
// compute, one thread each) and the bridge with its `hub` option under trust "own": the bridge
// pushes the plugin its table and the plugin sends every remote layer's split straight to the
// workers over TLS (docs/architecture.md §4, protocol.md §10.9-10.10).
//
// The workers hold the same halves as the bridge row's (experts 0:n/2 and n/2:n of every layer), so
// the table has ranged entries and a split goes to both workers at once. Left to the demand, a
// worker with room for half the model claims whole layers (the market prefers them), so each worker
// starts with its half in its slice cache (cacheSlice): a restarted worker claims its cached slice first (it is
// as large as the demand's best choice), verifies it against the hub's manifest and serves it.
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { randomBytes } from "node:crypto";
import { writeFile } from "node:fs/promises";
import { join } from "node:path";
import { createInterface } from "node:readline";
import { type BackboneBridge, type HubPlacement, serveBackboneBridge } from "@moeswarm/backbone";
import { createHub, createLoopbackCertificates, mintToken } from "@moeswarm/hub";
import { cacheSlice, type WorkerEvent, workerCliPath } from "@moeswarm/worker";
import { llamaCpuAddonPath } from "@moeswarm/worker-native";

/** One worker's half: a slice file (the bridge row's) and what it holds. */
export interface NativeHalf {
  path: string;
  /** Consecutive MoE layers and experts, half-open. */
  layers: { start: number; end: number };
  experts: { start: number; end: number };
  /** Its experts' weight bytes: the worker's `--capacity` (no room for anything else). */
  bytes: number;
}

export interface NativeSwarm {
  bridge: BackboneBridge;
  /** The hub's model id (the plugin's `model`). */
  model: string;
  /** Who holds what, and whether every layer is split between the workers (ranged entries). */
  placement: string;
  ranged: boolean;
  close(): Promise<void>;
}

const MODEL_ID = "bench-decode";
const READY_TIMEOUT_MS = 120_000;

/** Why the native plane cannot run on this machine (checked before anything starts), or undefined. */
export function nativePlaneMissing(): string | undefined {
  if (llamaCpuAddonPath() === undefined) {
    return "worker-native's llama-cpu addon is not built (MOESWARM_NATIVE_TARGETS=linux-x64 pnpm --filter @moeswarm/worker-native build)";
  }
  try {
    if (!/libssl\.so\.3\b/.test(execFileSync("ldconfig", ["-p"], { encoding: "utf8" }))) {
      return "no libssl.so.3 on this machine (the plugin's and the workers' TLS load OpenSSL 3)";
    }
  } catch {
    // no ldconfig: the workers say so themselves ("native-unavailable") if OpenSSL is missing
  }
  return undefined;
}

interface WorkerProcess {
  id: string;
  child: ChildProcess;
  /** Its last lines of output, for a failure message. */
  log: string[];
}

function spawnWorker(
  id: string,
  half: NativeHalf,
  o: { url: string; secret: string; caFile: string; cacheDir: string; onEvent: (e: WorkerEvent) => void },
): WorkerProcess {
  const child = spawn(
    process.execPath,
    [
      workerCliPath(),
      ...["--hub", o.url, "--token", mintToken({ role: "worker", id, ttlS: 3600 }, o.secret)],
      ...["--id", id, "--model", MODEL_ID, "--capacity", String(half.bytes), "--cache-dir", o.cacheDir],
      ...["--ca", o.caFile, "--backend", "llama-cpu", "--threads", "1", "--poll", "0.5"],
      ...["--listen-native", "127.0.0.1:0", "--json"],
    ],
    { stdio: ["ignore", "pipe", "pipe"] },
  );
  const w: WorkerProcess = { id, child, log: [] };
  const keep = (line: string) => {
    w.log.push(`[${id}] ${line}`);
    if (w.log.length > 30) w.log.shift();
  };
  createInterface({ input: child.stdout! }).on("line", (line) => {
    keep(line);
    try {
      o.onEvent(JSON.parse(line) as WorkerEvent);
    } catch {
      // not an event line
    }
  });
  createInterface({ input: child.stderr! }).on("line", keep);
  return w;
}

/** SIGTERM (the worker drains and deregisters), SIGKILL after 10 s. */
function stopWorker(w: WorkerProcess): Promise<void> {
  if (w.child.exitCode !== null || w.child.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    const timer = setTimeout(() => w.child.kill("SIGKILL"), 10_000);
    w.child.once("exit", () => {
      clearTimeout(timer);
      resolve();
    });
    w.child.kill("SIGTERM");
  });
}

/** Who holds each layer's experts: "w0 0:32 + w1 32:64 of layers 0-7"-like, and whether it is ranged. */
export function describePlacement(p: HubPlacement): { text: string; ranged: boolean } {
  let ranged = true;
  const shapes = new Map<string, number[]>();
  for (const layer of p.layers) {
    const runs: string[] = [];
    let start = 0;
    for (let e = 1; e <= p.nExpert; e++) {
      const prev = p.placement.owners(layer, e - 1).join("+") || "nobody";
      if (e < p.nExpert && (p.placement.owners(layer, e).join("+") || "nobody") === prev) continue;
      runs.push(`${prev} ${start}:${e}`);
      start = e;
    }
    const owners = new Set(runs.map((r) => r.split(" ")[0]));
    // ranged: two runs or more, each of one worker of its own (not shared, not a gap)
    const shared = [...owners].some((o) => o === "nobody" || o!.includes("+"));
    if (runs.length < 2 || owners.size !== runs.length || shared) {
      ranged = false;
    }
    const key = runs.join(" + ");
    shapes.set(key, [...(shapes.get(key) ?? []), layer]);
  }
  const text = [...shapes].map(([k, ls]) => `${k} of layer${ls.length > 1 ? "s" : ""} ${ls.join(",")}`);
  return { text: text.join("; "), ranged };
}

/** What the bridge saw: the table it pushed and the splits that came its way instead. */
export function bridgeNote(bridge: BackboneBridge): string {
  const m = bridge.metrics();
  const t = m.native?.table;
  return `the bridge's table: ${t?.layers.length ?? 0} layers, workers ${t?.workers.join(", ") || "none"}; ${m.requests} requests took the bridge path`;
}

/**
 * The hub, one worker per half and the bridge, ready: every layer in the native table. A string
 * when the native plane turns out unavailable here (a worker reports no native listener).
 */
export async function startNativeSwarm(o: {
  dir: string;
  modelPath: string;
  halves: readonly NativeHalf[];
  layers: readonly number[];
}): Promise<NativeSwarm | string> {
  const certs = await createLoopbackCertificates({ hosts: ["127.0.0.1", "localhost"], days: 1 });
  const caFile = join(o.dir, "ca.pem");
  await writeFile(caFile, certs.ca);
  const secret = randomBytes(32).toString("hex");
  const hub = createHub({
    secret,
    models: [{ id: MODEL_ID, path: o.modelPath }],
    tls: { cert: certs.cert, key: certs.key },
    manifestDir: join(o.dir, "manifests"),
    replicas: 1,
  });
  const workers: WorkerProcess[] = [];
  let bridge: BackboneBridge | undefined;
  const close = async () => {
    await bridge?.close();
    await Promise.all(workers.map(stopWorker));
    await hub.close();
  };
  try {
    const url = (await hub.listen(0, "127.0.0.1")).url;
    const gone = new AbortController();
    for (const [i, half] of o.halves.entries()) {
      const cacheDir = join(o.dir, `native-w${i}`);
      await cacheSlice(cacheDir, { model: MODEL_ID, ...half, file: half.path });
      const onEvent = (e: WorkerEvent) => {
        if (e.event === "native-unavailable")
          gone.abort(`worker w${i}: no native listener: ${e.code}: ${e.error}`);
      };
      const w = spawnWorker(`w${i}`, half, { url, secret, caFile, cacheDir, onEvent });
      w.child.once("exit", (code, signal) =>
        gone.abort(new Error(`worker w${i} exited (${code ?? signal})`)),
      );
      workers.push(w);
    }
    bridge = await serveBackboneBridge({
      socket: join(o.dir, "native-bridge.sock"),
      hub: {
        url,
        token: mintToken({ role: "backbone", id: "bench-decode-native", ttlS: 3600 }, secret),
        model: MODEL_ID,
        ca: certs.ca,
      },
      trust: "own",
    });
    const ready = await whenReady(bridge, workers, o.layers, gone.signal);
    if (typeof ready === "string") {
      await close();
      return ready;
    }
    const { text, ranged } = describePlacement(ready);
    return { bridge, model: MODEL_ID, placement: text, ranged, close };
  } catch (error) {
    await close();
    throw error;
  }
}

/**
 * Waits until the placement covers the model with every worker native and the bridge's table has
 * every layer; the placement then, a string if a worker has no native listener.
 */
async function whenReady(
  bridge: BackboneBridge,
  workers: readonly WorkerProcess[],
  layers: readonly number[],
  gone: AbortSignal,
): Promise<HubPlacement | string> {
  const signal = AbortSignal.any([gone, AbortSignal.timeout(READY_TIMEOUT_MS)]);
  const link = bridge.hub!;
  try {
    const placement = await link.waitForPlacement(
      (p) => p.missing.length === 0 && workers.every((w) => p.native.has(w.id)),
      { signal },
    );
    const want = [...layers].sort((a, b) => a - b).join();
    while (bridge.metrics().native?.table.layers.join() !== want) {
      signal.throwIfAborted();
      await new Promise((r) => setTimeout(r, 100));
    }
    return placement;
  } catch (error) {
    if (typeof gone.reason === "string") return gone.reason;
    const p = link.current();
    const table = bridge.metrics().native;
    throw new Error(
      `the native swarm was not ready: missing ${JSON.stringify(p.missing)}, native ${JSON.stringify([...p.native.keys()])}, ` +
        `table ${JSON.stringify(table?.table.layers)} (${table?.off ?? "on"}): ${(error as Error).message}\n` +
        workers.flatMap((w) => w.log).join("\n"),
      { cause: error },
    );
  }
}
