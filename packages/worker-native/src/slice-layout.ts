import { GgufError, InvalidArgumentError } from "@moeswarm/core";
import {
  canDequantize,
  type GgmlType,
  type GgufHeader,
  type GgufMetadataValue,
  type GgufTensorInfo,
  GgufValueType,
  ggmlTypeName,
} from "@moeswarm/shard";
import { ACTIVATIONS, type Activation, type ExpertComputeInfo } from "./expert-compute.js";

// The same reading of a slice GGUF as native/compute/moeswarm-slice-load.cpp and -slice-layer.cpp (authoritative for the
// native paths): expert tensors per layer, shapes from the tensors themselves, the slice's keys
// `moeswarm.slice.layers` / `moeswarm.slice.experts`, the activation from the architecture.

export interface SliceTensor {
  name: string;
  type: GgmlType;
  /** ggml's ne, fastest-varying first. */
  shape: readonly number[];
  /** Offset of the data in the file. */
  offset: number;
  nbytes: number;
}

export interface SliceLayer {
  layer: number;
  nFf: number;
  gate?: SliceTensor;
  up?: SliceTensor;
  gateUp?: SliceTensor;
  down: SliceTensor;
  gateBias?: SliceTensor;
  upBias?: SliceTensor;
  gateUpBias?: SliceTensor;
  downBias?: SliceTensor;
  gateScale?: SliceTensor;
  upScale?: SliceTensor;
  downScale?: SliceTensor;
  /** SwiGLU clamp of llama.cpp (`<arch>.swiglu_clamp_exp`), 0 for none. */
  swigluLimit: number;
}

export interface SliceLayout {
  arch: string;
  act: Activation;
  nEmbd: number;
  nExpert: number;
  /** Global expert ids in slice order. */
  experts: number[];
  layers: SliceLayer[];
}

const MAX_EMBD = 65536;
const MAX_FF = 1 << 20;
const MAX_EXPERTS = 65536;
const MAX_LAYER = 65535;

const EXPERT_WEIGHT = /^blk\.(\d{1,6})\.ffn_(gate|up|down|gate_up)_exps\.weight$/;

function bad(
  code:
    | "MOESWARM_GGUF_BAD_TENSOR"
    | "MOESWARM_GGUF_NOT_MOE"
    | "MOESWARM_GGUF_UNSUPPORTED_TYPE"
    | "MOESWARM_GGUF_MISSING_KEY"
    | "MOESWARM_GGUF_TRUNCATED",
  message: string,
): GgufError {
  return new GgufError(code, message);
}

function actForArch(arch: string): Activation {
  switch (arch) {
    case "gemma4":
    case "grok":
    case "bert":
      return "gelu";
    case "gpt-oss":
    case "minimax-m3":
      return "swiglu_oai";
    case "nemotron_h":
    case "nemotron_h_moe":
      return "relu_sqr";
    case "smallthinker":
      return "relu";
    default:
      return "silu";
  }
}

function u32Array(value: GgufMetadataValue | undefined, key: string): number[] | undefined {
  if (value === undefined) return undefined;
  if (value.type !== GgufValueType.ARRAY)
    throw bad("MOESWARM_GGUF_MISSING_KEY", `${key} must be an array of uint32`);
  const out: number[] = [];
  for (const item of Array.from(value.value as ArrayLike<unknown>)) {
    const n = typeof item === "bigint" ? Number(item) : item;
    if (typeof n !== "number" || !Number.isInteger(n) || n < 0 || n > 0xffff_ffff) {
      throw bad("MOESWARM_GGUF_BAD_TENSOR", `${key} holds ${String(item)}, not a uint32`);
    }
    out.push(n);
  }
  if (out.length === 0) throw bad("MOESWARM_GGUF_BAD_TENSOR", `${key} is empty`);
  return out;
}

function sameShape(t: GgufTensorInfo, want: readonly number[]): boolean {
  const shape = [...t.shape];
  while (shape.length < want.length) shape.push(1);
  while (shape.length > want.length && shape[shape.length - 1] === 1) shape.pop();
  return shape.length === want.length && shape.every((v, i) => v === want[i]);
}

