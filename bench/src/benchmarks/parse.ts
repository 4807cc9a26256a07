// `parse`: GGUF header parse time of a Qwen3.5-122B-A10B-shaped model (qwen35moe: 48 layers, 3 of 4
// linear-attention, 256 routed experts + a shared one, a 248k-token BPE vocabulary with merges),
// written header-only (sparse, ~70 GB apparent, no data on disk) by our writer, parsed by our
// reader and by @huggingface/gguf on the same file in the same run. A second file splits every
// expert into its own tensors (36k+ tensor infos) to weigh tensor-info parsing.
import { closeSync, openSync, readSync, rmSync, statSync } from "node:fs";
import { mkdtemp } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gguf } from "@huggingface/gguf";
import { mulberry32 } from "@moeswarm/core";
import {
  GgmlType,
  type GgufMetadataValue,
  GgufValueType,
  type GgufWriteTensor,
  ggufValue,
  readGguf,
  writeGguf,
} from "@moeswarm/shard";
import { type Benchmark, measure, type Row } from "../harness.js";

const ARCH = "qwen35moe";
const N_LAYER = 48;
const N_EMBD = 3072;
const N_HEAD = 32;
const N_HEAD_KV = 2;
const HEAD_DIM = 256;
const N_EXPERT = 256;
const N_EXPERT_USED = 8;
const N_FF_EXP = 1024;
const N_FF_SHEXP = 1024;
const N_VOCAB = 248_320;
const FULL_ATTENTION_INTERVAL = 4;
const SSM_D_INNER = 8192;
const SSM_D_STATE = 128;
const SSM_N_GROUP = 16;
const SSM_DT_RANK = 64;
const SSM_D_CONV = 4;

/** Byte-level-BPE-looking tokens: mostly short ASCII pieces, some with Ġ, some CJK. */
function vocabulary(): { tokens: string[]; merges: string[]; types: Int32Array } {
  const random = mulberry32(122);
  const alpha = "etaoinshrdlcumwfgypbvkjxqz";
  const piece = (n: number) => {
    let s = "";
    for (let i = 0; i < n; i++) s += alpha[Math.floor(random() * random() * alpha.length)];
    return s;
  };
  const tokens: string[] = [];
  for (let i = 0; i < 256; i++) tokens.push(String.fromCodePoint(i < 33 ? 0x100 + i : i));
  while (tokens.length < N_VOCAB - 300) {
    const r = random();
    if (r < 0.45) tokens.push(`Ġ${piece(2 + Math.floor(random() * 8))}`);
    else if (r < 0.9) tokens.push(piece(1 + Math.floor(random() * 9)));
    else
      tokens.push(
        String.fromCodePoint(0x4e00 + Math.floor(random() * 0x5000), 0x4e00 + Math.floor(random() * 0x5000)),
      );
  }
  for (let i = 0; tokens.length < N_VOCAB; i++) tokens.push(`<|special_${i}|>`);
  const merges: string[] = [];
  for (let i = 256; i < N_VOCAB - 300; i++)
    merges.push(`${piece(1 + Math.floor(random() * 4))} ${piece(1 + Math.floor(random() * 5))}`);
  const types = new Int32Array(N_VOCAB).fill(1);
  types.fill(3, N_VOCAB - 300);
  return { tokens, merges, types };
}

function metadata(): Map<string, GgufMetadataValue> {
  const v = ggufValue;
  const { tokens, merges, types } = vocabulary();
  return new Map<string, GgufMetadataValue>([
    ["general.architecture", v.str(ARCH)],
    ["general.type", v.str("model")],
    ["general.name", v.str("Qwen3.5 122B A10B (shape only)")],
    ["general.size_label", v.str("122B-A10B")],
    ["general.license", v.str("apache-2.0")],
    ["general.tags", v.array(GgufValueType.STRING, ["text-generation", "moe"])],
    [`${ARCH}.block_count`, v.u32(N_LAYER)],
    [`${ARCH}.context_length`, v.u32(262_144)],
    [`${ARCH}.embedding_length`, v.u32(N_EMBD)],
    [`${ARCH}.feed_forward_length`, v.u32(0)],
    [`${ARCH}.attention.head_count`, v.u32(N_HEAD)],
    [`${ARCH}.attention.head_count_kv`, v.u32(N_HEAD_KV)],
    [`${ARCH}.attention.key_length`, v.u32(HEAD_DIM)],
    [`${ARCH}.attention.value_length`, v.u32(HEAD_DIM)],
    [`${ARCH}.attention.layer_norm_rms_epsilon`, v.f32(1e-6)],
    [`${ARCH}.rope.freq_base`, v.f32(10_000_000)],
    [`${ARCH}.rope.dimension_count`, v.u32(64)],
    [`${ARCH}.rope.dimension_sections`, v.array(GgufValueType.INT32, Int32Array.from([11, 11, 10, 0]))],
    [`${ARCH}.expert_count`, v.u32(N_EXPERT)],
    [`${ARCH}.expert_used_count`, v.u32(N_EXPERT_USED)],
    [`${ARCH}.expert_feed_forward_length`, v.u32(N_FF_EXP)],
    [`${ARCH}.expert_shared_feed_forward_length`, v.u32(N_FF_SHEXP)],
    [`${ARCH}.ssm.conv_kernel`, v.u32(SSM_D_CONV)],
    [`${ARCH}.ssm.state_size`, v.u32(SSM_D_STATE)],
    [`${ARCH}.ssm.group_count`, v.u32(SSM_N_GROUP)],
    [`${ARCH}.ssm.time_step_rank`, v.u32(SSM_DT_RANK)],
    [`${ARCH}.ssm.inner_size`, v.u32(SSM_D_INNER)],
    [`${ARCH}.full_attention_interval`, v.u32(FULL_ATTENTION_INTERVAL)],
    ["tokenizer.ggml.model", v.str("gpt2")],
    ["tokenizer.ggml.pre", v.str("qwen35")],
    ["tokenizer.ggml.tokens", v.array(GgufValueType.STRING, tokens)],
    ["tokenizer.ggml.token_type", v.array(GgufValueType.INT32, types)],
    ["tokenizer.ggml.merges", v.array(GgufValueType.STRING, merges)],
    ["tokenizer.ggml.eos_token_id", v.u32(N_VOCAB - 300)],
    ["tokenizer.ggml.padding_token_id", v.u32(N_VOCAB - 299)],
    ["tokenizer.ggml.add_bos_token", v.bool(false)],
    [
      "tokenizer.chat_template",
      v.str("{%- for message in messages %}{{ message.content }}{%- endfor %}".repeat(120)),
    ],
    ["general.quantization_version", v.u32(2)],
    ["general.file_type", v.u32(15)],
  ]);
}

