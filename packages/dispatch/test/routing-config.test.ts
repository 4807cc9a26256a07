import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";
import { DispatchError, GgufError } from "@moeswarm/core";
import { describe, expect, it } from "vitest";
import { ROUTING_ARCHITECTURES, route, routingConfigFromGguf } from "../src/index.js";

const repoRoot = join(import.meta.dirname, "..", "..", "..");
const { llamaSourceDir } = (await import(
  pathToFileURL(join(repoRoot, "tools", "llama-source.mjs")).href
)) as {
  llamaSourceDir(): string;
};
const src = llamaSourceDir();
const models = join(src, "src", "models");

function stripComments(s: string): string {
  return s.replace(/\/\*.*?\*\//gs, "").replace(/\/\/[^\n]*/g, "");
}

/** The argument texts of the build_moe_ffn call that starts on `line` of `file`. */
function callArgs(file: string, line: number): string[] {
  const lines = readFileSync(join(models, file), "utf8").split("\n");
  expect(lines[line - 1], `${file}:${line}`).toContain("build_moe_ffn(");
  const text = stripComments(lines.slice(line - 1).join("\n"));
  let i = text.indexOf("build_moe_ffn(") + "build_moe_ffn(".length;
  const args: string[] = [];
  let depth = 0;
  let cur = "";
  for (; i < text.length; i++) {
    const c = text[i]!;
    if (c === "(") depth++;
    if (c === ")") {
      if (depth === 0) break;
      depth--;
    }
    if (c === "," && depth === 0) {
      args.push(cur.trim());
      cur = "";
    } else cur += c;
  }
  args.push(cur.trim());
  return args;
}

/** Body of the load_arch_hparams function that contains `line` (or starts after it). */
function hparamsBody(file: string, line: number): string {
  const text = readFileSync(join(models, file), "utf8");
  const lines = text.split("\n");
  let start = line - 1;
  while (start >= 0 && !lines[start]!.includes("::load_arch_hparams")) start--;
  expect(start, `${file}:${line} is inside load_arch_hparams`).toBeGreaterThanOrEqual(0);
  let depth = 0;
  let seen = false;
  const body: string[] = [];
  for (let i = start; i < lines.length; i++) {
    body.push(lines[i]!);
    for (const c of lines[i]!) {
      if (c === "{") {
        depth++;
        seen = true;
      }
      if (c === "}") depth--;
    }
    if (seen && depth === 0) break;
  }
  return stripComments(body.join("\n"));
}

const isNull = (a: string | undefined) => a === undefined || a === "nullptr" || a === "NULL";

describe("the routing table matches the pinned llama.cpp source", () => {
  const archNames = new Set(
    [
      ...readFileSync(join(src, "src", "llama-arch.cpp"), "utf8").matchAll(
        /\{\s*LLM_ARCH_\w+,\s*"([^"]+)"\s*\}/g,
      ),
    ].map((m) => m[1]),
  );

  for (const spec of ROUTING_ARCHITECTURES) {
    it(`${spec.arch}: ${spec.graph}`, () => {
      expect(archNames.has(spec.arch)).toBe(true);
      const [file, lineText] = spec.graph.split(":");
      const args = callArgs(file!, Number(lineText));
      const long = args[2]!.includes("gate_inp_b");
      const at = (short: number) => args[long ? short + 4 : short];
      expect(!isNull(at(5)), "exp_probs_b passed").toBe(spec.selectionBias);
      expect(long && !isNull(args[2]), "gate_inp_b").toBe(spec.logitBias === true);
      const typeOp = at(8)!;
      const act = {
        LLM_FFN_SILU: "silu",
        LLM_FFN_GELU: "gelu",
        LLM_FFN_RELU: "relu",
        LLM_FFN_RELU_SQR: "relu_sqr",
        LLM_FFN_SWIGLU_OAI_MOE: "swiglu_oai",
        LLM_FFN_SITU: "situ",
      }[typeOp];
      expect(act, typeOp).toBe(spec.activation);
      const norm = at(9)!;
      expect(
        norm === "hparams.expert_weights_norm"
          ? "key"
          : norm === "true"
            ? true
            : norm === "false"
              ? false
              : norm,
      ).toBe(spec.normalize);
      const gating = at(11)!;
      if ("fixed" in spec.gating) {
        expect(gating).toBe(`LLAMA_EXPERT_GATING_FUNC_TYPE_${spec.gating.fixed.toUpperCase()}`);
      } else {
        expect(gating).toMatch(/hparams\.expert_gating_func/);
      }
      if (spec.logits === "custom")
        expect(isNull(args[1]), "gate_inp is replaced by the model's logits").toBe(true);

      const [hfile, hlines] = spec.hparams.split(":");
      const body = hparamsBody(hfile!, Number(hlines!.split("-")[0]));
      expect(body.includes("LLM_KV_EXPERT_WEIGHTS_SCALE"), "reads expert_weights_scale").toBe(spec.scale);
      if (spec.normalize === "key") expect(body).toContain("LLM_KV_EXPERT_WEIGHTS_NORM");
      if (!("fixed" in spec.gating)) expect(body).toContain("LLM_KV_EXPERT_GATING_FUNC");
      if (spec.swigluLimit) expect(body).toContain("LLM_KV_SWIGLU_CLAMP_EXP");
    });
  }

  it("every model file that calls build_moe_ffn is in the table", () => {
    const files = readdirSync(models).filter(
      (f) => f.endsWith(".cpp") && readFileSync(join(models, f), "utf8").includes("build_moe_ffn("),
    );
    const covered = new Set(ROUTING_ARCHITECTURES.map((s) => s.graph.split(":")[0]));
    // nemotron-h-moe.cpp's call is its MTP head; the main graph is nemotron-h.cpp (models.h:1523)
    covered.add("nemotron-h-moe.cpp");
    expect(files.filter((f) => !covered.has(f))).toEqual([]);
  });

  it("README.md documents every architecture of the table", () => {
    const readme = readFileSync(join(import.meta.dirname, "..", "README.md"), "utf8");
    for (const spec of ROUTING_ARCHITECTURES) {
      expect(readme).toMatch(new RegExp(`\\|\\s*\`${spec.arch}\`\\s*\\|\\s*${spec.graph}\\s*\\|`));
    }
  });
});