/** The layers that hold routed-expert tensors, checked against `moeswarm.slice.layers` when present. */
function expertLayerIds(header: GgufHeader): number[] {
  const found = new Set<number>();
  for (const t of header.tensors) {
    const m = EXPERT_WEIGHT.exec(t.name);
    if (m && Number(m[1]) <= MAX_LAYER) found.add(Number(m[1]));
  }
  const layerIds = [...found].sort((a, b) => a - b);
  if (layerIds.length === 0)
    throw bad("MOESWARM_GGUF_NOT_MOE", "the file has no routed-expert tensors (blk.N.ffn_*_exps.weight)");
  const listed = u32Array(header.metadata.get("moeswarm.slice.layers"), "moeswarm.slice.layers");
  if (listed) {
    const sorted = [...listed].sort((a, b) => a - b);
    if (new Set(sorted).size !== sorted.length)
      throw bad("MOESWARM_GGUF_BAD_TENSOR", "moeswarm.slice.layers lists a layer twice");
    if (sorted.length !== layerIds.length || sorted.some((v, i) => v !== layerIds[i])) {
      throw bad(
        "MOESWARM_GGUF_BAD_TENSOR",
        `moeswarm.slice.layers lists ${sorted.length} layers but the file has expert tensors for ${layerIds.length} (they must match)`,
      );
    }
  }
  return layerIds;
}

/** What every layer must agree on; the first layer read sets it (zeros until then). */
interface SliceDims {
  nEmbd: number;
  nExpert: number;
}

/** One tensor of a layer, when present: shape, type (biases and scales are f32) and extent checked. */
function sliceTensor(
  t: GgufTensorInfo | undefined,
  shape: number[],
  weight: boolean,
  fileSize: number | undefined,
): SliceTensor | undefined {
  if (!t) return undefined;
  if (!sameShape(t, shape)) {
    throw bad(
      "MOESWARM_GGUF_BAD_TENSOR",
      `${t.name} has shape [${t.shape.join(", ")}], expected [${shape.join(", ")}]`,
    );
  }
  if (!weight && t.type !== 0) {
    throw bad("MOESWARM_GGUF_UNSUPPORTED_TYPE", `${t.name} has type ${ggmlTypeName(t.type)}, expected f32`);
  }
  const offset = Number(t.absoluteOffset);
  const nbytes = Number(t.nbytes);
  if (fileSize !== undefined && offset + nbytes > fileSize) {
    throw bad(
      "MOESWARM_GGUF_TRUNCATED",
      `${t.name} needs bytes [${offset}, ${offset + nbytes}) but the file has ${fileSize}`,
    );
  }
  return { name: t.name, type: t.type, shape: t.shape, offset, nbytes };
}

/**
 * Checks one layer's expert tensors: the down projection fixes n_ff, n_embd and the expert count
 * (which must match `dims`, set by the first layer), the other tensors must have the shapes they imply.
 */
