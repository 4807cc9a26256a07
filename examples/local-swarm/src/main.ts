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
  readLogits,
  runLogitsHarness,
  serveBackboneBridge,
} from "@moeswarm/backbone";
import { cosine, tuneHeapForFrames } from "@moeswarm/core";
import type { WorkerRegistration } from "@moeswarm/dispatch";
import { createHub, createLoopbackCertificates, mintToken } from "@moeswarm/hub";
import { ensureSyntheticModel, findExpertTensors, readGguf } from "@moeswarm/shard";
import { formatBytes } from "@moeswarm/worker";
import { Agent, request } from "undici";
import { type DemoOptions, parseDemoOptions } from "./options.js";
import { createProgress } from "./progress.js";
import { printReport } from "./report.js";
import { crossBackendVerdict, verdictLines } from "./verdict.js";
import { spawnWorkers, stopWorkers, type WorkerView } from "./workers.js";

// caches live in this example's own folder: it runs the same copied out of the repository
const here = join(import.meta.dirname, "..");
const out = (line = "") => process.stdout.write(`${line}\n`);

interface PlacementBody {
  model: string;
  version: number;
  registrations: WorkerRegistration[];
  missing: Array<{ layer: number; experts: string; count: number }>;
}

/** The fewest distinct workers holding any expert of any layer the placement covers (0: a gap). */
function minOwners(body: PlacementBody): number {
  if (body.missing.length > 0) return 0;
  const owners = new Map<string, Set<string>>();
  for (const r of body.registrations) {
    for (const layer of r.layers) {
      for (const e of r.experts) {
        const key = `${layer}:${e}`;
        const set = owners.get(key) ?? new Set<string>();
        set.add(r.id);
        owners.set(key, set);
      }
    }
  }
  let least = Number.POSITIVE_INFINITY;
  for (const set of owners.values()) least = Math.min(least, set.size);
  return owners.size === 0 ? 0 : least;
}

async function waitForCoverage(
  hubUrl: string,
  model: string,
  dispatcher: Agent,
  workers: readonly WorkerView[],
  replicas: number,
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
    if (body.registrations.length > 0 && minOwners(body) >= replicas) return body;
  }
}

function tokPerSecond(r: LogitsHarnessResult): number {
  return r.tokens.length / (r.decodeMs / 1000);
}

/** What every step shares: the options, the abort signal, a scratch dir, and what to close at the end. */
interface Demo {
  readonly options: DemoOptions;
  readonly signal: AbortSignal;
  readonly tmp: string;
  readonly cleanup: Array<() => Promise<unknown> | unknown>;
}

interface DemoModel {
  readonly path: string;
  readonly id: string;
  readonly expertBytes: number;
}

// 1. the model: synthetic, deterministic, cached
async function prepareModel(demo: Demo): Promise<DemoModel> {
  const { options, signal } = demo;
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
  const id = `${options.arch}-${options.preset}`;
  out(
    `model     ${id}: ${nLayer} layers x ${nExpert} experts (top-${nUsed}), ${formatBytes(model.size)}, ` +
      `${formatBytes(expertBytes)} of routed experts ${model.created ? "(generated)" : "(cached)"}`,
  );
  return { path: model.path, id, expertBytes };
}

interface DemoHub {
  readonly url: string;
  readonly secret: string;
  readonly ca: string;
  readonly caFile: string;
  readonly dispatcher: Agent;
}

// 2. the hub: real TLS on loopback (wss relay, https downloads) as a self-hosted hub serves it,
// with a throwaway CA the workers and the backbone trust; its relay on the same port
async function startHub(demo: Demo, model: DemoModel): Promise<DemoHub> {
  const certs = await createLoopbackCertificates({
    hosts: ["localhost", "127.0.0.1"],
    days: 1,
    signal: demo.signal,
  });
  const caFile = join(demo.tmp, "ca.pem");
  writeFileSync(caFile, certs.ca);
  const secret = randomBytes(32).toString("hex");
  const hub = createHub({
    secret,
    models: [{ id: model.id, path: model.path }],
    tls: { cert: certs.cert, key: certs.key },
    manifestDir: join(demo.options.cacheDir, "manifests"),
    replicas: demo.options.replicas,
  });
  demo.cleanup.push(() => hub.close());
  const listener = await hub.listen(0, "127.0.0.1");
  out(`hub       ${listener.url} (relay ${listener.relayUrl}, dashboard ${listener.url}/)`);
  const dispatcher = new Agent({ connect: { ca: certs.ca } });
  demo.cleanup.push(() => dispatcher.close());
  return { url: listener.url, secret, ca: certs.ca, caFile, dispatcher };
}

