// `throughput`: aggregate tokens/s of llama-server (the pinned llama.cpp, built by
// packages/backbone/scripts/build-llama-server.mjs) serving C concurrent clients, plain against the
// same llama-server with every MoE layer sent through the plugin to moeswarm's bridge, whose hub
// and 2 llama-cpu workers sit behind a userspace delay proxy (tools/delay-proxy.mjs) adding RTT.
// Per cell: plain tok/s, swarm tok/s, their ratio, dispatch frames per remote layer per llama_decode
// (1.00: the C sequences share each round trip), bytes on the wire per generated token, and
// whether the swarm's texts equal plain's (temperature 0). MOESWARM_BENCH_SHORT=1: fewer cells and
// tokens. Flags as the dispatcher prints them (-kvu, --load-mode none), --parallel = C, one thread.
import { execFileSync } from "node:child_process";
import { mkdtemp, rm } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { createLocalFallback, pluginPath, serveBackboneBridge } from "@moeswarm/backbone";
import { createHub, mintToken } from "@moeswarm/hub";
import { connectRelay } from "@moeswarm/relay-client";
import { ensureSyntheticModel, findExpertTensors, readGguf, sliceExperts } from "@moeswarm/shard";
import { type LlamaServerProcess, startLlamaServer } from "@moeswarm/testkit/llama-server";
import { spawnLlamaExpertWorker, type WorkerProcessCompute } from "@moeswarm/worker-native";
import type { Benchmark, Row } from "../harness.js";

const ROOT = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "..");
const CACHE_DIR = join(ROOT, ".cache", "models");
const SHORT = process.env.MOESWARM_BENCH_SHORT === "1";
const N_PREDICT = SHORT ? 16 : 48;
const CONCURRENCY = [1, 4, 16];
const RTT_MS = [0, 0.5, 10, 30];
const SECRET = "bench-throughput-secret-0123456789ab";
const MODEL_ID = "bench-tp";

interface Run {
  tokS: number;
  texts: string[];
  decodes: number;
}

async function metric(server: LlamaServerProcess, name: string): Promise<number> {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  return Number(new RegExp(`^llamacpp:${name} (\\S+)$`, "m").exec(text)?.[1] ?? Number.NaN);
}

/** C clients at once, each one completion of N_PREDICT tokens at temperature 0. */
async function drive(server: LlamaServerProcess, c: number, bias: Array<[number, number]>): Promise<Run> {
  const d0 = await metric(server, "n_decode_total");
  const t0 = performance.now();
  const texts = await Promise.all(
    [...Array(c).keys()].map(async (i) => {
      const r = await fetch(`${server.url}/completion`, {
        method: "POST",
        body: JSON.stringify({
          prompt: `Client ${i} says`,
          n_predict: N_PREDICT,
          temperature: 0,
          ignore_eos: true,
          logit_bias: bias,
        }),
      });
      if (r.status !== 200) {
        const log = server
          .output()
          .split("\n")
          .filter((l) => /moeswarm|MOESWARM/.test(l));
        throw new Error(`llama-server answered ${r.status}: ${await r.text()}\n${log.slice(-5).join("\n")}`);
      }
      return ((await r.json()) as { content: string }).content;
    }),
  );
  const s = (performance.now() - t0) / 1000;
  return { tokS: (c * N_PREDICT) / s, texts, decodes: (await metric(server, "n_decode_total")) - d0 };
}

/** A worker process behind the hub's relay, answering the dispatches it is sent. */
function relayWorker(relayUrl: string, id: string, compute: WorkerProcessCompute) {
  return connectRelay(relayUrl, {
    role: "worker",
    id,
    token: mintToken({ role: "worker", id, ttlS: 3600 }, SECRET),
    reconnect: false,
    onDispatch: async (d) => ({
      y: await compute.run(
        { layer: d.layer, x: d.activations(), ids: d.ids, k: d.k, ...(d.w ? { w: d.w } : {}), mode: d.mode },
        { signal: d.signal },
      ),
    }),
  });
}

/** TEMPORARY until the synthesiser's tokens are valid UTF-8: those get logit_bias -100. */
async function invalidTokens(server: LlamaServerProcess): Promise<Array<[number, number]>> {
  const models = (await (await fetch(`${server.url}/v1/models`)).json()) as {
    data: Array<{ meta: { n_vocab: number } }>;
  };
  const n = models.data[0]!.meta.n_vocab;
  const bad: Array<[number, number]> = [];
  for (let t = 0; t < n; t += 64) {
    await Promise.all(
      [...Array(Math.min(64, n - t)).keys()].map(async (i) => {
        const r = await fetch(`${server.url}/detokenize`, {
          method: "POST",
          body: JSON.stringify({ tokens: [t + i] }),
        });
        if (r.status !== 200 || ((await r.json()) as { content: string }).content.includes("\uFFFD")) {
          bad.push([t + i, -100]);
        }
      }),
    );
  }
  return bad;
}