function sliceLayer(
  il: number,
  byName: ReadonlyMap<string, GgufTensorInfo>,
  fileSize: number | undefined,
  dims: SliceDims,
): SliceLayer {
  const get = (suffix: string) => byName.get(`blk.${il}.${suffix}`);
  const down = get("ffn_down_exps.weight");
  if (!down) throw bad("MOESWARM_GGUF_NOT_MOE", `layer ${il} has no blk.${il}.ffn_down_exps.weight`);
  const [nFf = 0, e = 0, x = 0, extra = 1] = down.shape;
  if (
    down.shape.length > 4 ||
    extra !== 1 ||
    nFf < 1 ||
    nFf > MAX_FF ||
    e < 1 ||
    e > MAX_EMBD ||
    x < 1 ||
    x > MAX_EXPERTS
  ) {
    throw bad(
      "MOESWARM_GGUF_BAD_TENSOR",
      `blk.${il}.ffn_down_exps.weight has shape [${down.shape.join(", ")}]: expected [n_ff, n_embd, n_expert]`,
    );
  }
  if (dims.nEmbd === 0) {
    dims.nEmbd = e;
    dims.nExpert = x;
  } else if (dims.nEmbd !== e || dims.nExpert !== x) {
    throw bad(
      "MOESWARM_GGUF_BAD_TENSOR",
      `layer ${il} has n_embd ${e} and ${x} experts, other layers ${dims.nEmbd} and ${dims.nExpert}`,
    );
  }
  const take = (suffix: string, shape: number[], weight: boolean) =>
    sliceTensor(get(suffix), shape, weight, fileSize);
  const L: SliceLayer = {
    layer: il,
    nFf,
    down: take("ffn_down_exps.weight", [nFf, e, x], true)!,
    swigluLimit: 0,
  };
  const opt = (key: keyof SliceLayer, suffix: string, shape: number[], weight: boolean) => {
    const t = take(suffix, shape, weight);
    if (t) (L as unknown as Record<string, SliceTensor>)[key] = t;
  };
  opt("gate", "ffn_gate_exps.weight", [e, nFf, x], true);
  opt("up", "ffn_up_exps.weight", [e, nFf, x], true);
  opt("gateUp", "ffn_gate_up_exps.weight", [e, 2 * nFf, x], true);
  opt("gateBias", "ffn_gate_exps.bias", [nFf, x], false);
  opt("upBias", "ffn_up_exps.bias", [nFf, x], false);
  opt("gateUpBias", "ffn_gate_up_exps.bias", [2 * nFf, x], false);
  opt("downBias", "ffn_down_exps.bias", [e, x], false);
  opt("gateScale", "ffn_gate_exps.scale", [x], false);
  opt("upScale", "ffn_up_exps.scale", [x], false);
  opt("downScale", "ffn_down_exps.scale", [x], false);
  if (L.gateUp && (L.gate || L.up)) {
    throw bad(
      "MOESWARM_GGUF_BAD_TENSOR",
      `layer ${il} has both ffn_gate_up_exps and separate gate/up expert tensors`,
    );
  }
  if (!L.gateUp && !L.up)
    throw bad("MOESWARM_GGUF_NOT_MOE", `layer ${il} has no ffn_up_exps or ffn_gate_up_exps`);
  if ((L.gateBias || L.gateScale) && !L.gate)
    throw bad("MOESWARM_GGUF_BAD_TENSOR", `layer ${il} has a gate bias/scale but no ffn_gate_exps`);
  if ((L.upBias || L.upScale) && !L.up)
    throw bad("MOESWARM_GGUF_BAD_TENSOR", `layer ${il} has an up bias/scale but no ffn_up_exps`);
  if (L.gateUpBias && !L.gateUp)
    throw bad("MOESWARM_GGUF_BAD_TENSOR", `layer ${il} has ffn_gate_up_exps.bias but no weight`);
  return L;
}

/** Global expert ids in slice order: `moeswarm.slice.experts`, or 0..n-1 for a full model. */
function sliceExperts(header: GgufHeader, nExpert: number): number[] {
  const experts = u32Array(header.metadata.get("moeswarm.slice.experts"), "moeswarm.slice.experts") ?? [
    ...Array(nExpert).keys(),
  ];
  if (experts.length !== nExpert) {
    throw bad(
      "MOESWARM_GGUF_BAD_TENSOR",
      `moeswarm.slice.experts lists ${experts.length} experts but the tensors hold ${nExpert}`,
    );
  }
  if (new Set(experts).size !== experts.length)
    throw bad("MOESWARM_GGUF_BAD_TENSOR", "moeswarm.slice.experts lists an expert twice");
  if (experts.some((id) => id > 0x7fff_ffff))
    throw bad("MOESWARM_GGUF_BAD_TENSOR", "an expert id does not fit an int32");
  return experts;
}

