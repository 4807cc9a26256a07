// Issue 15's goals for `pnpm bench roundtrip`, read off the run's ratios: one line per goal with
// each token count's figure and whether it is met, so a reader need not find the goal's ratio
// among forty others and compare it by eye.

/** A goal: the ratio that measures it (its name before ", N tok") and the most it may be. */
export interface Goal {
  readonly name: string;
  readonly ratio: string;
  readonly atMost: number;
}

export const ROUNDTRIP_GOALS: readonly Goal[] = [
  {
    name: "relay over TLS (as deployed) <= 1.2x the blind TLS relay",
    ratio: "relay (TLS)/blind relay (TLS) floor, interleaved",
    atMost: 1.2,
  },
  {
    name: "relay over ws:// <= 1.2x the blind relay",
    ratio: "relay/blind-relay floor, interleaved",
    atMost: 1.2,
  },
  {
    name: "direct link (TLS) <= 1.2x the Node WebSocket echo over TLS",
    ratio: "direct link (TLS)/Node wss floor, interleaved",
    atMost: 1.2,
  },
  {
    name: "direct (ws://) <= 1.2x the Node WebSocket echo",
    ratio: "direct/Node ws floor, interleaved",
    atMost: 1.2,
  },
  // the ratio is (p50 above compute) / 0.1 ms
  {
    name: "native <= 0.1 ms above the worker's compute",
    ratio: "native above compute/0.1 ms goal",
    atMost: 1,
  },
];

/**
 * One line per goal that the run measured: "<goal>: 1 tok 1.224 (not met), 8 tok 1.131 (met)".
 * A goal with no figure in `ratios` (its path was not built, e.g. native without its binaries)
 * says so.
 */
export function goalLines(
  ratios: Readonly<Record<string, number>>,
  tokens: readonly number[],
  goals: readonly Goal[] = ROUNDTRIP_GOALS,
): string[] {
  return goals.map((goal) => {
    const figures = tokens.flatMap((n) => {
      const value = ratios[`${goal.ratio}, ${n} tok`];
      if (value === undefined || !Number.isFinite(value)) return [];
      return [`${n} tok ${value.toFixed(3)} (${value <= goal.atMost ? "met" : "not met"})`];
    });
    return `goal: ${goal.name}: ${figures.length > 0 ? figures.join(", ") : "not measured in this run"}`;
  });
}
