import type { BridgeMetrics, LogitsHarnessResult } from "@moeswarm/backbone";
import { formatBytes } from "@moeswarm/worker";
import type { WorkerView } from "./workers.js";

export interface DemoReport {
  prompt: string;
  plain: LogitsHarnessResult;
  swarm: LogitsHarnessResult;
  /** Generated tokens equal at the same position. */
  identical: number;
  logitsIdentical: boolean;
  tokPerSecond: { plain: number; swarm: number };
  bridge: BridgeMetrics;
  workers: readonly WorkerView[];
  /** The bridge's trust (default "verify"): under "own" nothing is verified or audited. */
  trust?: "verify" | "own";
  /**
   * Cross-backend runs only: the first differing token was judged a near-tie (verdict.ts), so the
   * headline says "OK (near-tie)" rather than "MISMATCH".
   */
  nearTie?: boolean;
}

const fmt = (v: number, digits = 1) => (Number.isFinite(v) ? v.toFixed(digits) : "-");

/** "layer 3" for one layer, "layers 0:3" for several. */
function layersOf(range: string): string {
  const [a, b] = range.split(":").map(Number);
  return b === (a as number) + 1 ? `layer ${a}` : `layers ${range}`;
}

const TEXT_WIDTH = 88;
const INDENT = " ".repeat(10);

/**
 * Text as a person reads it: its own line breaks kept, long lines wrapped at spaces, indented
 * under a label; control characters (the model never generates them, but a prompt may carry them)
 * shown escaped rather than sent to the terminal.
 */
function textBlock(out: (line?: string) => void, label: string, text: string): void {
  const visible = text.replace(/(?!\n)\p{Cc}/gu, (c) => JSON.stringify(c).slice(1, -1));
  const lines: string[] = [];
  for (const paragraph of visible.split("\n")) {
    let line = "";
    for (const word of paragraph.split(/(?<= )/)) {
      if (line.length > 0 && line.length + word.trimEnd().length > TEXT_WIDTH) {
        lines.push(line.trimEnd());
        line = "";
      }
      line += word;
    }
    lines.push(line);
  }
  for (const [i, line] of lines.entries()) out(`${i === 0 ? label.padEnd(INDENT.length) : INDENT}${line}`);
}

/** What a person wants to read after the run: the text, the verdict, the costs, who did what. */
export function printReport(out: (line?: string) => void, r: DemoReport): void {
  const n = r.plain.tokens.length;
  out();
  textBlock(out, "prompt", r.prompt);
  // the continuation as llama.cpp detokenised it, right after the prompt's last character
  textBlock(out, "plain", `...${r.plain.text}`);
  textBlock(out, "swarm", `...${r.swarm.text}`);
  out();
  const verdict = r.identical === n && r.swarm.tokens.length === n;
  out(
    `${(verdict ? "OK" : r.nearTie ? "OK (near-tie)" : "MISMATCH").padEnd(9)} ${r.identical}/${n} tokens identical to the local run` +
      `; logits ${r.logitsIdentical ? "bit-identical" : "differ"} (${r.plain.nVocab} x ${n + 1} floats compared)`,
  );
  const ratio = r.tokPerSecond.swarm / r.tokPerSecond.plain;
  out(
    `speed     local ${fmt(r.tokPerSecond.plain)} tok/s, swarm ${fmt(r.tokPerSecond.swarm)} tok/s ` +
      `(ratio ${fmt(ratio, 2)}: ${fmt((ratio - 1) * 100, 0)}%)`,
  );
  out();
  out(
    r.bridge.native?.enabled
      ? "round trip per remote layer (the plugin's: native plugin -> worker, else through the bridge)"
      : "round trip per remote layer (plugin -> bridge -> workers -> bridge -> plugin)",
  );
  const plugin = r.swarm.plugin?.layers ?? {};
  for (const [layer, s] of Object.entries(plugin).sort((a, b) => Number(a[0]) - Number(b[0]))) {
    const bridge = r.bridge.layers.find((l) => l.layer === Number(layer));
    out(
      `  layer ${layer.padStart(2)}  ${String(s.count).padStart(4)} requests  p50 ${fmt(s.p50Us / 1000, 2)} ms` +
        `  p99 ${fmt(s.p99Us / 1000, 2)} ms` +
        (bridge ? `  (bridge p50 ${fmt(bridge.p50Ms, 2)} ms, p99 ${fmt(bridge.p99Ms, 2)} ms)` : ""),
    );
  }
  printNative(out, r);
  out();
  out("workers");
  for (const w of r.workers) {
    const owner = r.bridge.dispatch.owners[w.id];
    const native = r.bridge.native?.workers[w.id];
    const slice =
      w.slices.length > 0
        ? w.slices.map((x) => `${layersOf(x.layers)} experts ${x.experts}`).join(" + ")
        : "no slice";
    const got = w.reusedCache
      ? `${w.slices.length > 1 ? "slices" : "slice"} reused from its cache (verified)`
      : `downloaded ${formatBytes(w.downloadedBytes)} in ${fmt(w.downloadMs / 1000, 2)} s`;
    out(
      `  ${w.id}  ${slice}, ${got}, ${w.backend ?? "?"} compute; computed ${(owner?.slots ?? 0) + (native?.expertTokens ?? 0)} expert-tokens ` +
        `in ${owner?.requests ?? 0} requests` +
        (native ? ` + ${native.splits} native splits (${native.expertTokens} expert-tokens)` : ""),
    );
  }
  const d = r.bridge.dispatch;
  out(
    `  backbone  ${r.bridge.requests} bridge requests, ${formatBytes(d.bytesOut)} out / ${formatBytes(d.bytesIn)} in over the relay, ` +
      `${r.bridge.failovers} failovers, ${r.bridge.fallbacks} local fallbacks, ${r.bridge.audits} local audits`,
  );
  printVerification(out, r.bridge, r.trust ?? "verify");
  if (r.swarm.plugin) {
    out(
      `  plugin    ${r.swarm.plugin.splits} splits, ${formatBytes(r.swarm.plugin.weightsDroppedBytes)} of expert weights never kept ` +
        `(backbone RSS ${fmt(r.swarm.rssLoadKiB / 1024, 1)} MiB vs ${fmt(r.plain.rssLoadKiB / 1024, 1)} MiB plain)`,
    );
  }
}