// 3. the workers: separate processes, nothing configured but the hub, a token and a capacity.
// Enough for the hub's replicas with 15% to spare, as machines offer what they have rather than
// exact shares: a worker takes the most valuable rectangle of layers x experts that fits, then
// keeps claiming while it has room, so the strips large rectangles leave are covered too.
async function startWorkers(demo: Demo, model: DemoModel, hub: DemoHub): Promise<WorkerView[]> {
  const { options } = demo;
  const honestIds = Array.from({ length: options.workers }, (_, i) => `worker-${i}`);
  const copies = Math.min(options.replicas, options.workers + (options.liar ? 1 : 0));
  const share = (c: number) => Math.ceil(Math.min(1, c) * model.expertBytes * 1.15);
  // Beside a liar: it takes one whole copy first, then the honest workers share the other copies
  // (with more slack: slices come in whole rectangles), so every part it answers has an honest twin.
  const honestCopies = Math.max(1, copies - (options.liar ? 1 : 0));
  const honestCapacity = share((honestCopies / options.workers) * (options.liar ? 1.3 : 1));
  out(
    `workers   ${options.workers} processes${options.liar ? " + 1 liar (outputs x1.05)" : ""}, ` +
      `${formatBytes(honestCapacity)} of capacity each, ${copies} cop${copies === 1 ? "y" : "ies"} of each expert`,
  );
  const progress = createProgress(process.stdout);
  const workers: WorkerView[] = [];
  demo.cleanup.push(() => stopWorkers(workers));
  const start = (ids: string[], capacityBytes: number, liar: boolean) => {
    const cacheDirs = ids.map((id) =>
      options.workerCacheDir ? join(options.workerCacheDir, model.id, id) : join(demo.tmp, id),
    );
    for (const d of cacheDirs) mkdirSync(d, { recursive: true });
    const tokens = ids.map((id) => mintToken({ role: "worker", id, ttlS: 3600 }, hub.secret));
    const common = { hubUrl: hub.url, model: model.id, caFile: hub.caFile, threads: options.threads };
    const views = spawnWorkers({
      ...common,
      count: ids.length,
      ids,
      tokens,
      capacityBytes: ids.map(() => capacityBytes),
      cacheDirs,
      liar,
      onEvent: progress.onEvent,
      backend: options.backend,
      workerNode: options.workerNode,
      native: options.native,
    });
    workers.push(...views);
  };
  const timeoutMs = options.coverTimeoutS * 1000;
  const cover = (owners: number) =>
    waitForCoverage(hub.url, model.id, hub.dispatcher, workers, owners, timeoutMs, demo.signal);
  if (options.liar) {
    start(["liar"], share(1), true);
    await cover(1);
  }
  start(honestIds, honestCapacity, false);
  const placement = await cover(copies);
  progress.done();
  out(
    `swarm     every expert of every layer has ${copies} owner${copies === 1 ? "" : "s"} (placement version ${placement.version})`,
  );
  return workers;
}

// 4. the backbone: the bridge the plugin talks to, linked to the hub (relay connection, live
// placement, routing statistics and receipts), with the model's own experts as last resort
async function startBridge(demo: Demo, model: DemoModel, hub: DemoHub) {
  const fallback = await createLocalFallback(model.path, { threads: demo.options.threads });
  demo.cleanup.push(() => fallback.close());
  const bridge = await serveBackboneBridge({
    socket: join(demo.tmp, "bridge.sock"),
    hub: {
      url: hub.url,
      token: mintToken({ role: "backbone", id: "demo-backbone", ttlS: 3600 }, hub.secret),
      model: model.id,
      ca: hub.ca,
    },
    fallback: fallback.compute,
    trust: demo.options.trust,
    native: demo.options.native,
    signal: demo.signal,
  });
  demo.cleanup.push(() => bridge.close());
  return bridge;
}