/** The activation: the option, or the architecture's; architectures not supported yet are refused. */
function sliceActivation(arch: string, act: Activation | "auto" | undefined): Activation {
  if (arch === "kimi-k3")
    throw bad("MOESWARM_GGUF_BAD_TENSOR", "kimi-k3's SITU activation is not supported yet");
  const actOption = act ?? "auto";
  if (actOption !== "auto" && !ACTIVATIONS.includes(actOption)) {
    throw new InvalidArgumentError(`unknown activation ${String(actOption)}`);
  }
  return actOption === "auto" ? actForArch(arch) : actOption;
}

/** Checks each layer's gating against the activation and sets its SwiGLU clamp. */
function applyActivation(header: GgufHeader, arch: string, act: Activation, layers: SliceLayer[]): void {
  const clamp = arch ? header.metadata.get(`${arch}.swiglu_clamp_exp`) : undefined;
  for (const L of layers) {
    const hasGate = Boolean(L.gate || L.gateUp);
    if (act === "relu_sqr" && hasGate)
      throw bad("MOESWARM_GGUF_BAD_TENSOR", `layer ${L.layer}: gated squared ReLU is not implemented`);
    if (act === "swiglu_oai" && !hasGate)
      throw bad("MOESWARM_GGUF_BAD_TENSOR", `layer ${L.layer}: swiglu_oai needs a gate tensor`);
    if (
      act === "silu" &&
      L.gate &&
      clamp?.type === GgufValueType.ARRAY &&
      clamp.itemType === GgufValueType.FLOAT32
    ) {
      const limit = (clamp.value as ArrayLike<number>)[L.layer] ?? 0;
      if (limit > 1e-6) {
        if (arch === "dflash")
          throw bad("MOESWARM_GGUF_BAD_TENSOR", "dflash's clamped SwiGLU is not supported yet");
        L.swigluLimit = limit;
      }
    }
  }
}

/**
 * Reads the expert layout of a slice (or full model) GGUF header. Throws GgufError for a file the
 * native loader would refuse, so every backend agrees on what a slice holds.
 */
export function sliceLayout(header: GgufHeader, options: { act?: Activation | "auto" } = {}): SliceLayout {
  const fileSize = header.fileSize === undefined ? undefined : Number(header.fileSize);
  const byName = new Map(header.tensors.map((t) => [t.name, t]));
  const archValue = header.metadata.get("general.architecture");
  const arch = archValue?.type === GgufValueType.STRING ? archValue.value : "";
  const dims: SliceDims = { nEmbd: 0, nExpert: 0 };
  const layers = expertLayerIds(header).map((il) => sliceLayer(il, byName, fileSize, dims));
  const experts = sliceExperts(header, dims.nExpert);
  const act = sliceActivation(arch, options.act);
  applyActivation(header, arch, act, layers);
  return { arch, act, nEmbd: dims.nEmbd, nExpert: dims.nExpert, experts, layers };
}

/** The types a TypeScript compute can read (shard's dequantisers). */
export function layoutDequantizable(layout: SliceLayout): string | undefined {
  for (const L of layout.layers) {
    for (const t of [L.gate, L.up, L.gateUp, L.down]) {
      if (t && !canDequantize(t.type))
        return `${t.name} has type ${ggmlTypeName(t.type)}, which shard cannot dequantise`;
    }
  }
  return undefined;
}

/** The info fields a layout determines. */
export function layoutInfo(layout: SliceLayout): Omit<ExpertComputeInfo, "backend"> {
  return {
    layers: layout.layers.map((L) => L.layer),
    experts: [...layout.experts],
    nEmbd: layout.nEmbd,
    nFf: layout.layers[0]!.nFf,
    tensors: layout.layers.map((L) => ({
      layer: L.layer,
      nFf: L.nFf,
      gate: L.gate ? ggmlTypeName(L.gate.type) : null,
      up: ggmlTypeName((L.gateUp ?? L.up)!.type),
      down: ggmlTypeName(L.down.type),
      merged: Boolean(L.gateUp),
    })),
    act: layout.act,
    arch: layout.arch,
  };
}
