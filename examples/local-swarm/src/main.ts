// The main job (`pnpm demo`): a whole swarm on this machine, built only from public exports.
//
//   hub (https + wss on loopback, a throwaway CA) <- workers (separate processes: claim, download,
//   verify, load, register by themselves) <- relay <- bridge <- libggml-moeswarm <- llama.cpp
//
// llama.cpp decodes the prompt twice, plain and with its MoE layers in the swarm; the verdict is
// whether every token is the same (the logits are compared byte for byte too).
import { randomBytes } from "node:crypto";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  createLocalFallback,
  type LogitsHarnessResult,
  runLogitsHarness,
  serveBackboneBridge,
} from "@moeswarm/backbone";
import type { WorkerRegistration } from "@moeswarm/dispatch";
import { createHub, createLoopbackCertificates, mintToken } from "@moeswarm/hub";
import { ensureSyntheticModel, findExpertTensors, readGguf } from "@moeswarm/shard";
import { formatBytes } from "@moeswarm/worker";
import { Agent, request } from "undici";
import { type DemoOptions, parseDemoOptions } from "./options.js";
import { createProgress } from "./progress.js";
import { printReport } from "./report.js";
import { spawnWorkers, stopWorkers, type WorkerView } from "./workers.js";

const root = join(import.meta.dirname, "..", "..", "..");
const out = (line = "") => process.stdout.write(`${line}\n`);

interface PlacementBody {
  model: string;
  version: number;
  registrations: WorkerRegistration[];
  missing: Array<{ layer: number; experts: string; count: number }>;
}

async function waitForCoverage(
  hubUrl: string,
  model: string,
  dispatcher: Agent,
  workers: readonly WorkerView[],
  timeoutMs: number,
  signal: AbortSignal,
): Promise<PlacementBody> {
  const deadline = Date.now() + timeoutMs;
  let since = 0;
  for (;;) {
    signal.throwIfAborted();
    const dead = workers.find((w) => w.exitCode !== undefined);
    if (dead) {
      throw new Error(
        `${dead.id} exited (code ${dead.exitCode}) before the swarm was complete:\n  ${dead.stderr.join("\n  ")}`,
      );
    }
    if (Date.now() > deadline)
      throw new Error(`the workers did not cover the model within ${timeoutMs / 1000} s`);
    // long-poll: the hub answers as soon as a registration changes the placement
    const res = await request(`${hubUrl}/api/models/${model}/placement?since=${since}&wait=1`, {
      dispatcher,
      signal,
    });
    if (res.statusCode === 304) {
      await res.body.dump();
      continue;
    }
    const body = (await res.body.json()) as PlacementBody;
    since = body.version;
    if (body.registrations.length > 0 && body.missing.length === 0) return body;
  }
}

function tokPerSecond(r: LogitsHarnessResult): number {
  return r.tokens.length / (r.decodeMs / 1000);
}

