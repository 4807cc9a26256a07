// The built `moeswarm-shard` bin, spawned as a user runs it: every subcommand, --json output,
// one-line typed errors with a non-zero exit, no progress bar when not on a terminal.

import { spawn } from "node:child_process";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { runCli } from "../src/cli/run.js";
import { readGguf, sliceExperts, synthesizeMoeModel, syntheticPreset } from "../src/index.js";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const bin = join(root, "dist", "cli.js");
const tmp = tempDir("moeswarm-cli-");
afterAll(() => tmp.remove());

interface Run {
  code: number | null;
  stdout: string;
  stderr: string;
}

function cli(...args: string[]): Promise<Run> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [bin, ...args], {
      cwd: tmp.dir,
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stdout = "";
    let stderr = "";
    child.stdout.on("data", (c: Buffer) => {
      stdout += c.toString();
    });
    child.stderr.on("data", (c: Buffer) => {
      stderr += c.toString();
    });
    child.on("error", reject);
    child.on("close", (code) => resolve({ code, stdout, stderr }));
  });
}

/** The CLI's entry run in this process: node's start-up would dominate a spawned run. */
async function inProcess(args: string[]): Promise<Run> {
  let stdout = "";
  let stderr = "";
  const sink = (append: (s: string) => void) =>
    ({
      write: (s: string) => {
        append(s);
        return true;
      },
    }) as unknown as NodeJS.WritableStream;
  const code = await runCli(args, {
    stdout: sink((s) => (stdout += s)),
    stderr: sink((s) => (stderr += s)),
  });
  return { code, stdout, stderr };
}

beforeAll(() => {
  if (!existsSync(bin))
    throw new Error(`${bin} is missing: run \`pnpm --filter @moeswarm/shard build\` first`);
});

