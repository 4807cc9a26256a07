// The plan for one 64 GB GPU, set beside the figures of a deployment that ran the real
// Qwen3.5-122B on such a machine: 10 expert layers in RAM, VRAM 62.6 GiB, RAM 14.2 GiB.
import { type OffloadPlan, type PlanOffloadOptions, planOffload, readGguf, toGiB } from "@moeswarm/shard";

export const REFERENCE = { ramLayers: 10, vramGiB: "62.6", ramGiB: "14.2" } as const;

/** A 64 GB coordinator: 64 GiB of GPU memory, 128 GiB of host memory. */
export const COORDINATOR: PlanOffloadOptions = { vram: "64GiB", ram: "128GiB" };

export async function planModel(
  path: string,
  options: Partial<PlanOffloadOptions> = {},
): Promise<OffloadPlan> {
  const header = await readGguf(path);
  return planOffload(header, { ...COORDINATOR, ...options });
}

export interface ComparisonRow {
  readonly what: string;
  readonly ours: string;
  readonly reference: string;
}

/** Our figures next to the reference's, measured the way the reference states them. */
export function compareWithReference(plan: OffloadPlan): ComparisonRow[] {
  const ramExperts = plan.layers.filter((l) => l.device === "ram").reduce((s, l) => s + l.bytes, 0n);
  const embd = plan.tensors.filter((t) => t.kind === "input").reduce((s, t) => s + t.bytes, 0n);
  const vramUsed = plan.vram.total - plan.vram.margin;
  return [
    {
      what: "expert layers in RAM",
      ours: String(plan.ramLayers.length),
      reference: String(REFERENCE.ramLayers),
    },
    { what: "RAM: offloaded expert layers (GiB)", ours: toGiB(ramExperts), reference: REFERENCE.ramGiB },
    {
      what: "RAM: + token_embd, which llama.cpp keeps on the CPU (GiB)",
      ours: toGiB(ramExperts + embd),
      reference: "-",
    },
    { what: "VRAM in use, margin aside (GiB)", ours: toGiB(vramUsed), reference: REFERENCE.vramGiB },
    { what: "  of which weights", ours: toGiB(plan.vram.weights), reference: "-" },
    { what: "  of which KV cache (12 attention layers)", ours: toGiB(plan.vram.kvCache, 2), reference: "-" },
    {
      what: "  of which recurrent state (36 DeltaNet layers)",
      ours: toGiB(plan.vram.recurrentState, 2),
      reference: "-",
    },
    { what: "  of which compute buffer (estimate)", ours: toGiB(plan.vram.compute, 2), reference: "-" },
    { what: "VRAM with the 1 GiB free margin (GiB)", ours: toGiB(plan.vram.total), reference: "-" },
  ];
}

export function formatComparison(rows: readonly ComparisonRow[]): string {
  const w = Math.max(...rows.map((r) => r.what.length));
  const lines = [`${"".padEnd(w)}  ${"ours".padStart(6)}  ${"reference".padStart(9)}`];
  for (const r of rows) lines.push(`${r.what.padEnd(w)}  ${r.ours.padStart(6)}  ${r.reference.padStart(9)}`);
  return `${lines.join("\n")}\n`;
}
