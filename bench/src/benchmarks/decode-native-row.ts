// The decode benchmark's native-plane row, from the plugin's own stats (what the demo's `native`
// line prints): per round, then over the rounds. And the token check every swarm row's rounds pass.
import type { LogitsHarnessResult } from "@moeswarm/backbone";
import { median, type Row } from "../harness.js";

/** The per-layer goal of the native plane above the worker's compute (docs/architecture.md §4). */
export const NATIVE_GOAL_MS = 0.1;

/** One round of the native swarm, in ms. */
export interface NativeRound {
  msPerToken: number;
  /** The plugin's round trips per token: its per-layer p50s summed (the bridge row's definition). */
  pluginMs: number;
  /** p50 over the native splits of one layer's round trip, and of its part above the worker's compute. */
  roundTripMs: number;
  aboveComputeMs: number;
  splits: number;
  nativeSplits: number;
  fallbacks: number;
}

/** A round's figures; throws when the decode failed or no split went native. */
export function nativeRound(run: LogitsHarnessResult, nPredict: number): NativeRound {
  if (!run.ok) throw new Error(`the native swarm's decode failed:\n${run.stderr}`);
  const native = run.plugin?.native;
  if (!run.plugin || !native || native.splits === 0) {
    throw new Error(`no split went native (plugin stats: ${JSON.stringify(run.plugin)}):\n${run.stderr}`);
  }
  return {
    msPerToken: run.decodeMs / nPredict,
    pluginMs: Object.values(run.plugin.layers).reduce((sum, l) => sum + l.p50Us / 1000, 0),
    roundTripMs: native.roundTripP50Us / 1000,
    aboveComputeMs: native.overheadP50Us / 1000,
    splits: run.plugin.splits,
    nativeSplits: native.splits,
    fallbacks: native.fallbacks,
  };
}

/** Throws unless the swarm decoded the plain run's tokens: a benchmark of wrong tokens measures nothing. */
export function checkSameTokens(plain: LogitsHarnessResult, swarm: LogitsHarnessResult, what: string): void {
  const i = plain.tokens.findIndex((t, j) => swarm.tokens[j] !== t);
  if (i >= 0 || swarm.tokens.length !== plain.tokens.length) {
    const at = i >= 0 ? i : Math.min(plain.tokens.length, swarm.tokens.length);
    throw new Error(
      `${what}: tokens differ from the plain run's at ${at} (plain ${plain.tokens.slice(at, at + 4).join(",")}, ` +
        `swarm ${swarm.tokens.slice(at, at + 4).join(",")})`,
    );
  }
}

const range = (xs: readonly number[], digits: number) =>
  `${Math.min(...xs).toFixed(digits)}-${Math.max(...xs).toFixed(digits)}`;

/**
 * The row (ms per decoded token; the per-layer figures summed over the `layers` remote layers as the
 * bridge row's columns are: each is the medians' over the rounds), its ratios and notes.
 */
export function nativeRow(
  mode: string,
  rounds: readonly NativeRound[],
  o: { layers: number; plainMsTok: number; bridgeMsTok: number },
): { row: Row; ratios: Record<string, number>; notes: string[] } {
  const msTok = median(rounds.map((r) => r.msPerToken));
  const roundTrip = median(rounds.map((r) => r.roundTripMs));
  const above = median(rounds.map((r) => r.aboveComputeMs));
  const sum = (pick: (r: NativeRound) => number) => rounds.reduce((s, r) => s + pick(r), 0);
  return {
    row: {
      mode,
      "tok/s": 1000 / msTok,
      "ms/token": msTok,
      backbone: msTok - median(rounds.map((r) => r.pluginMs)),
      "native round trip": roundTrip * o.layers,
      "native above compute": above * o.layers,
      "native/all splits": `${sum((r) => r.nativeSplits)}/${sum((r) => r.splits)}`,
      "fell back": sum((r) => r.fallbacks),
    },
    ratios: {
      native_vs_plain_tokens_per_s: o.plainMsTok / msTok,
      native_vs_bridge_tokens_per_s: o.bridgeMsTok / msTok,
      native_above_compute_per_layer_vs_goal: above / NATIVE_GOAL_MS,
    },
    notes: [
      `native plane, per native layer (the demo's \`native\` line): p50 ${roundTrip.toFixed(3)} ms round trip, ` +
        `${above.toFixed(3)} ms above the worker's compute (goal ${NATIVE_GOAL_MS} ms); over the rounds ` +
        `${range(
          rounds.map((r) => r.roundTripMs),
          3,
        )} and ${range(
          rounds.map((r) => r.aboveComputeMs),
          3,
        )} ms, ms/token ${range(
          rounds.map((r) => r.msPerToken),
          2,
        )}`,
    ],
  };
}