describe("moeswarm-shard", () => {
  it("synthesises the model the library does, then inspects, slices, manifests and verifies it", {
    timeout: 60_000,
  }, async () => {
    const model = join(tmp.dir, "m.gguf");
    const synth = await cli("synth", "--preset", "tiny", "--arch", "qwen3moe", "-o", model, "--json");
    expect(synth.stderr).toBe("");
    expect(synth.code).toBe(0);
    const lib = await synthesizeMoeModel(syntheticPreset("tiny"), join(tmp.dir, "lib.gguf"));
    expect(JSON.parse(synth.stdout)).toMatchObject({ output: model, size: lib.size, sha256: lib.sha256 });

    const inspect = await cli("inspect", model, "--json");
    expect(inspect.code).toBe(0);
    const info = JSON.parse(inspect.stdout);
    expect(info.metadata["general.architecture"]).toBe("qwen3moe");
    expect(info.metadata["tokenizer.ggml.tokens"]).toMatchObject({ type: "arr[str]", length: 512 });
    expect(info.tensorCount).toBe((await readGguf(model)).tensors.length);
    expect(info.moe).toMatchObject({ arch: "qwen3moe", blockCount: 2, expertCount: 8, expertUsedCount: 2 });
    expect(info.moe.layers.map((l: { bytesPerExpert: number }) => l.bytesPerExpert)).toEqual([
      3 * 8704,
      3 * 8704,
    ]);
    const text = await cli("inspect", model);
    expect(text.code).toBe(0);
    expect(text.stdout).toMatch(
      /MoE: qwen3moe, 2 of 2 layers with experts, 8 experts per layer, 2 used per token/,
    );
    expect(text.stdout).toMatch(/layer {3}1: 8 experts x 25\.5 KiB/);

    const manifest = await cli("manifest", model, "--json");
    expect(manifest.code).toBe(0);
    expect(JSON.parse(manifest.stdout)).toMatchObject({
      cached: false,
      layers: 2,
      slabs: 48,
      manifestPath: `${model}.manifest.json`,
    });
    expect(JSON.parse((await cli("manifest", model, "--json")).stdout)).toMatchObject({ cached: true });

    const out = join(tmp.dir, "s.gguf");
    const slice = await cli(
      "slice",
      model,
      "--layers",
      "0:2",
      "--experts",
      "1:3,6",
      "-o",
      out,
      "--manifest",
      `${model}.manifest.json`,
    );
    expect(slice.code).toBe(0);
    expect(slice.stderr).toBe(""); // not a terminal: no progress bar
    expect(slice.stdout).toMatch(/^wrote .*s\.gguf: .*layers 0:2, experts 1:3,6, 6 tensors/);
    const lib2 = await sliceExperts(model, { layers: [0, 1], experts: [1, 2, 6] });
    const parts: Uint8Array[] = [];
    for await (const c of lib2.stream()) parts.push(c);
    await lib2.close();
    expect(readFileSync(out).equals(Buffer.concat(parts))).toBe(true);

    const verify = await cli("verify", out, "--manifest", `${model}.manifest.json`, "--json");
    expect(verify.code).toBe(0);
    expect(JSON.parse(verify.stdout)).toMatchObject({
      ok: true,
      layers: [0, 1],
      experts: [1, 2, 6],
      slabs: 18,
    });

    const bad = Buffer.from(readFileSync(out));
    bad[bad.byteLength - 10]! ^= 1;
    writeFileSync(join(tmp.dir, "bad.gguf"), bad);
    const failed = await cli("verify", "bad.gguf", "--manifest", `${model}.manifest.json`);
    expect(failed.code).toBe(1);
    expect(failed.stderr).toMatch(
      /^moeswarm-shard: MOESWARM_SLICE_MISMATCH: slab of expert 6 in blk\.1\.ffn_down_exps\.weight \(layer 1\) does not match the manifest\n$/,
    );
  });

  it("fails with one line naming the code, and a JSON error with --json", { timeout: 60_000 }, async () => {
    const model = join(tmp.dir, "e.gguf");
    await synthesizeMoeModel(syntheticPreset("tiny"), model);
    const x = join(tmp.dir, "x.gguf");
    const cases: Array<[string[], number, string]> = [
      [["slice", model, "--layers", "0:3", "-o", x], 2, "MOESWARM_INVALID_RANGE"],
      [["slice", model, "--layers", "5:3", "-o", x], 2, "MOESWARM_INVALID_RANGE"],
      [["slice", model, "--layers", "0", "--experts", "0:9", "-o", x], 2, "MOESWARM_INVALID_RANGE"],
      [["slice", model, "--layers", "0"], 2, "MOESWARM_INVALID_ARGUMENT"],
      [["inspect", join(tmp.dir, "missing.gguf")], 1, "MOESWARM_GGUF_IO"],
      [["inspect", join(root, "package.json")], 1, "MOESWARM_GGUF_BAD_MAGIC"],
      [["verify", model], 1, "MOESWARM_SLICE_MISMATCH"],
      [["synth", "--preset", "huge", "-o", x], 1, "MOESWARM_INVALID_ARGUMENT"],
      [["frobnicate"], 2, "MOESWARM_INVALID_ARGUMENT"],
      [["inspect", model, "--bogus"], 2, "MOESWARM_INVALID_ARGUMENT"],
    ];
    const check = (args: string[], code: number, errorCode: string, run: Run, json: Run) => {
      expect(run.code, args.join(" ")).toBe(code);
      expect(run.stderr, args.join(" ")).toMatch(new RegExp(`^moeswarm-shard: ${errorCode}: [^\\n]+\\n$`));
      expect(json.code, args.join(" ")).toBe(code);
      expect(JSON.parse(json.stdout).error.code, args.join(" ")).toBe(errorCode);
    };
    // Every case through the CLI's entry in-process, a few through the spawned bin.
    for (const [args, code, errorCode] of cases)
      check(args, code, errorCode, await inProcess(args), await inProcess([...args, "--json"]));
    for (const i of [0, 4, 6, 8]) {
      const [args, code, errorCode] = cases[i]!;
      const [run, json] = await Promise.all([cli(...args), cli(...args, "--json")]);
      check(args, code, errorCode, run, json);
    }
    expect(existsSync(x)).toBe(false);
  });

  it("inspects and plans a header-only GGUF as the real file with --file-size", async () => {
    const model = join(tmp.dir, "h.gguf");
    await synthesizeMoeModel(syntheticPreset("tiny"), model);
    const full = await readGguf(model);
    const headerOnly = join(tmp.dir, "h.header.gguf");
    writeFileSync(headerOnly, readFileSync(model).subarray(0, Number(full.dataOffset)));
    // without the size its tensors lie past its end
    const bare = await inProcess(["inspect", headerOnly, "--json"]);
    expect(bare.code).toBe(1);
    expect(JSON.parse(bare.stdout).error.code).toMatch(/^MOESWARM_GGUF_/);
    const size = String(full.fileSize);
    const asFile = await inProcess(["inspect", headerOnly, "--file-size", size, "--json"]);
    expect(asFile.code).toBe(0);
    const want = JSON.parse((await inProcess(["inspect", model, "--json"])).stdout);
    const got = JSON.parse(asFile.stdout);
    expect({ ...got, source: undefined }).toEqual({ ...want, source: undefined });
    const plan = await inProcess(["plan", headerOnly, "--file-size", size, "--vram", "1GiB", "--json"]);
    expect(plan.code).toBe(0);
    const wantPlan = await inProcess(["plan", model, "--vram", "1GiB", "--json"]);
    expect({ ...JSON.parse(plan.stdout), source: undefined }).toEqual({
      ...JSON.parse(wantPlan.stdout),
      source: undefined,
    });
    const bad = await inProcess(["inspect", headerOnly, "--file-size", "lots"]);
    expect(bad.code).toBe(2);
  });

  it("inspects and slices a model over HTTP Range requests", async () => {
    const model = join(tmp.dir, "h.gguf");
    await synthesizeMoeModel(syntheticPreset("tiny", "mixtral"), model);
    const file = readFileSync(model);
    let requests = 0;
    const server = createServer((req, res) => {
      requests++;
      const m = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range ?? "");
      if (!m) {
        res.writeHead(400).end();
        return;
      }
      const start = Number(m[1]);
      const end = Math.min(Number(m[2]), file.byteLength - 1);
      res.writeHead(206, {
        "content-range": `bytes ${start}-${end}/${file.byteLength}`,
        "content-length": end - start + 1,
      });
      res.end(file.subarray(start, end + 1));
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    try {
      const url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/h.gguf`;
      const inspect = await inProcess(["inspect", url, "--json"]);
      expect(inspect.code).toBe(0);
      expect(JSON.parse(inspect.stdout).moe).toMatchObject({ arch: "llama", expertCount: 8 });
      const out = join(tmp.dir, "h-slice.gguf");
      const sliced = await inProcess(["slice", url, "--layers", "1", "--experts", "3:5", "-o", out]);
      expect(sliced.code).toBe(0);
      const local = await sliceExperts(model, { layers: [1], experts: [3, 4] });
      const parts: Uint8Array[] = [];
      for await (const c of local.stream()) parts.push(c);
      await local.close();
      expect(readFileSync(out).equals(Buffer.concat(parts))).toBe(true);
      expect(requests).toBeGreaterThan(1);
    } finally {
      await new Promise((r) => server.close(r));
    }
  });

  it("prints its version with --version", async () => {
    const { version } = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
    const r = await cli("--version");
    expect(r).toMatchObject({ code: 0, stdout: `moeswarm-shard ${version}\n` });
  });

  it("prints help", async () => {
    const help = await cli("--help");
    expect(help.code).toBe(0);
    for (const c of ["inspect", "slice", "manifest", "verify", "synth"])
      expect(help.stdout).toContain(`  ${c} `);
    const sliceHelp = await cli("slice", "--help");
    expect(sliceHelp.stdout).toMatch(
      /usage: moeswarm-shard slice <model> --layers a:b --experts c:d -o out\.gguf/,
    );
    expect((await cli()).code).toBe(2);
  });
});
