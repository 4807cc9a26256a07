import { InvalidArgumentError } from "@moeswarm/core";

/** Which MoE layers go to the swarm: "all", or block indices. */
export type LayerSelection = "all" | readonly number[];

const MAX_LAYER = 4095; // the plugin's bound (MOESWARM_MAX_LAYERS - 1)

/**
 * Parses "all", "none", or a list like "0,1,4-7" (what `MOESWARM_LAYERS` takes) into a
 * selection; an array of layer numbers is checked and sorted.
 */
export function parseLayerSelection(input: string | LayerSelection): LayerSelection {
  if (input === "all") return "all";
  if (Array.isArray(input)) return checkLayers(input as readonly number[]);
  if (typeof input !== "string")
    throw new InvalidArgumentError('layers must be "all", a list like "0,1,4-7" or an array of numbers');
  const text = input.trim();
  if (text === "" || text === "none") return [];
  const out = new Set<number>();
  for (const part of text.split(",")) {
    const m = /^\s*(\d{1,4})\s*(?:-\s*(\d{1,4})\s*)?$/.exec(part);
    if (!m)
      throw new InvalidArgumentError(
        `bad layer list ${JSON.stringify(input)}: expected "all" or items like 3 or 4-7`,
      );
    const a = Number(m[1]);
    const b = m[2] === undefined ? a : Number(m[2]);
    if (a > b || b > MAX_LAYER)
      throw new InvalidArgumentError(`bad layer range ${part.trim()} (0..${MAX_LAYER}, ascending)`);
    for (let l = a; l <= b; l++) out.add(l);
  }
  return [...out].sort((x, y) => x - y);
}

function checkLayers(layers: readonly number[]): number[] {
  for (const l of layers) {
    if (!Number.isInteger(l) || l < 0 || l > MAX_LAYER)
      throw new InvalidArgumentError(`layer ${String(l)} is not in 0..${MAX_LAYER}`);
  }
  return [...new Set(layers)].sort((x, y) => x - y);
}

/** The `MOESWARM_LAYERS` text of a selection: "all", "none", or ranges "0-3,6". */
export function formatLayerSelection(selection: LayerSelection): string {
  if (selection === "all") return "all";
  const layers = checkLayers(selection);
  if (layers.length === 0) return "none";
  const parts: string[] = [];
  let start = layers[0]!;
  let prev = start;
  for (const l of [...layers.slice(1), Number.NaN]) {
    if (l === prev + 1) {
      prev = l;
      continue;
    }
    parts.push(start === prev ? String(start) : `${start}-${prev}`);
    start = l;
    prev = l;
  }
  return parts.join(",");
}

/**
 * The llama-server `-ot` override that sends these layers' routed-expert tensors (weights, biases,
 * scales) to the MOESWARM buffer type, e.g. `blk\.(0|1)\.ffn_(gate|up|down|gate_up)_exps\..*=MOESWARM`.
 */
export function moeswarmOverride(selection: LayerSelection): string {
  const tensors = "ffn_(gate|up|down|gate_up)_exps\\..*";
  if (selection === "all") return `blk\\.\\d+\\.${tensors}=MOESWARM`;
  const layers = checkLayers(selection);
  if (layers.length === 0) throw new InvalidArgumentError("an -ot override needs at least one layer");
  return `blk\\.(${layers.join("|")})\\.${tensors}=MOESWARM`;
}