async function run(options: DemoOptions, signal: AbortSignal): Promise<number> {
  const cleanup: Array<() => Promise<unknown> | unknown> = [];
  const tmp = mkdtempSync(join(tmpdir(), "moeswarm-demo-"));
  cleanup.push(() => rmSync(tmp, { recursive: true, force: true }));
  try {
    // 1. the model: synthetic, deterministic, cached
    const model = await ensureSyntheticModel(options.preset, {
      cacheDir: options.cacheDir,
      arch: options.arch,
      signal,
    });
    const moe = findExpertTensors(await readGguf(model.path, { signal }));
    const nLayer = moe.blockCount ?? moe.layers.length;
    const nExpert = moe.expertCount ?? moe.layers[0]?.nExpert ?? 0;
    const nUsed = moe.expertUsedCount ?? 0;
    const expertBytes = moe.layers.reduce((sum, l) => sum + Number(l.bytesPerExpert) * l.nExpert, 0);
    const modelId = `${options.arch}-${options.preset}`;
    out(
      `model     ${modelId}: ${nLayer} layers x ${nExpert} experts (top-${nUsed}), ${formatBytes(model.size)}, ` +
        `${formatBytes(expertBytes)} of routed experts ${model.created ? "(generated)" : "(cached)"}`,
    );

    // 2. the hub: real TLS on loopback (wss relay, https downloads) as a self-hosted hub serves
    // it, with a throwaway CA the workers and the backbone trust; its relay on the same port
    const certs = await createLoopbackCertificates({ hosts: ["localhost", "127.0.0.1"], days: 1, signal });
    const caFile = join(tmp, "ca.pem");
    writeFileSync(caFile, certs.ca);
    const secret = randomBytes(32).toString("hex");
    const hub = createHub({
      secret,
      models: [{ id: modelId, path: model.path }],
      tls: { cert: certs.cert, key: certs.key },
      manifestDir: join(options.cacheDir, "manifests"),
    });
    cleanup.push(() => hub.close());
    const listener = await hub.listen(0, "127.0.0.1");
    out(`hub       ${listener.url} (relay ${listener.relayUrl}, dashboard ${listener.url}/)`);
    const dispatcher = new Agent({ connect: { ca: certs.ca } });
    cleanup.push(() => dispatcher.close());

    // 3. the workers: separate processes, nothing configured but the hub, a token and a capacity
    // A fair share each with 15% to spare, as machines offer what they have rather than exact
    // shares: a worker takes the most valuable rectangle of layers x experts that fits, then keeps
    // claiming while it has room, so the strips large rectangles leave are covered too.
    const capacityBytes = Math.ceil((expertBytes / options.workers) * 1.15);
    const cacheDirs = Array.from({ length: options.workers }, (_, i) =>
      options.workerCacheDir
        ? join(options.workerCacheDir, modelId, `worker-${i}`)
        : join(tmp, `worker-${i}`),
    );
    for (const d of cacheDirs) mkdirSync(d, { recursive: true });
    out(`workers   ${options.workers} processes, ${formatBytes(capacityBytes)} of capacity each`);
    const progress = createProgress(process.stdout);
    const workers = spawnWorkers({
      count: options.workers,
      hubUrl: listener.url,
      model: modelId,
      tokens: Array.from({ length: options.workers }, (_, i) =>
        mintToken({ role: "worker", id: `worker-${i}`, ttlS: 3600 }, secret),
      ),
      capacityBytes,
      caFile,
      cacheDirs,
      threads: options.threads,
      onEvent: progress.onEvent,
    });
    cleanup.push(() => stopWorkers(workers));
    const placementBody = await waitForCoverage(
      listener.url,
      modelId,
      dispatcher,
      workers,
      options.coverTimeoutS * 1000,
      signal,
    );
    progress.done();
    out(`swarm     every expert of every layer has an owner (placement version ${placementBody.version})`);

    // 4. the backbone: the bridge the plugin talks to, linked to the hub (relay connection, live
    // placement, routing statistics and receipts), with the model's own experts as last resort
    const fallback = await createLocalFallback(model.path, { threads: options.threads });
    cleanup.push(() => fallback.close());
    const bridge = await serveBackboneBridge({
      socket: join(tmp, "bridge.sock"),
      hub: {
        url: listener.url,
        token: mintToken({ role: "backbone", id: "demo-backbone", ttlS: 3600 }, secret),
        model: modelId,
        ca: certs.ca,
      },
      fallback: fallback.compute,
      trust: "own", // its own child processes, one owner per expert (until it places replicas)
      signal,
    });
    cleanup.push(() => bridge.close());

    // 5. llama.cpp, twice: plain, then with the MoE layers in the swarm
    const common = {
      modelPath: model.path,
      prompt: options.prompt,
      nPredict: options.tokens,
      threads: options.threads,
      noMmap: true,
      signal,
    };
    out(`decode    plain llama.cpp, ${options.tokens} tokens ...`);
    const plain = await runLogitsHarness({ ...common, logitsPath: join(tmp, "plain.bin") });
    if (!plain.ok) throw new Error(`plain llama.cpp failed:\n${plain.stderr}`);
    out(`decode    llama.cpp + libggml-moeswarm + swarm (layers ${options.remoteLayers}) ...`);
    const swarm = await runLogitsHarness({
      ...common,
      logitsPath: join(tmp, "swarm.bin"),
      plugin: { bridge: bridge.address, layers: options.remoteLayers, model: modelId },
    });
    if (!swarm.ok) throw new Error(`llama.cpp with the swarm failed:\n${swarm.stderr}`);

    // the backbone's receipts credit the workers on the hub's dashboard
    await bridge.hub?.reportStats();

    const identical = plain.tokens.filter((t, i) => swarm.tokens[i] === t).length;
    const sameLength = plain.tokens.length === swarm.tokens.length;
    const logitsIdentical = readFileSync(join(tmp, "plain.bin")).equals(readFileSync(join(tmp, "swarm.bin")));
    printReport(out, {
      prompt: options.prompt,
      plain,
      swarm,
      identical,
      logitsIdentical,
      tokPerSecond: { plain: tokPerSecond(plain), swarm: tokPerSecond(swarm) },
      bridge: bridge.metrics(),
      workers,
    });
    return identical === plain.tokens.length && sameLength ? 0 : 1;
  } finally {
    for (const step of cleanup.reverse()) {
      try {
        await step();
      } catch {
        // shutting down: keep closing the rest
      }
    }
  }
}

function parseOrExit(): DemoOptions | undefined {
  try {
    return parseDemoOptions(
      process.argv.slice(2).filter((a) => a !== "--"),
      { cacheDir: join(root, ".cache", "models"), workerCacheDir: join(root, ".cache", "demo-workers") },
    );
  } catch (error) {
    process.stderr.write(`demo: ${(error as Error).message} (pnpm demo -- --help)\n`);
    process.exitCode = 2;
    return undefined;
  }
}

const options = parseOrExit();
if (options) {
  const controller = new AbortController();
  const stop = () => {
    out("\ninterrupted: shutting the swarm down");
    controller.abort(new Error("interrupted"));
  };
  process.once("SIGINT", stop);
  process.once("SIGTERM", stop);
  try {
    process.exitCode = await run(options, controller.signal);
  } catch (error) {
    process.stderr.write(`demo failed: ${(error as Error).message}\n`);
    process.exitCode = controller.signal.aborted ? 130 : 1;
  }
}
