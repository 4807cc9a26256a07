// `moeswarm-shard plan`: the table, --json, a model read over HTTP Range requests, swarm workers
// and demand from files, typed errors with their exit status.

import { createReadStream, statSync, writeFileSync } from "node:fs";
import { createServer, type Server } from "node:http";
import type { AddressInfo } from "node:net";
import { join } from "node:path";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../src/cli/run.js";
import { writeGguf } from "../src/index.js";
import { QWEN35_122B, qwen35moeModel } from "./plan-fixtures.js";

const tmp = tempDir("moeswarm-plan-cli-");
const model = join(tmp.dir, "qwen35-122b.gguf");
let server: Server;
let url: string;
const ranges: string[] = [];

beforeAll(async () => {
  await writeGguf(qwen35moeModel(QWEN35_122B), model, { headerOnly: true });
  server = createServer((req, res) => {
    const size = statSync(model).size;
    const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? "");
    if (!m) {
      res.writeHead(200, { "content-length": size });
      res.end();
      return;
    }
    ranges.push(req.headers.range!);
    const start = Number(m[1]);
    const end = Math.min(Number(m[2]), size - 1);
    res.writeHead(206, {
      "content-range": `bytes ${start}-${end}/${size}`,
      "content-length": end - start + 1,
    });
    createReadStream(model, { start, end }).pipe(res);
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/qwen35-122b.gguf`;
});

afterAll(async () => {
  await new Promise<void>((r) => server.close(() => r()));
  tmp.remove();
});

async function cli(args: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  let stdout = "";
  let stderr = "";
  const sink = (append: (s: string) => void) =>
    ({
      write: (s: string) => {
        append(s);
        return true;
      },
    }) as unknown as NodeJS.WritableStream;
  const code = await runCli(args, { stdout: sink((s) => (stdout += s)), stderr: sink((s) => (stderr += s)) });
  return { code, stdout, stderr };
}

describe("moeswarm-shard plan", () => {
  it("plans a header `synth --header-only` writes (the shape-true preset): sparse, seconds, loads as qwen35moe", async () => {
    const out = join(tmp.dir, "shape-header.gguf");
    const synth = await cli([
      "synth",
      "--preset",
      "shape",
      "--arch",
      "qwen35moe",
      "--header-only",
      "-o",
      out,
      "--json",
    ]);
    expect(synth.code, synth.stderr).toBe(0);
    const written = JSON.parse(synth.stdout);
    expect(written.headerOnly).toBe(true);
    expect(statSync(out).size).toBe(written.size);
    expect(written.size).toBeGreaterThan(5.5e9);
    const r = await cli(["plan", out, "--vram", "6GiB", "--ram", "8GiB", "--ctx", "8192", "--json"]);
    expect(r.code, r.stderr).toBe(0);
    const plan = JSON.parse(r.stdout);
    // 4 expert layers of 1.4-1.6 GB do not all fit in 6 GiB beside the rest: the last two go to RAM
    expect(plan.ramLayers).toEqual([2, 3]);
    // the file is the header (with its 4096-token vocabulary) and the tensors
    expect(BigInt(plan.modelBytes) < BigInt(written.size)).toBe(true);
    expect(BigInt(written.size) - BigInt(plan.modelBytes) < 1n << 20n).toBe(true);
  }, 60_000);

  it("prints a table with the devices, the layers moved and the -ot flag", async () => {
    const r = await cli(["plan", model, "--vram", "64GiB", "--ram", "128GiB", "--ctx", "8192"]);
    expect(r.code, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^VRAM\s+64\.00 GiB/m);
    expect(r.stdout).toMatch(/^RAM\s+128\.00 GiB/m);
    expect(r.stdout).toContain("expert layers in RAM:   42-47 (6 layers");
    expect(r.stdout).toContain("--override-tensor '^blk\\.4[2-7]\\.ffn_(up|down|gate)_exps\\.weight$=CPU'");
    expect(r.stdout).toContain("no --n-cpu-moe equivalent");
    expect(r.stdout).toMatch(/^fits$/m);
  });

  it("reads a URL with Range requests, never the whole file, and prints JSON", async () => {
    ranges.length = 0;
    const r = await cli(["plan", url, "--vram", "64GiB", "--ctx", "262144", "--order", "first", "--json"]);
    expect(r.code, r.stderr).toBe(0);
    expect(ranges.length).toBeGreaterThan(0);
    for (const range of ranges) {
      const [, a, b] = /^bytes=(\d+)-(\d+)$/.exec(range)!;
      expect(Number(b) - Number(a)).toBeLessThan(64 << 20);
    }
    const plan = JSON.parse(r.stdout);
    expect(plan.source).toContain("127.0.0.1");
    expect(plan.fits).toBe(true);
    // From the front, 11 layers: fewer of the first layers have Q6_K ffn_down than of the last.
    expect(plan.ramLayers).toEqual([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
    expect(plan.nCpuMoe).toBe(11);
    expect(plan.overrideTensor).toBe("^blk\\.([0-9]|10)\\.ffn_(up|down|gate)_exps\\.weight$=CPU");
    expect(BigInt(plan.devices.vram.total.bytes) <= 64n << 30n).toBe(true);
    expect(plan.devices.vram.capacity.gib).toBe(64);
    expect(
      BigInt(plan.weights.vram) +
        BigInt(plan.weights.ram) +
        BigInt(plan.weights.swarm) +
        BigInt(plan.weights.skipped),
    ).toBe(BigInt(plan.modelBytes));
  });

  it("assigns swarm slices to workers from a file, with replicas for hot experts", async () => {
    const workers = join(tmp.dir, "workers.json");
    writeFileSync(
      workers,
      JSON.stringify([
        { id: "gpu-box", capacity: "9GiB" },
        { id: "phone", capacity: "200MiB", maxLayers: 1 },
      ]),
    );
    const demand = join(tmp.dir, "demand.json");
    const hot = Array.from({ length: 256 }, (_, e) => (e < 16 ? 500 : 1));
    writeFileSync(demand, JSON.stringify({ 47: hot, 46: Array(256).fill(1) }));
    const r = await cli([
      "plan",
      model,
      "--vram",
      "64GiB",
      "--ctx",
      "8192",
      "--order",
      "last",
      "--workers",
      workers,
      "--demand",
      demand,
      "--json",
    ]);
    expect(r.code, r.stderr).toBe(0);
    const plan = JSON.parse(r.stdout);
    expect(plan.swarmLayers.length).toBeGreaterThan(0);
    const phone = plan.swarm.assignments.find((a: { worker: string }) => a.worker === "phone");
    expect(phone.slice.role).toBe("replica");
    expect(phone.slice.layers).toEqual([47]);
    expect(phone.slice.experts).toMatch(/^0:/);
    const text = await cli([
      "plan",
      model,
      "--vram",
      "64GiB",
      "--ctx",
      "8192",
      "--workers",
      "gpu-box=9GiB,phone=200MiB",
    ]);
    expect(text.stdout).toContain("swarm slices:");
    expect(text.stdout).toMatch(/=MOESWARM'/);
  });

  it("says when it does not fit, and fails with --strict", async () => {
    const r = await cli(["plan", model, "--vram", "4GiB", "--ram", "16GiB"]);
    expect(r.code).toBe(0);
    expect(r.stdout).toMatch(/^DOES NOT FIT$/m);
    const strict = await cli(["plan", model, "--vram", "4GiB", "--ram", "16GiB", "--strict", "--json"]);
    expect(strict.code).toBe(1);
    expect(strict.stderr).toMatch(/^moeswarm-shard: MOESWARM_PLAN_NO_FIT: /);
    expect(JSON.parse(strict.stdout).error.code).toBe("MOESWARM_PLAN_NO_FIT");
  });

  it("rejects bad arguments with exit status 2", async () => {
    for (const args of [
      ["plan", model],
      ["plan", "--vram", "64GiB"],
      ["plan", model, "--vram", "lots"],
      ["plan", model, "--vram", "64GiB", "--ctx", "-1"],
      ["plan", model, "--vram", "64GiB", "--flash-attn", "maybe"],
      ["plan", model, "--vram", "64GiB", "--workers", "nocapacity"],
    ]) {
      const r = await cli(args);
      expect(r.code, args.join(" ")).toBe(2);
      expect(r.stderr).toMatch(/MOESWARM_INVALID_(ARGUMENT|RANGE)/);
    }
    const missing = await cli(["plan", join(tmp.dir, "missing.gguf"), "--vram", "64GiB"]);
    expect(missing.code).toBe(1);
    expect(missing.stderr).toMatch(/MOESWARM_GGUF_IO/);
  });
});
