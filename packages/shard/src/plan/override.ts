import { InvalidArgumentError } from "@moeswarm/core";

/**
 * Routed-expert tensors as llama.cpp's `--n-cpu-moe`/`--cpu-moe` see them: common/common.h
 * LLM_FFN_EXPS_REGEX is `\.ffn_(up|down|gate|gate_up)_(ch|)exps` (any suffix: weight, bias,
 * scale...), prefixed with `blk\.N` per layer.
 */
export const EXPERT_TENSOR_NAME = /^blk\.(\d{1,9})\.ffn_(up|down|gate|gate_up)_(ch|)exps(?:\.(.+))?$/;

/** The parts of a routed-expert tensor name, or undefined for any other tensor. */
export function parseExpertTensorName(
  name: string,
): { layer: number; projection: string; chunked: boolean; suffix: string } | undefined {
  const m = EXPERT_TENSOR_NAME.exec(name);
  if (!m) return undefined;
  return { layer: Number(m[1]), projection: m[2]!, chunked: m[3] === "ch", suffix: m[4] ?? "" };
}

function digitClass(lo: number, hi: number): string {
  if (lo === hi) return String(lo);
  if (hi === lo + 1) return `[${lo}${hi}]`;
  return `[${lo}-${hi}]`;
}

// Alternatives matching exactly the decimal numerals of [a, b] (same digit count, no leading
// zeros), the classic split at multiples of ten: 38..47 -> 3[89], 4[0-7].
function sameLength(a: number, b: number): string[] {
  if (a === b) return [String(a)];
  if (a < 10) return [digitClass(a, b)];
  const out: string[] = [];
  let lo = a;
  let hi = b;
  let tail: string[] = [];
  if (Math.floor(lo / 10) === Math.floor(hi / 10)) {
    return [`${Math.floor(lo / 10)}${digitClass(lo % 10, hi % 10)}`];
  }
  if (lo % 10 !== 0) {
    out.push(`${Math.floor(lo / 10)}${digitClass(lo % 10, 9)}`);
    lo = lo - (lo % 10) + 10;
  }
  if (hi % 10 !== 9) {
    tail = [`${Math.floor(hi / 10)}${digitClass(0, hi % 10)}`];
    hi = hi - (hi % 10) - 1;
  }
  if (lo <= hi) {
    for (const p of sameLength(lo / 10, (hi - 9) / 10)) out.push(`${p}[0-9]`);
  }
  return [...out, ...tail];
}

/** Regex alternatives (no anchors, no quantifiers, no commas) matching exactly the numbers a..b. */
export function numberRangePatterns(a: number, b: number): string[] {
  if (!Number.isSafeInteger(a) || !Number.isSafeInteger(b) || a < 0 || b < a) {
    throw new InvalidArgumentError(`bad number range ${a}..${b}`);
  }
  const out: string[] = [];
  let lo = a;
  while (lo <= b) {
    const digits = String(lo).length;
    const top = Math.min(b, 10 ** digits - 1);
    out.push(...sameLength(lo, top));
    lo = top + 1;
  }
  return out;
}

/** Maximal runs of consecutive values of a sorted list. */
export function runsOf(values: readonly number[]): Array<[number, number]> {
  const runs: Array<[number, number]> = [];
  for (const v of values) {
    const last = runs[runs.length - 1];
    if (last && v === last[1] + 1) last[1] = v;
    else runs.push([v, v]);
  }
  return runs;
}

/** A regex group body matching exactly the given non-negative integers: `3[89]|4[0-7]`. */
export function numberSetPattern(values: readonly number[]): string {
  const sorted = [...new Set(values)].sort((x, y) => x - y);
  return runsOf(sorted)
    .flatMap(([a, b]) => numberRangePatterns(a, b))
    .join("|");
}

function group(alternatives: string): string {
  return alternatives.includes("|") ? `(${alternatives})` : alternatives;
}

/**
 * The `--override-tensor` pattern for the routed-expert tensors of `layers`, given every
 * expert tensor name of the model (to list exactly the projections and suffixes it has):
 * `^blk\.(3[89]|4[0-7])\.ffn_(up|down|gate)_exps\.weight$`. llama.cpp compiles it with
 * std::regex (ECMAScript) and keeps the first override whose pattern `regex_search`es a name;
 * the pattern has no `,` and no `=`, which `-ot` parsing would split on.
 */
export function expertOverridePattern(
  layers: readonly number[],
  expertTensorNames: readonly string[],
): string {
  if (layers.length === 0) throw new InvalidArgumentError("no layers to override");
  const wanted = new Set(layers);
  const projections = new Set<string>();
  const suffixes = new Set<string>();
  const infixes = new Set<string>();
  for (const name of expertTensorNames) {
    const p = parseExpertTensorName(name);
    if (!p || !wanted.has(p.layer)) continue;
    projections.add(p.projection);
    suffixes.add(p.suffix);
    infixes.add(p.chunked ? "ch" : "");
  }
  if (projections.size === 0) {
    throw new InvalidArgumentError(`layers ${layers.join(",")} have no routed-expert tensors`);
  }
  // gate_up before gate only for readability: the regex backtracks either way.
  const order = ["gate_up", "up", "down", "gate"];
  const proj = group(order.filter((p) => projections.has(p)).join("|"));
  const infix = infixes.size === 1 ? [...infixes][0]! : "(ch|)";
  const escapeRegex = (s: string) => s.replace(/[.*+?^${}()|[\]\\]/g, "\\$&");
  const suffix = suffixes.has("") ? "" : `\\.${group([...suffixes].sort().map(escapeRegex).join("|"))}$`;
  // `$` only with a suffix list: a name like blk.3.ffn_up_exps.weight.lora_a must not be caught
  // by an override meant for the weights when the model has such tensors in other layers.
  return `^blk\\.${group(numberSetPattern(layers))}\\.ffn_${proj}_${infix}exps${suffix}`;
}

/** llama.cpp's per-layer `--n-cpu-moe` pattern (common/common.h llm_ffn_block_regex). */
export function nCpuMoePattern(layer: number): string {
  return `blk\\.${layer}\\.ffn_(up|down|gate|gate_up)_(ch|)exps`;
}

/**
 * The `--n-cpu-moe N` that moves exactly the tensors of `ramNames` to CPU, or undefined. llama.cpp
 * (common/arg.cpp) turns N into the overrides `blk\.i\.ffn_(up|down|gate|gate_up)_(ch|)exps=CPU`
 * for i in 0..N-1 — the first N blocks — matched with regex_search against every tensor it
 * loads (`names`); the result is checked by matching those same patterns, not assumed.
 */
export function equivalentNCpuMoe(
  names: readonly string[],
  ramNames: ReadonlySet<string>,
): number | undefined {
  if (ramNames.size === 0) return undefined;
  let n = 0;
  for (const name of ramNames) {
    const m = /^blk\.(\d+)\./.exec(name);
    if (!m) return undefined;
    n = Math.max(n, Number(m[1]) + 1);
  }
  // Layer numbers come from tensor names: never build more patterns than llama.cpp has layers.
  if (n > 512) return undefined;
  const patterns = Array.from({ length: n }, (_, i) => new RegExp(nCpuMoePattern(i)));
  for (const name of names) {
    if (patterns.some((re) => re.test(name)) !== ramNames.has(name)) return undefined;
  }
  return n;
}