/** The tensors of llama.cpp's qwen35moe loader; `splitExperts` gives each expert its own tensors. */
function tensors(splitExperts: boolean): GgufWriteTensor[] {
  const t = (name: string, type: GgmlType, shape: number[]): GgufWriteTensor => ({ name, type, shape });
  const out: GgufWriteTensor[] = [
    t("token_embd.weight", GgmlType.Q6_K, [N_EMBD, N_VOCAB]),
    t("output_norm.weight", GgmlType.F32, [N_EMBD]),
    t("output.weight", GgmlType.Q6_K, [N_EMBD, N_VOCAB]),
  ];
  const keyDim = SSM_D_STATE * SSM_N_GROUP;
  const valueDim = SSM_D_INNER;
  for (let il = 0; il < N_LAYER; il++) {
    const b = `blk.${il}`;
    out.push(t(`${b}.attn_norm.weight`, GgmlType.F32, [N_EMBD]));
    out.push(t(`${b}.post_attention_norm.weight`, GgmlType.F32, [N_EMBD]));
    if ((il + 1) % FULL_ATTENTION_INTERVAL === 0) {
      out.push(t(`${b}.attn_q.weight`, GgmlType.Q8_0, [N_EMBD, HEAD_DIM * N_HEAD * 2]));
      out.push(t(`${b}.attn_k.weight`, GgmlType.Q8_0, [N_EMBD, HEAD_DIM * N_HEAD_KV]));
      out.push(t(`${b}.attn_v.weight`, GgmlType.Q8_0, [N_EMBD, HEAD_DIM * N_HEAD_KV]));
      out.push(t(`${b}.attn_output.weight`, GgmlType.Q8_0, [HEAD_DIM * N_HEAD, N_EMBD]));
      out.push(t(`${b}.attn_q_norm.weight`, GgmlType.F32, [HEAD_DIM]));
      out.push(t(`${b}.attn_k_norm.weight`, GgmlType.F32, [HEAD_DIM]));
    } else {
      out.push(t(`${b}.attn_qkv.weight`, GgmlType.Q8_0, [N_EMBD, keyDim * 2 + valueDim]));
      out.push(t(`${b}.attn_gate.weight`, GgmlType.Q8_0, [N_EMBD, valueDim]));
      out.push(t(`${b}.ssm_conv1d.weight`, GgmlType.F32, [SSM_D_CONV, keyDim * 2 + valueDim]));
      out.push(t(`${b}.ssm_dt.bias`, GgmlType.F32, [SSM_DT_RANK]));
      out.push(t(`${b}.ssm_a`, GgmlType.F32, [SSM_DT_RANK]));
      out.push(t(`${b}.ssm_beta.weight`, GgmlType.Q8_0, [N_EMBD, SSM_DT_RANK]));
      out.push(t(`${b}.ssm_alpha.weight`, GgmlType.Q8_0, [N_EMBD, SSM_DT_RANK]));
      out.push(t(`${b}.ssm_norm.weight`, GgmlType.F32, [SSM_D_STATE]));
      out.push(t(`${b}.ssm_out.weight`, GgmlType.Q8_0, [valueDim, N_EMBD]));
    }
    out.push(t(`${b}.ffn_gate_inp.weight`, GgmlType.F32, [N_EMBD, N_EXPERT]));
    if (splitExperts) {
      for (let e = 0; e < N_EXPERT; e++) {
        out.push(t(`${b}.ffn_gate.${e}.weight`, GgmlType.Q4_K, [N_EMBD, N_FF_EXP]));
        out.push(t(`${b}.ffn_up.${e}.weight`, GgmlType.Q4_K, [N_EMBD, N_FF_EXP]));
        out.push(t(`${b}.ffn_down.${e}.weight`, GgmlType.Q6_K, [N_FF_EXP, N_EMBD]));
      }
    } else {
      out.push(t(`${b}.ffn_gate_exps.weight`, GgmlType.Q4_K, [N_EMBD, N_FF_EXP, N_EXPERT]));
      out.push(t(`${b}.ffn_up_exps.weight`, GgmlType.Q4_K, [N_EMBD, N_FF_EXP, N_EXPERT]));
      out.push(t(`${b}.ffn_down_exps.weight`, GgmlType.Q6_K, [N_FF_EXP, N_EMBD, N_EXPERT]));
    }
    out.push(t(`${b}.ffn_gate_inp_shexp.weight`, GgmlType.F32, [N_EMBD]));
    out.push(t(`${b}.ffn_gate_shexp.weight`, GgmlType.Q8_0, [N_EMBD, N_FF_SHEXP]));
    out.push(t(`${b}.ffn_up_shexp.weight`, GgmlType.Q8_0, [N_EMBD, N_FF_SHEXP]));
    out.push(t(`${b}.ffn_down_shexp.weight`, GgmlType.Q8_0, [N_FF_SHEXP, N_EMBD]));
  }
  return out;
}