export const throughput: Benchmark = {
  name: "throughput",
  description:
    "llama-server, C concurrent clients x RTT to the hub: plain vs plugin + bridge + hub + 2 llama-cpu workers (small qwen3moe, all MoE layers remote)",
  async run() {
    const out = execFileSync(
      process.execPath,
      [join(ROOT, "packages/backbone/scripts/build-llama-server.mjs"), "--json"],
      {
        stdio: ["ignore", "pipe", "inherit"],
        encoding: "utf8",
      },
    );
    const bin = (JSON.parse(out.trim().split("\n").pop()!) as { bin: string }).bin;
    const { startDelayProxy } = (await import(join(ROOT, "tools/delay-proxy.mjs"))) as {
      startDelayProxy: (o: {
        target: string;
        rttMs: number;
      }) => Promise<{ url: string; close(): Promise<void> }>;
    };
    const model = await ensureSyntheticModel(SHORT ? "small" : "medium", { cacheDir: CACHE_DIR });
    const layout = findExpertTensors(await readGguf(model.path));
    const layers = layout.layers.map((l) => l.layer);
    const nExpert = layout.layers[0]!.nExpert;
    const dir = await mkdtemp(join(tmpdir(), "mswb-tp-"));
    const workers: WorkerProcessCompute[] = [];
    const closers: Array<() => Promise<unknown>> = [];
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    try {
      const hub = createHub({
        secret: SECRET,
        models: [{ id: MODEL_ID, path: model.path }],
        requireLeases: false,
        replicas: 1,
        trustReports: true,
      });
      closers.push(() => hub.close());
      const listener = await hub.listen(0);
      for (let w = 0; w < 2; w++) {
        const experts = [...Array(nExpert / 2).keys()].map((i) => i + (w * nExpert) / 2);
        const path = join(dir, `w${w}.gguf`);
        await using slice = await sliceExperts(model.path, { layers, experts });
        await slice.write(path);
        const worker = await spawnLlamaExpertWorker(path, { threads: 1 });
        workers.push(worker);
        const c = await relayWorker(listener.relayUrl, `w${w}`, worker);
        closers.push(() => c.close());
        c.register({ model: MODEL_ID, layers, experts });
      }
      const hubPort = new URL(listener.url).port;
      // the bridge's liveness deadline adapts down to 250 ms: on a loaded machine a worker can miss
      // it, and the fallback answers instead (counted in the table) rather than failing the request
      const fallback = await createLocalFallback(model.path, { threads: 1 });
      closers.push(() => fallback.close());
      for (const c of CONCURRENCY) {
        const common = [
          "-m",
          model.path,
          "-t",
          "1",
          "--parallel",
          String(c),
          "-c",
          String(c * 256),
          "--metrics",
          "-fit",
          "off",
          "-kvu",
        ];
        const plain = await startLlamaServer(bin, common);
        const bias = await invalidTokens(plain);
        // warm-up, and a second plain run: llama-server's batches depend on when requests arrive, and
        // llama.cpp's bits on its batches, so texts at C > 1 are compared with this repeat too
        const warm = await drive(plain, c, bias);
        const base = await drive(plain, c, bias);
        const repeatable = warm.texts.every((t, i) => t === base.texts[i]);
        await plain.close();
        for (const rtt of RTT_MS) {
          const proxy = await startDelayProxy({ target: `127.0.0.1:${hubPort}`, rttMs: rtt });
          const socket = join(dir, `b-${c}-${rtt}.sock`);
          const bridge = await serveBackboneBridge({
            socket,
            hub: {
              url: `http://${proxy.url}`,
              token: mintToken({ role: "backbone", id: `bb-${c}-${rtt}`, ttlS: 3600 }, SECRET),
              model: MODEL_ID,
              statsIntervalMs: 0,
            },
            trust: "own",
            fallback: fallback.compute,
          });
          await bridge.hub!.waitForPlacement((p) => p.missing.length === 0);
          const served = await startLlamaServer(
            bin,
            [
              ...common,
              "-ot",
              "blk\\.\\d+\\.ffn_(gate|up|down|gate_up)_exps\\..*=MOESWARM",
              "--load-mode",
              "none",
            ],
            {
              env: {
                GGML_BACKEND_PATH: pluginPath(),
                MOESWARM_BRIDGE: bridge.address,
                MOESWARM_MODEL: MODEL_ID,
              },
            },
          );
          try {
            await drive(served, c, bias); // warm-up
            const m0 = bridge.metrics();
            const run = await drive(served, c, bias);
            const m1 = bridge.metrics();
            const frames = m1.requests - m0.requests;
            const wire =
              m1.dispatch.bytesOut + m1.dispatch.bytesIn - (m0.dispatch.bytesOut + m0.dispatch.bytesIn);
            const same = run.texts.every((t, i) => t === base.texts[i]);
            rows.push({
              clients: c,
              rttMs: rtt,
              plainTokS: Number(base.tokS.toFixed(1)),
              swarmTokS: Number(run.tokS.toFixed(1)),
              ratio: Number((run.tokS / base.tokS).toFixed(3)),
              framesPerLayerStep: Number((frames / (layers.length * run.decodes)).toFixed(2)),
              wireBytesPerToken: Math.round(wire / (c * N_PREDICT)),
              fallbacks: m1.fallbacks - m0.fallbacks,
              identical: same ? "yes" : "NO",
              plainRepeatable: repeatable ? "yes" : "NO",
            });
            ratios[`swarm/plain C=${c} RTT=${rtt}ms`] = run.tokS / base.tokS;
          } finally {
            await served.close();
            await bridge.close();
            await proxy.close();
          }
        }
      }
      return {
        rows,
        ratios,
        notes: [
          `${SHORT ? "small" : "medium"} synthetic qwen3moe, ${layers.length} remote MoE layers, ${N_PREDICT} tokens per client, llama-server -t 1 -kvu --parallel C`,
          "RTT: a userspace delay proxy between the bridge and the hub (placement, relay); workers on loopback to the hub",
          "framesPerLayerStep: bridge dispatch frames / (remote layers x llama_decode calls); wireBytesPerToken: bridge<->workers",
          "identical: swarm texts = plain's; plainRepeatable: plain's warm-up texts = its measured ones (llama-server batches by arrival time, so at C > 1 neither is guaranteed; the llama-server test checks identity at fixed batches)",
        ],
      };
    } finally {
      for (const close of closers.reverse()) await close().catch(() => {});
      await Promise.all(workers.map((w) => w.close().catch(() => {})));
      await rm(dir, { recursive: true, force: true });
    }
  },
};