// Metadata as the shard reader returns it: a Map of key -> { type, value }.
const typed = (entries: Record<string, unknown>) =>
  new Map(Object.entries(entries).map(([k, v]) => [k, { type: typeof v === "string" ? 8 : 4, value: v }]));

describe("routingConfigFromGguf", () => {
  it("DeepSeek-V3: sigmoid, selection bias, 8 groups keep 4, normalised, scale 2.5", () => {
    const cfg = routingConfigFromGguf(
      typed({
        "general.architecture": "deepseek2",
        "deepseek2.block_count": 61,
        "deepseek2.expert_count": 256,
        "deepseek2.expert_used_count": 8,
        "deepseek2.expert_group_count": 8,
        "deepseek2.expert_group_used_count": 4,
        "deepseek2.expert_weights_scale": 2.5,
        "deepseek2.expert_weights_norm": true,
        "deepseek2.expert_gating_func": 2,
      }),
      { layer: 5 },
    );
    expect(cfg).toMatchObject({
      arch: "deepseek2",
      nExpert: 256,
      nExpertUsed: 8,
      gating: "sigmoid",
      normalize: true,
      scale: 2.5,
      nExpertGroups: 8,
      nGroupUsed: 4,
      selectionBiasTensor: "blk.5.exp_probs_b.bias",
      activation: { kind: "silu" },
      logitsSource: "gate_inp",
    });
    // the config routes as is once the bias tensor is loaded
    const r = route(new Float32Array(256).fill(0.5), { ...cfg, selectionBias: new Float32Array(256) });
    expect([...r.ids]).toEqual([0, 1, 2, 3, 4, 5, 6, 7]);
  });

  it("deepseek2 without the gating key: softmax (V2), or sigmoid for GLM 4.7 Lite's shape", () => {
    const base = {
      "general.architecture": "deepseek2",
      "deepseek2.expert_count": 64,
      "deepseek2.expert_used_count": 6,
      "deepseek2.block_count": 27,
    };
    expect(routingConfigFromGguf(base).gating).toBe("softmax");
    const glm = { ...base, "deepseek2.block_count": 48, "deepseek2.vocab_size": 154_880 };
    expect(routingConfigFromGguf(glm).gating).toBe("sigmoid");
    const glmTokens = { ...base, "deepseek2.block_count": 49, "deepseek2.nextn_predict_layers": 1 };
    expect(
      routingConfigFromGguf(
        new Map<string, unknown>([
          ...Object.entries(glmTokens),
          ["tokenizer.ggml.tokens", new Array(154_880).fill("t")],
        ]),
      ).gating,
    ).toBe("sigmoid");
  });

  it("Qwen3-MoE, Mixtral and friends: softmax with literal norm; keys they do not read are ignored", () => {
    const q = routingConfigFromGguf({
      "general.architecture": "qwen3moe",
      "qwen3moe.expert_count": 128,
      "qwen3moe.expert_used_count": 8,
      "qwen3moe.expert_weights_scale": 7, // not read by llama.cpp for qwen3moe
      "qwen3moe.expert_gating_func": 2, // idem
    });
    expect(q).toMatchObject({ gating: "softmax", normalize: true, scale: 0, nExpertGroups: 0 });
    expect(q.selectionBiasTensor).toBeUndefined();
    const m = routingConfigFromGguf({
      "general.architecture": "llama",
      "llama.expert_count": 8,
      "llama.expert_used_count": 2,
    });
    expect(m).toMatchObject({ gating: "softmax", normalize: true, nExpertUsed: 2 });
    const q2 = routingConfigFromGguf({
      "general.architecture": "qwen2moe",
      "qwen2moe.expert_count": 60,
      "qwen2moe.expert_used_count": 4,
    });
    expect(q2.normalize).toBe(false);
  });

  it("gpt-oss, llama4, grovemoe, kimi-k3, step35: their special routing and activation", () => {
    const oss = routingConfigFromGguf({
      "general.architecture": "gpt-oss",
      "gpt-oss.expert_count": 32,
      "gpt-oss.expert_used_count": 4,
      "gpt-oss.expert_weights_scale": 3, // not read
    });
    expect(oss).toMatchObject({
      gating: "softmax_weight",
      normalize: false,
      scale: 0,
      logitBiasTensor: "blk.0.ffn_gate_inp.bias",
      activation: { kind: "swiglu_oai", alpha: 1.702, limit: 7 },
    });
    const l4 = routingConfigFromGguf({
      "general.architecture": "llama4",
      "llama4.expert_count": 16,
      "llama4.expert_used_count": 1,
    });
    expect(l4).toMatchObject({
      gating: "sigmoid",
      selectOn: "logits",
      weightBeforeFfn: true,
      normalize: false,
    });
    const grove = routingConfigFromGguf({
      "general.architecture": "grovemoe",
      "grovemoe.expert_count": 128,
      "grovemoe.expert_used_count": 8,
    });
    expect(grove.selectOn).toBe("sigmoid");
    const k3 = routingConfigFromGguf({
      "general.architecture": "kimi-k3",
      "kimi-k3.expert_count": 64,
      "kimi-k3.expert_used_count": 8,
      "kimi-k3.expert_gating_func": 2,
      "kimi-k3.activation.situ_beta": 4,
      "kimi-k3.activation.situ_linear_beta": 0,
    });
    expect(k3).toMatchObject({
      logitsSource: "custom",
      activation: { kind: "situ", beta: 4, linearBeta: 0 },
    });
    const step = {
      "general.architecture": "step35",
      "step35.expert_count": 64,
      "step35.expert_used_count": 8,
      "step35.swiglu_clamp_exp": Float32Array.from([0, 7.5]),
    };
    expect(routingConfigFromGguf(step, { layer: 0 }).activation).toEqual({ kind: "silu" });
    expect(routingConfigFromGguf(step, { layer: 1 })).toMatchObject({
      gating: "sigmoid",
      activation: { kind: "silu", limit: 7.5, limitMode: "clamp_output" },
    });
  });

  it("per-layer expert_used_count for nemotron_h; the first value elsewhere", () => {
    const md = {
      "general.architecture": "nemotron_h",
      "nemotron_h.expert_count": 128,
      "nemotron_h.expert_used_count": Uint32Array.from([6, 22, 8]),
    };
    expect(routingConfigFromGguf(md, { layer: 1 }).nExpertUsed).toBe(22);
    expect(routingConfigFromGguf(md, { layer: 1 }).activation).toEqual({ kind: "relu_sqr" });
    const other = {
      "general.architecture": "qwen3moe",
      "qwen3moe.expert_count": 8,
      "qwen3moe.expert_used_count": [2, 4],
    };
    expect(routingConfigFromGguf(other, { layer: 1 }).nExpertUsed).toBe(2);
  });

  it("accepts 64-bit integer values as bigint", () => {
    const cfg = routingConfigFromGguf({
      "general.architecture": "olmoe",
      "olmoe.expert_count": 64n,
      "olmoe.expert_used_count": 8n,
    });
    expect(cfg).toMatchObject({ nExpert: 64, nExpertUsed: 8, normalize: false });
  });

  it("fails with typed errors on what llama.cpp would reject", () => {
    const err = (md: Record<string, unknown>, code: string) => {
      let e: unknown;
      try {
        routingConfigFromGguf(md);
      } catch (x) {
        e = x;
      }
      expect((e as { code?: string }).code, JSON.stringify(md)).toBe(code);
    };
    err({}, "MOESWARM_ROUTING_CONFIG");
    err({ "general.architecture": "qwen3" }, "MOESWARM_ROUTING_CONFIG");
    err({ "general.architecture": "qwen3moe", "qwen3moe.expert_used_count": 8 }, "MOESWARM_GGUF_NOT_MOE");
    err({ "general.architecture": "qwen3moe", "qwen3moe.expert_count": 8 }, "MOESWARM_ROUTING_CONFIG");
    err(
      { "general.architecture": "dots1", "dots1.expert_count": 8, "dots1.expert_used_count": 2 },
      "MOESWARM_ROUTING_CONFIG",
    );
    err(
      {
        "general.architecture": "deepseek4",
        "deepseek4.expert_count": 8,
        "deepseek4.expert_used_count": 2,
        "deepseek4.expert_gating_func": 1,
      },
      "MOESWARM_ROUTING_CONFIG",
    );
    err(
      {
        "general.architecture": "bailingmoe2",
        "bailingmoe2.expert_count": 8,
        "bailingmoe2.expert_used_count": 2,
        "bailingmoe2.expert_gating_func": 9,
      },
      "MOESWARM_ROUTING_CONFIG",
    );
    err(
      {
        "general.architecture": "qwen3moe",
        "qwen3moe.expert_count": 8,
        "qwen3moe.expert_used_count": 2,
        "qwen3moe.expert_group_count": 3,
        "qwen3moe.expert_group_used_count": 1,
      },
      "MOESWARM_ROUTING_CONFIG",
    );
    err(
      { "general.architecture": "qwen3moe", "qwen3moe.expert_count": "8", "qwen3moe.expert_used_count": 2 },
      "MOESWARM_ROUTING_CONFIG",
    );
    expect(() =>
      routingConfigFromGguf({ "general.architecture": "qwen3moe", "qwen3moe.expert_count": 0 }),
    ).toThrow(GgufError);
    expect(() => routingConfigFromGguf(null as unknown as Record<string, unknown>)).toThrow(DispatchError);
  });
});