const ms = (ns: number) => ns / 1e6;

/** The first `n` bytes of a file (never the whole sparse file). */
function headerBytes(path: string, n: number): Uint8Array {
  const fd = openSync(path, "r");
  try {
    const out = new Uint8Array(n);
    let got = 0;
    while (got < n) {
      const r = readSync(fd, out, got, n - got, got);
      if (r === 0) break;
      got += r;
    }
    return out.subarray(0, got);
  } finally {
    closeSync(fd);
  }
}

export const parse: Benchmark = {
  name: "parse",
  description: "GGUF header parse of a 122B-shaped model: ours vs @huggingface/gguf on the same file",
  async run() {
    const dir = await mkdtemp(join(tmpdir(), "moeswarm-bench-parse-"));
    const rows: Row[] = [];
    const ratios: Record<string, number> = {};
    const notes: string[] = [];
    try {
      const meta = metadata();
      for (const [label, split] of [
        ["122b", false],
        ["122b-split-experts", true],
      ] as const) {
        const path = join(dir, `${label}.gguf`);
        const plan = await writeGguf({ metadata: meta, tensors: tensors(split) }, path, { headerOnly: true });
        const st = statSync(path);

        // Both must see the same file before their times mean anything.
        const ours = await readGguf(path);
        const theirs = await gguf(path, { allowLocalFile: true });
        const tokens = (theirs.metadata as Record<string, unknown>)["tokenizer.ggml.tokens"];
        if (
          theirs.tensorInfos.length !== ours.tensors.length ||
          theirs.tensorDataOffset !== ours.dataOffset ||
          !Array.isArray(tokens) ||
          tokens.length !== N_VOCAB ||
          theirs.tensorInfos.some(
            (t, i) => t.name !== ours.tensors[i]!.name || t.offset !== ours.tensors[i]!.offset,
          )
        ) {
          throw new Error(`${label}: @huggingface/gguf and our reader disagree on the header`);
        }

        const options = { minTimeMs: 3000, minSamples: 5, warmup: 2 };
        const a = await measure(`ours ${label}`, () => readGguf(path), options);
        const h = await measure(
          `@huggingface/gguf ${label}`,
          () => gguf(path, { allowLocalFile: true }),
          options,
        );
        const bytes = headerBytes(path, Number(plan.dataOffset));
        const b = await measure(
          `ours ${label} (bytes in memory)`,
          () => readGguf(bytes, { fileSize: plan.totalSize }),
          options,
        );
        const common = {
          tensors: ours.tensors.length,
          "header MB": plan.header.byteLength / 1e6,
          "file GB": Number(plan.totalSize) / 1e9,
        };
        rows.push({
          parser: "ours (file)",
          model: label,
          ...common,
          "median ms": ms(a.medianNs),
          "min ms": ms(a.minNs),
        });
        rows.push({
          parser: "ours (Uint8Array)",
          model: label,
          ...common,
          "median ms": ms(b.medianNs),
          "min ms": ms(b.minNs),
        });
        rows.push({
          parser: "@huggingface/gguf",
          model: label,
          ...common,
          "median ms": ms(h.medianNs),
          "min ms": ms(h.minNs),
        });
        ratios[`${label}: @huggingface/gguf / ours (time, file)`] = h.medianNs / a.medianNs;
        notes.push(
          `${label}: ${ours.tensors.length} tensors, ${ours.metadata.size} keys, header ${plan.header.byteLength} bytes, file ${st.size} bytes apparent / ${st.blocks * 512} on disk`,
        );
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
    notes.push(
      "ours returns typed metadata (every value with its GGUF type); @huggingface/gguf parses untyped, its fastest mode",
    );
    return { rows, ratios, notes };
  },
};
