// llama-server as users run it: the pinned llama.cpp's llama-server (built by
// scripts/build-llama-server.mjs against node-llama-cpp's libraries), the plugin through
// GGML_BACKEND_PATH and the dispatcher's printed flags, moeswarm-dispatcher beside it on a hub with
// two workers; driven by the `openai` client at temperature 0 and compared with a plain
// llama-server: the same text, the same top-10 probabilities, one frame per remote layer per decode
// step with 4 concurrent clients, clear errors when the dispatcher is gone, and speculative
// decoding with a draft model (the dispatcher's --draft-model): the same text as plain llama-server
// with the same draft, in fewer round trips per token.
import { execFile, spawnSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { type Hub, mintToken } from "@moeswarm/hub";
import type { RelayConnection } from "@moeswarm/relay-client";
import { captureStream, type LlamaServerProcess, startLlamaServer } from "@moeswarm/testkit";
import OpenAI from "openai";
import { afterAll, beforeAll, describe, expect, it, vi } from "vitest";
import { runDispatcherCli } from "../src/cli/run.js";
import { pluginPath } from "../src/native-paths.js";
import {
  type ModelInfo,
  nativeMissing,
  relaySwarmWorkers,
  type Swarm,
  split,
  startSplitSwarm,
  syntheticModelInfo,
  tempDir,
  testHub,
} from "./helpers.js";

const BUILD_SCRIPT = fileURLToPath(new URL("../scripts/build-llama-server.mjs", import.meta.url));
const MODEL_ID = "srv";
const SECRET = "backbone-llama-server-secret-0123456";
const PROMPTS = ["The swarm", "Once upon a time", "1, 2, 3,", "A llama and"];
const N_PREDICT = 24;
/** What the dispatcher prints after -md <draft> (its default --draft-max). */
const DRAFT_FLAGS = ["--spec-type", "draft-simple", "--spec-draft-n-max", "8"];
// real processes on a shared machine: generous, never a speed goal
const TEST_TIMEOUT_MS = 180_000;

/** Why llama-server cannot be built here (no cmake or g++), or undefined; CI has both. */
function toolchainMissing(): string | undefined {
  for (const tool of ["cmake", "g++"]) {
    if (spawnSync(tool, ["--version"]).status !== 0) {
      if (process.env.CI) throw new Error(`CI must have ${tool} to build llama-server`);
      console.warn(`skipping the llama-server tests: no ${tool}`);
      return `no ${tool}`;
    }
  }
  return undefined;
}

const missing = nativeMissing() ?? toolchainMissing();

/** The cached llama-server (built here the first time: minutes, with progress on stderr). */
async function llamaServerBin(): Promise<string> {
  const out = await new Promise<string>((resolve, reject) => {
    // asynchronous: the build must not block this worker's event loop for minutes
    execFile(process.execPath, [BUILD_SCRIPT, "--json"], { maxBuffer: 1 << 20 }, (error, stdout, stderr) => {
      if (error) reject(new Error(`build-llama-server failed: ${error.message}\n${stderr.slice(-4000)}`));
      else resolve(stdout);
    });
  });
  return (JSON.parse(out.trim().split("\n").pop()!) as { bin: string }).bin;
}

interface Dispatcher {
  stop: AbortController;
  done: Promise<number>;
  stdout: ReturnType<typeof captureStream>;
  stderr: ReturnType<typeof captureStream>;
  listening: { address: string; override: string; llamaServer: string };
}

interface LayerMetrics {
  layer: number;
  requests: number;
}

/** Parsed JSON events the dispatcher printed with --json. */
function events(d: Dispatcher): Array<Record<string, unknown>> {
  return d.stdout
    .text()
    .split("\n")
    .filter((l) => l.startsWith("{"))
    .map((l) => JSON.parse(l) as Record<string, unknown>);
}

/**
 * The dispatcher's per-layer frame counts from reports printed after this call (every second),
 * once two consecutive ones agree: everything sent before the call is counted.
 */
async function settledLayerRequests(d: Dispatcher): Promise<Map<number, number>> {
  const metrics = () => events(d).filter((e) => e.event === "metrics");
  const from = metrics().length;
  for (;;) {
    const fresh = metrics().slice(from);
    if (fresh.length >= 2) {
      const a = JSON.stringify(fresh.at(-2)!.layers);
      const b = JSON.stringify(fresh.at(-1)!.layers);
      if (a === b) return new Map((fresh.at(-1)!.layers as LayerMetrics[]).map((l) => [l.layer, l.requests]));
    }
    await new Promise((r) => setTimeout(r, 250));
  }
}

/** llama.cpp's count of llama_decode calls (GET /metrics, needs --metrics). */
async function decodeCalls(server: LlamaServerProcess): Promise<number> {
  const text = await (await fetch(`${server.url}/metrics`)).text();
  const m = /^llamacpp:n_decode_total (\S+)$/m.exec(text);
  if (!m) throw new Error(`no n_decode_total in /metrics:\n${text}`);
  return Number(m[1]);
}

describe.skipIf(Boolean(missing))("llama-server with the plugin, beside moeswarm-dispatcher", () => {
  const tmp = tempDir("mswb-srv-");
  const socket = join(tmp.dir, "bridge.sock");
  let bin: string;
  let model: string;
  let draft: string;
  let info: ModelInfo;
  let swarm: Swarm;
  let hub: Hub;
  let hubUrl: string;
  const relays: RelayConnection[] = [];
  let dispatcher: Dispatcher | undefined;
  let plain: LlamaServerProcess;
  let served: LlamaServerProcess;

  const startDispatcher = async (): Promise<Dispatcher> => {
    const stdout = captureStream();
    const stderr = captureStream();
    const stop = new AbortController();
    const token = mintToken({ role: "backbone", id: "bb-srv", ttlS: 600 }, SECRET);
    const args = ["--socket", socket, "--hub", hubUrl, "--model-id", MODEL_ID, "--token", token];
    args.push("--model", model, "--trust", "own", "--spot-check", "0", "--json", "--stats-interval", "1");
    args.push("--draft-model", draft);
    const done = runDispatcherCli(args, { stdout: stdout.stream, stderr: stderr.stream }, stop.signal);
    const d = { stop, done, stdout, stderr, listening: undefined as never };
    await vi.waitFor(
      () => {
        const e = events(d).find((x) => x.event === "listening");
        if (!e) throw new Error(`not listening yet: ${stderr.text()}`);
        d.listening = e as never;
      },
      { timeout: 60_000, interval: 100 },
    );
    return d;
  };

  const stopDispatcher = async () => {
    dispatcher?.stop.abort();
    await dispatcher?.done;
    dispatcher = undefined;
  };

  beforeAll(async () => {
    bin = await llamaServerBin();
    ({ path: model, info } = await syntheticModelInfo("small"));
    draft = (await syntheticModelInfo("small-draft")).path;
    const halves = split(info.nExpert, 2);
    swarm = await startSplitSwarm(model, info, 2, tmp.dir, MODEL_ID);
    hub = testHub(SECRET, MODEL_ID, model);
    const listener = await hub.listen(0);
    hubUrl = listener.url;
    const opts = { secret: SECRET, swarm, model: MODEL_ID, layers: info.layers, parts: halves };
    relays.push(...(await relaySwarmWorkers(listener.relayUrl, opts)));
    dispatcher = await startDispatcher();
    const common = ["-m", model, "-t", "1", "--parallel", "4", "-c", "2048", "--metrics", "-fit", "off"];
    plain = await startLlamaServer(bin, [...common, "-kvu"]);
    // exactly the flags the dispatcher prints, and nothing in the environment but its three variables
    const printed = dispatcher.listening.llamaServer;
    expect(printed).toContain("--load-mode none");
    expect(printed).toContain("-kvu");
    expect(printed).toContain(`-ot '${dispatcher.listening.override}'`);
    expect(printed).toContain(`-md ${draft} ${DRAFT_FLAGS.join(" ")}`);
    served = await startLlamaServer(
      bin,
      [...common, "-ot", dispatcher.listening.override, "--load-mode", "none", "-kvu"],
      {
        env: {
          GGML_BACKEND_PATH: pluginPath(),
          MOESWARM_BRIDGE: dispatcher.listening.address,
          MOESWARM_MODEL: MODEL_ID,
          MOESWARM_TIMEOUT_MS: "10000",
          LD_LIBRARY_PATH: "",
        },
      },
    );
  }, 3_600_000);

  afterAll(async () => {
    await served?.close();
    await plain?.close();
    await stopDispatcher();
    await Promise.all(relays.map((c) => c.close().catch(() => {})));
    await swarm?.close();
    await hub?.close();
    tmp.remove();
  }, 60_000);

  const complete = (server: LlamaServerProcess, prompt: string) =>
    new OpenAI({ baseURL: `${server.url}/v1`, apiKey: "none", maxRetries: 0 }).completions.create({
      model: MODEL_ID,
      prompt,
      max_tokens: N_PREDICT,
      temperature: 0,
    });

  it(
    "answers the openai client with plain llama-server's text",
    async () => {
      // one client at a time: llama-server batches concurrent requests by arrival time, and
      // llama.cpp's own bits depend on the batch, so only fixed batches can be compared
      for (const prompt of PROMPTS) {
        const want = await complete(plain, prompt);
        const got = await complete(served, prompt);
        expect(got.choices[0]!.text.length).toBeGreaterThan(0);
        expect(got.choices[0]!.text).toBe(want.choices[0]!.text);
        // the synthetic vocabulary never generates a token that is not whole UTF-8 (no logit_bias
        // needed: llama-server answers 500 for such a token)
        expect(got.choices[0]!.text).not.toContain("\uFFFD");
        expect(got.usage?.completion_tokens).toBe(N_PREDICT);
      }
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "holds less memory than plain llama-server: the experts are never resident",
    async () => {
      const rssMb = (server: LlamaServerProcess) =>
        Number(/^VmRSS:\s+(\d+) kB$/m.exec(readFileSync(`/proc/${server.process.pid}/status`, "utf8"))![1]) /
        1024;
      const [p, s] = [rssMb(plain), rssMb(served)];
      console.log(
        `llama-server RSS: plain (mmap) ${p.toFixed(1)} MB, with the plugin (--load-mode none) ${s.toFixed(1)} MB`,
      );
      expect(s).toBeLessThan(p);
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "serves 4 concurrent clients with one frame per remote layer per decode step (-kvu)",
    async () => {
      const before = await settledLayerRequests(dispatcher!);
      const decodes0 = await decodeCalls(served);
      const got = await Promise.all(PROMPTS.map((p) => complete(served, `${p} again`)));
      const decodes = (await decodeCalls(served)) - decodes0;
      const after = await settledLayerRequests(dispatcher!);
      for (const r of got) expect(r.usage?.completion_tokens).toBe(N_PREDICT);
      // every MoE layer is remote; each took exactly one dispatch frame per llama_decode: the batch
      // of the busy sequences was never split
      expect(decodes).toBeGreaterThanOrEqual(N_PREDICT);
      expect(decodes).toBeLessThan(4 * N_PREDICT);
      expect(after.size).toBe(info.layers.length);
      for (const layer of info.layers) {
        expect((after.get(layer) ?? 0) - (before.get(layer) ?? 0)).toBe(decodes);
      }
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "speculates with the draft model: plain's text with the same draft, in fewer round trips per token",
    async () => {
      const env = {
        GGML_BACKEND_PATH: pluginPath(),
        MOESWARM_BRIDGE: dispatcher!.listening.address,
        MOESWARM_MODEL: MODEL_ID,
        LD_LIBRARY_PATH: "",
      };
      const common = [
        "-m",
        model,
        "-t",
        "1",
        "--parallel",
        "1",
        "-c",
        "1024",
        "--metrics",
        "-fit",
        "off",
        "-kvu",
      ];
      const speculative = [...common, "-md", draft, ...DRAFT_FLAGS];
      await using plainDraft = await startLlamaServer(bin, speculative);
      await using servedDraft = await startLlamaServer(
        bin,
        [...speculative, "-ot", dispatcher!.listening.override, "--load-mode", "none"],
        { env },
      );
      // round trips per remote layer for the same completions: without the draft (served), with it
      const roundTrips = async (server: LlamaServerProcess) => {
        const before = await settledLayerRequests(dispatcher!);
        const texts: string[] = [];
        for (const prompt of PROMPTS.slice(0, 2))
          texts.push((await complete(server, prompt)).choices[0]!.text);
        const after = await settledLayerRequests(dispatcher!);
        return { texts, perLayer: info.layers.map((l) => (after.get(l) ?? 0) - (before.get(l) ?? 0)) };
      };
      const want = await Promise.all(PROMPTS.slice(0, 2).map((p) => complete(plainDraft, p)));
      const withDraft = await roundTrips(servedDraft);
      const without = await roundTrips(served);
      expect(withDraft.texts).toEqual(want.map((w) => w.choices[0]!.text));
      const accepted = /^llamacpp:spec_decode_num_accepted_tokens_total (\S+)$/m.exec(
        await (await fetch(`${servedDraft.url}/metrics`)).text(),
      );
      expect(Number(accepted?.[1])).toBeGreaterThan(0);
      // one round trip per layer per token without the draft (plus the prompt's); with it, each
      // round trip verifies several
      for (const n of without.perLayer) expect(n).toBeGreaterThanOrEqual(2 * N_PREDICT);
      for (const [i, n] of withDraft.perLayer.entries()) {
        expect(n).toBeGreaterThan(0);
        expect(n).toBeLessThan(0.75 * without.perLayer[i]!);
      }
      console.log(
        `round trips per remote layer for 2 x ${N_PREDICT} tokens: ${without.perLayer[0]} plain, ${withDraft.perLayer[0]} with the draft`,
      );
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "warns at load when --parallel N comes without -kvu (every decode step would be split)",
    async () => {
      const warning = /moeswarm: llama-server --parallel 2 without -kvu: .* Add -kvu/;
      expect(served.output()).not.toMatch(/without -kvu/);
      await using split = await startLlamaServer(
        bin,
        ["-m", model, "-t", "1", "--parallel", "2", "-c", "512", "-fit", "off"].concat([
          "-ot",
          dispatcher!.listening.override,
          "--load-mode",
          "none",
        ]),
        {
          env: {
            GGML_BACKEND_PATH: pluginPath(),
            MOESWARM_BRIDGE: dispatcher!.listening.address,
            MOESWARM_MODEL: MODEL_ID,
          },
        },
      );
      expect(split.output()).toMatch(warning);
      expect(split.output()).toMatch(/kv_unified = 'false'/);
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "gives the same top-10 probabilities as plain llama-server (n_probs)",
    async () => {
      const ask = async (server: LlamaServerProcess) => {
        const r = await fetch(`${server.url}/completion`, {
          method: "POST",
          body: JSON.stringify({
            prompt: PROMPTS[1],
            n_predict: 16,
            n_probs: 10,
            temperature: 0,
            // evaluated whole in both servers: a prompt partly cached in one slot and not in the
            // other would be evaluated in different batch shapes, which changes llama.cpp's own bits
            cache_prompt: false,
          }),
        });
        expect(r.status).toBe(200);
        return ((await r.json()) as { completion_probabilities: unknown[] }).completion_probabilities;
      };
      const want = await ask(plain);
      expect(want).toHaveLength(16);
      expect(await ask(served)).toEqual(want);
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "answers an HTTP error that says what to do while the dispatcher is down, and recovers after its restart",
    async () => {
      await stopDispatcher();
      const failed = await fetch(`${served.url}/completion`, {
        method: "POST",
        body: JSON.stringify({ prompt: PROMPTS[0], n_predict: 4, temperature: 0 }),
      });
      expect(failed.status).toBeGreaterThanOrEqual(500);
      // llama.cpp's log is written by its own thread: the line may follow the answer
      await vi.waitFor(
        () =>
          expect(served.output()).toMatch(/check that moeswarm-dispatcher is running and listening on unix:/),
        { timeout: 10_000 },
      );
      expect(served.exited()).toBeUndefined();
      // restarted: the plugin's connection to the old dispatcher is dead; the next request reconnects
      dispatcher = await startDispatcher();
      const again = await complete(served, PROMPTS[0]!);
      const expected = await complete(plain, PROMPTS[0]!);
      expect(again.choices[0]!.text).toBe(expected.choices[0]!.text);
    },
    TEST_TIMEOUT_MS,
  );

  it(
    "reconnects once, invisibly, when the dispatcher restarted between requests",
    async () => {
      const first = await complete(served, PROMPTS[2]!);
      await stopDispatcher();
      dispatcher = await startDispatcher();
      const marker = served.output().length;
      const second = await complete(served, PROMPTS[2]!);
      expect(second.choices[0]!.text).toBe(first.choices[0]!.text);
      // the bridge path finds the connection dead in the split and says it reconnects once; with the
      // plugin's native plane on (OpenSSL found), the closed connection is noticed before the split
      // and the split opens a new one without a word. Never twice, never a failure.
      const log = served.output().slice(marker);
      expect(log.match(/reconnecting to unix:/g)?.length ?? 0).toBeLessThanOrEqual(1);
      expect(log).not.toMatch(/check that moeswarm-dispatcher is running/);
    },
    TEST_TIMEOUT_MS,
  );
});