type Bridge = Awaited<ReturnType<typeof startBridge>>;

// 5. llama.cpp, twice: plain, then with the MoE layers in the swarm; the verdict is the exit code
async function decodeAndCompare(demo: Demo, model: DemoModel, bridge: Bridge, workers: WorkerView[]) {
  const { options, tmp, signal } = demo;
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
    plugin: { bridge: bridge.address, layers: options.remoteLayers, model: model.id },
  });
  if (!swarm.ok) throw new Error(`llama.cpp with the swarm failed:\n${swarm.stderr}`);

  // the backbone's receipts credit the workers on the hub's dashboard
  await bridge.hub?.reportStats();

  const identical = plain.tokens.filter((t, i) => swarm.tokens[i] === t).length;
  const sameLength = plain.tokens.length === swarm.tokens.length;
  const logitsIdentical = readFileSync(join(tmp, "plain.bin")).equals(readFileSync(join(tmp, "swarm.bin")));
  // other kernels (the static executable, another ISA, a GPU) sum in another order: every token,
  // or a first difference that is a near-tie of the local run (verdict.ts), and the logits as
  // close as the worst row's cosine says
  const crossBackend = options.backend !== "llama-cpu";
  const rows = crossBackend
    ? [
        await readLogits(join(tmp, "plain.bin"), plain.nVocab),
        await readLogits(join(tmp, "swarm.bin"), plain.nVocab),
      ]
    : undefined;
  const verdict = rows ? crossBackendVerdict(plain.tokens, swarm.tokens, rows[0]!, rows[1]!) : undefined;
  printReport(out, {
    prompt: options.prompt,
    plain,
    swarm,
    identical,
    logitsIdentical,
    tokPerSecond: { plain: tokPerSecond(plain), swarm: tokPerSecond(swarm) },
    bridge: bridge.metrics(),
    workers,
    trust: options.trust,
    nearTie: verdict?.kind === "near-tie",
  });
  if (rows && verdict) {
    const cos = rows[0]!.map((row, i) => (rows[1]![i] ? cosine(row, rows[1]![i]!) : 0));
    out(
      `logits    min cosine per step vs the local run: ${Math.min(...cos).toFixed(8)} (${cos.length} steps)`,
    );
    for (const line of verdictLines(verdict)) out(line);
    return verdict.kind === "mismatch" ? 1 : 0;
  }
  // every token, and (same CPU, llama.cpp's own kernels in the workers) every logit bit
  return identical === plain.tokens.length && sameLength && logitsIdentical ? 0 : 1;
}

async function run(options: DemoOptions, signal: AbortSignal): Promise<number> {
  const tmp = mkdtempSync(join(tmpdir(), "moeswarm-demo-"));
  const demo: Demo = { options, signal, tmp, cleanup: [() => rmSync(tmp, { recursive: true, force: true })] };
  try {
    const model = await prepareModel(demo);
    const hub = await startHub(demo, model);
    const workers = await startWorkers(demo, model, hub);
    const bridge = await startBridge(demo, model, hub);
    return await decodeAndCompare(demo, model, bridge, workers);
  } finally {
    for (const step of demo.cleanup.reverse()) {
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
      { cacheDir: join(here, ".cache", "models"), workerCacheDir: join(here, ".cache", "demo-workers") },
    );
  } catch (error) {
    process.stderr.write(`demo: ${(error as Error).message} (pnpm demo -- --help)\n`);
    process.exitCode = 2;
    return undefined;
  }
}

const options = parseOrExit();
if (options) {
  // this process holds the hub's relay and the bridge: frames at a high rate (core frame-heap.ts)
  tuneHeapForFrames();
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