/**
 * The native data plane: how many splits went straight from the plugin to a worker, and what a
 * native layer costs beyond the worker's compute (the plugin's own figures, p50).
 */
function printNative(out: (line?: string) => void, r: DemoReport): void {
  const bridge = r.bridge.native;
  const plugin = r.swarm.plugin?.native;
  if (!bridge) return;
  if (!bridge.enabled) {
    out(`  native    off: ${bridge.off ?? "?"}`);
    return;
  }
  const total = r.swarm.plugin?.splits ?? 0;
  const splits = plugin?.splits ?? bridge.splits;
  const layers = bridge.table.layers;
  out(
    `  native    ${splits} of ${total} splits went straight to a worker (${layers.length} layer${layers.length === 1 ? "" : "s"} in the table), ` +
      `${plugin?.fallbacks ?? bridge.fallbacks} fell back to the bridge` +
      (plugin && plugin.splits > 0
        ? `; per native layer p50 ${fmt(plugin.roundTripP50Us / 1000, 3)} ms round trip, ${fmt(plugin.overheadP50Us / 1000, 3)} ms above the worker's compute`
        : ""),
  );
}

/** What the backbone's verification did: every answer of a stranger is checked before it is used. */
function printVerification(
  out: (line?: string) => void,
  bridge: BridgeMetrics,
  trust: "verify" | "own",
): void {
  const v = bridge.verification;
  if (!v || trust === "own") {
    // the bridge keeps its (zero) counters under trust "own": lines of zeros would read as checks that found nothing
    out("  verify    off (--trust own: answers used as they come; no second opinion, no audit)");
    if (v && v.quarantines > 0) {
      out(`  caught    ${v.quarantined.join(", ")} quarantined (reported to the hub with the evidence)`);
    }
    return;
  }
  out(
    `  verify    ${v.partsVerified} parts answered by two workers and compared, ${v.disagreements} disagreements, ` +
      `${v.thirdOpinions} third opinions, ${v.unverifiableLocal} parts computed locally (one owner), ` +
      `cost ${formatBytes(v.extraBytes)} and ${fmt(v.extraComputeMs, 1)} ms of worker compute`,
  );
  out(
    `  audit     ${v.audits} agreed parts re-computed locally before use (probation, then 2% sampled), ` +
      `${v.auditDisagreements} disproved, ${fmt(v.auditMs, 1)} ms of local compute`,
  );
  if (v.quarantines > 0) {
    out(`  caught    ${v.quarantined.join(", ")} quarantined (reported to the hub with the evidence)`);
  }
}
