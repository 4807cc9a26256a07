// The native data plane's end-to-end set-up, shared by native-e2e (one worker) and
// native-e2e-replica (two whole copies): a hub on loopback TLS, real `moeswarm-worker
// --listen-native` processes that claim the whole model, the bridge's hub options, and a decode
// through llama.cpp with the plugin checked against plain llama.cpp (tokens and logits' bytes).
import { type ChildProcess, execFileSync, spawn } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { createHub, type Hub, mintToken } from "@moeswarm/hub";
import { findExpertTensors, readGguf } from "@moeswarm/shard";
import { workerCliPath } from "@moeswarm/worker";
import { expect } from "vitest";
import {
  type BackboneBridge,
  type BackboneBridgeOptions,
  type LogitsHarnessResult,
  runLogitsHarness,
} from "../src/index.js";
import { firstByteDiff, loopbackCerts, modelInfo, syntheticModel } from "./helpers.js";

/** The plugin's and the worker's TLS load libssl.so.3 at run time: without it there is no native plane. */
export function opensslMissing(what: string): string | undefined {
  try {
    if (/libssl\.so\.3\b/.test(execFileSync("ldconfig", ["-p"], { encoding: "utf8" }))) return undefined;
  } catch {
    // no ldconfig: try anyway (the worker and the plugin say what they miss)
    return undefined;
  }
  const why = "no libssl.so.3 on this machine (the native plane needs OpenSSL 3: apt-get install libssl3)";
  console.warn(`skipping ${what}: ${why}`);
  return why;
}

export interface NativeSwarm {
  hub: Hub;
  modelPath: string;
  layers: number[];
  nExpert: number;
  /** Experts per token. */
  k: number;
  /** The live worker processes by id (a test that kills one deletes it first). */
  workers: Map<string, ChildProcess>;
  /** The workers' latest output, for failure messages. */
  log(): string;
  /** Aborted when a worker still in `workers` exits. */
  gone: AbortSignal;
  /** The bridge's `hub` option for backbone `id`. */
  bridgeHub(id: string): NonNullable<BackboneBridgeOptions["hub"]>;
  close(): Promise<void>;
}

/**
 * The hub (`replicas` copies wanted of the small synthetic model `modelId`) and one worker per id,
 * each with room for every expert (so each claims the model whole), llama-cpu compute, a native
 * listener on loopback and a direct-served report every second.
 */
export async function startNativeSwarm(
  dir: string,
  o: { secret: string; modelId: string; ids: readonly string[]; replicas: number },
): Promise<NativeSwarm> {
  const modelPath = await syntheticModel("small");
  const info = await modelInfo(modelPath);
  const moe = findExpertTensors(await readGguf(modelPath));
  const expertBytes = moe.layers.reduce((s, l) => s + Number(l.bytesPerExpert) * l.nExpert, 0);
  const certs = await loopbackCerts();
  const caFile = join(dir, "ca.pem");
  writeFileSync(caFile, certs.ca);
  const hub = createHub({
    secret: o.secret,
    models: [{ id: o.modelId, path: modelPath }],
    tls: { cert: certs.cert, key: certs.key },
    manifestDir: join(dir, "manifests"),
    replicas: o.replicas,
  });
  const url = (await hub.listen(0, "127.0.0.1")).url;
  const workers = new Map<string, ChildProcess>();
  const gone = new AbortController();
  let log = "";
  for (const id of o.ids) {
    const cacheDir = join(dir, id);
    mkdirSync(cacheDir, { recursive: true });
    const child = spawn(
      process.execPath,
      [
        workerCliPath(),
        ...["--hub", url, "--token", mintToken({ role: "worker", id, ttlS: 3600 }, o.secret)],
        ...["--id", id, "--model", o.modelId, "--capacity", String(Math.ceil(expertBytes * 1.15))],
        ...["--cache-dir", cacheDir, "--ca", caFile, "--backend", "llama-cpu", "--threads", "1"],
        ...["--poll", "0.5", "--listen-native", "127.0.0.1:0", "--direct-report", "1", "--json"],
      ],
      { stdio: ["ignore", "pipe", "pipe"] },
    );
    const onData = (d: Buffer) => {
      log = `${log}[${id}] ${d.toString()}`.slice(-12_000);
    };
    child.stdout!.on("data", onData);
    child.stderr!.on("data", onData);
    child.once("exit", (code, sig) => {
      if (workers.get(id) === child) gone.abort(new Error(`worker ${id} exited (${code ?? sig})`));
    });
    workers.set(id, child);
  }
  return {
    hub,
    modelPath,
    layers: info.layers,
    nExpert: moe.layers[0]!.nExpert,
    k: info.nExpertUsed,
    workers,
    log: () => log,
    gone: gone.signal,
    bridgeHub: (id) => ({
      url,
      token: mintToken({ role: "backbone", id, ttlS: 3600 }, o.secret),
      model: o.modelId,
      ca: certs.ca,
      statsIntervalMs: 0,
      pollWaitS: 10,
    }),
    async close() {
      for (const w of workers.values()) w.kill("SIGKILL");
      await hub.close();
    },
  };
}

/**
 * Decodes `prompt` plainly and through `bridge` (every MoE layer remote), `during` running while
 * the swarm decodes, and checks that the tokens and the logits' bytes are the same.
 */
export function decoderAgainstPlain(dir: string, bridge: BackboneBridge, modelPath: string, prompt: string) {
  const common = { modelPath, prompt, threads: 1, noMmap: true };
  return async (
    name: string,
    nPredict: number,
    during?: () => Promise<void>,
  ): Promise<LogitsHarnessResult> => {
    const plainPath = join(dir, `${name}-plain.bin`);
    const swarmPath = join(dir, `${name}-swarm.bin`);
    const plain = await runLogitsHarness({ ...common, nPredict, logitsPath: plainPath });
    expect(plain.ok, plain.stderr).toBe(true);
    const running = runLogitsHarness({
      ...common,
      nPredict,
      logitsPath: swarmPath,
      plugin: { bridge: bridge.address, layers: "all", model: bridge.hub!.model },
    });
    await during?.();
    const swarm = await running;
    expect(swarm.ok, swarm.stderr).toBe(true);
    expect(swarm.tokens).toEqual(plain.tokens);
    expect(firstByteDiff(readFileSync(swarmPath), readFileSync(plainPath))).toBe(-1);
    return swarm;
  };
}
