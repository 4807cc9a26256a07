// moeswarm-dispatcher (in-process) beside the harness in llama-server mode (-ot), and the memory the
// plugin saves: expert weights handed to it are dropped, never resident.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { frameAllocatorState } from "@moeswarm/core";
import { sliceExperts } from "@moeswarm/shard";
import { captureStream } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { llamaServerCommand, runDispatcherCli } from "../src/cli/run.js";
import { runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import {
  firstByteDiff,
  type ModelInfo,
  nativeMissing,
  split,
  startSplitSwarm,
  syntheticModelInfo,
  tempDir,
} from "./helpers.js";

const missing = nativeMissing();

describe("moeswarm-dispatcher usage", () => {
  it("prints its usage and refuses bad command lines with status 2", async () => {
    const out = captureStream();
    const err = captureStream();
    const io = { stdout: out.stream, stderr: err.stream };
    const signal = new AbortController().signal;
    expect(await runDispatcherCli(["--help"], io, signal)).toBe(0);
    expect(out.text()).toMatch(/--worker <id>=<slice>/);
    expect(await runDispatcherCli(["--socket", "/tmp/x.sock"], io, signal)).toBe(2);
    expect(err.text()).toMatch(/--model <gguf> is required/);
    expect(await runDispatcherCli(["--bogus"], io, signal)).toBe(2);
    expect(await runDispatcherCli(["--model", "/no/such.gguf", "--socket", "/tmp/x.sock"], io, signal)).toBe(
      2,
    );
    // the hub form: its flags go together, and not with --worker
    const hub = ["--socket", "/tmp/x.sock", "--hub", "https://127.0.0.1:1"];
    const cases: Array<[string[], RegExp]> = [
      [["--socket", "/tmp/x.sock", "--model", "/no/such.gguf", "--token", "t"], /--token needs --hub/],
      [[...hub, "--token", "t"], /--hub needs --model-id/],
      [[...hub, "--model-id", "m"], /one of --token <t> or --token-file <f>/],
      [[...hub, "--model-id", "m", "--token", "t", "--token-file", "f"], /one of --token/],
      [
        [...hub, "--model-id", "m", "--token", "t", "--worker", "a=b.gguf"],
        /--worker and --hub are exclusive/,
      ],
      [[...hub, "--model-id", "m", "--token-file", "/no/such/token"], /--token-file \/no\/such\/token/],
      [[...hub, "--model-id", "m", "--token", "t", "--ca", "/no/such/ca.pem"], /--ca \/no\/such\/ca.pem/],
      [
        ["--socket", "/tmp/x.sock", "--hub", "nope", "--model-id", "m", "--token", "t"],
        /--hub "nope" is not a URL/,
      ],
      [[...hub, "--model-id", "../m", "--token", "t"], /--model-id must be a model id/],
      [[...hub, "--model-id", "m", "--token", "t", "--report-interval", "0"], /--report-interval must be/],
      [[...hub, "--model-id", "m", "--token", "t", "--spot-check", "1.5"], /--spot-check must be a share/],
      [[...hub, "--model-id", "m", "--token", "t", "--spot-check", "x"], /--spot-check must be a share/],
      [[...hub, "--model-id", "m", "--token", "t", "--hedge-ms", "1.5"], /--hedge-ms must be/],
      [[...hub, "--model-id", "m", "--token", "t", "--draft-max", "4"], /--draft-max needs --draft-model/],
      [
        [...hub, "--model-id", "m", "--token", "t", "--draft-model", "/no/d.gguf"],
        /--draft-model \/no\/d.gguf/,
      ],
      [
        [...hub, "--model-id", "m", "--token", "t", "--draft-model", "/tmp", "--draft-max", "0"],
        /--draft-max must be an integer in 1..64/,
      ],
    ];
    for (const [args, message] of cases) {
      const e = captureStream();
      expect(await runDispatcherCli(args, { stdout: out.stream, stderr: e.stream }, signal)).toBe(2);
      expect(e.text()).toMatch(message);
    }
  });
});

describe("the printed llama-server command", () => {
  it("carries the draft model's speculative flags only when given one", () => {
    const plain = llamaServerCommand("m.gguf", "x=MOESWARM");
    expect(plain).toBe("llama-server -m m.gguf -ot 'x=MOESWARM' -fit off --load-mode none -kvu");
    expect(llamaServerCommand("m.gguf", "x=MOESWARM", { path: "d.gguf", max: 5 })).toBe(
      `${plain} -md d.gguf --spec-type draft-simple --spec-draft-n-max 5`,
    );
  });
});

describe.skipIf(Boolean(missing))("moeswarm-dispatcher beside a llama.cpp with the plugin", () => {
  const tmp = tempDir("mswb-cli-");
  let model: string;
  let info: ModelInfo;

  beforeAll(async () => {
    ({ path: model, info } = await syntheticModelInfo("small"));
  });
  afterAll(() => tmp.remove());

  it("serves two worker slices; the -ot decode is bit-identical to plain llama.cpp", async () => {
    const halves = split(info.nExpert, 2);
    const workers: string[] = [];
    for (const [i, experts] of halves.entries()) {
      const path = join(tmp.dir, `half${i}.gguf`);
      await using slice = await sliceExperts(model, { layers: info.layers, experts });
      await slice.write(path);
      workers.push("--worker", `w${i}=${path}`);
    }
    const out = captureStream();
    const err = captureStream();
    const controller = new AbortController();
    const socket = join(tmp.dir, "d.sock");
    const exit = runDispatcherCli(
      [
        ...["--socket", socket, "--model", model, "--model-id", "cli", "--no-fallback", "--json"],
        // every answer drawn for a spot check; with no fallback and no replica none can be checked
        ...["--spot-check", "1", "--hedge-ms", "60000", ...workers],
      ],
      { stdout: out.stream, stderr: err.stream },
      controller.signal,
    );
    const listening = JSON.parse(await out.line(/"event":"listening"/)) as {
      address: string;
      override: string;
      layers: number[];
      malloc: string;
    };
    expect(listening.address).toBe(`unix:${socket}`);
    expect(listening.layers).toEqual(info.layers);
    // the dispatcher receives large results: it says how malloc is set (core frameAllocatorState)
    expect(listening.malloc).toBe(frameAllocatorState());

    const common = { modelPath: model, prompt: "A dispatcher beside llama-server", nPredict: 32, threads: 1 };
    const plain = await runLogitsHarness({ ...common, logitsPath: join(tmp.dir, "plain.bin") });
    const remote = await runLogitsHarness({
      ...common,
      logitsPath: join(tmp.dir, "remote.bin"),
      overrides: [listening.override],
      plugin: { bridge: listening.address, model: "cli" },
    });
    expect(remote.ok, remote.stderr).toBe(true);
    expect(remote.tokens).toEqual(plain.tokens);
    expect(
      firstByteDiff(readFileSync(join(tmp.dir, "remote.bin")), readFileSync(join(tmp.dir, "plain.bin"))),
    ).toBe(-1);

    controller.abort();
    expect(await exit).toBe(0);
    const metrics = JSON.parse(await out.line(/"event":"metrics"/)) as {
      requests: number;
      failed: number;
      spotCheck?: { sampled: number; unverifiable: number; quarantined: string[] };
      dispatch: { hedges: number };
    };
    expect(metrics.requests).toBe(remote.plugin!.splits);
    expect(metrics.failed).toBe(0);
    expect(metrics.spotCheck?.sampled).toBeGreaterThan(0);
    expect(metrics.spotCheck?.unverifiable).toBe(metrics.spotCheck?.sampled);
    expect(metrics.spotCheck?.quarantined).toEqual([]);
    expect(metrics.dispatch.hedges).toBe(0);
    expect(err.text()).toBe("");
  });

  it("drops the expert weights: resident memory falls by about their size (no mmap)", async () => {
    await using swarm = await startSplitSwarm(model, info, 2, tmp.dir, "mem", "m");
    await using bridge = await serveBackboneBridge({
      socket: join(tmp.dir, "mem.sock"),
      placement: swarm.placement,
      transport: swarm.transport,
    });
    const common = { modelPath: model, prompt: "memory", nPredict: 4, threads: 1, noMmap: true };
    const plain = await runLogitsHarness(common);
    const remote = await runLogitsHarness({
      ...common,
      plugin: { bridge: bridge.address, layers: "all", model: "mem" },
    });
    expect(remote.ok, remote.stderr).toBe(true);
    expect(remote.tokens).toEqual(plain.tokens);
    const expertBytes = remote.plugin!.weightsDroppedBytes;
    expect(expertBytes).toBeGreaterThan(40 * 1024 * 1024);
    const savedKiB = plain.rssLoadKiB - remote.rssLoadKiB;
    console.log(
      `RSS after load, small qwen3moe, no mmap: plain ${(plain.rssLoadKiB / 1024).toFixed(1)} MiB, ` +
        `plugin ${(remote.rssLoadKiB / 1024).toFixed(1)} MiB (expert weights ${(expertBytes / 2 ** 20).toFixed(1)} MiB); ` +
        `peak ${(plain.maxRssKiB / 1024).toFixed(1)} vs ${(remote.maxRssKiB / 1024).toFixed(1)} MiB`,
    );
    expect(savedKiB * 1024).toBeGreaterThan(0.9 * expertBytes);
  });
});
