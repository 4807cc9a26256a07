import { formatRange } from "@moeswarm/core";
import type { DeviceTotals, OffloadPlan } from "./offload.js";
import { runsOf } from "./override.js";
import { toGiB } from "./units.js";

/** `0-37` style runs of a sorted layer list. */
export function formatLayers(layers: readonly number[]): string {
  if (layers.length === 0) return "none";
  return runsOf(layers)
    .map(([a, b]) => (a === b ? String(a) : `${a}-${b}`))
    .join(",");
}

/** A shell-safe single-quoted argument. */
export function shellQuote(arg: string): string {
  return /^[A-Za-z0-9_./:=,+-]+$/.test(arg) ? arg : `'${arg.replace(/'/g, `'\\''`)}'`;
}

function gib(bytes: bigint | undefined, digits = 2): string {
  return bytes === undefined ? "-" : `${toGiB(bytes, digits)} GiB`;
}

function row(cells: readonly string[], widths: readonly number[]): string {
  return cells.map((c, i) => (i === 0 ? c.padEnd(widths[i]!) : c.padStart(widths[i]!))).join("  ");
}

/** The plan as a table a person reads at a glance. */
export function formatOffloadPlan(plan: OffloadPlan, options: { model?: string } = {}): string {
  const c = plan.context;
  const lines: string[] = [];
  lines.push(
    `${plan.arch}, ${plan.blockCount} blocks, ${gib(plan.modelBytes)} of weights (${plan.modelBytes} bytes); ` +
      `ctx ${c.ctx}, KV ${c.kvType}${c.kvTypeV !== c.kvType ? `/${c.kvTypeV}` : ""}, batch ${c.batch}/${c.ubatch}, ` +
      `flash attention ${c.flashAttention ? "on" : "off"}${c.seqs > 1 ? `, ${c.seqs} sequences` : ""}`,
  );
  lines.push("");
  const head = ["", "capacity", "weights", "KV cache", "rec. state", "compute", "margin", "total", "free"];
  const some = (v: bigint) => (v === 0n ? "-" : gib(v));
  const dev = (name: string, d: DeviceTotals) => [
    name,
    gib(d.capacity),
    gib(d.weights),
    some(d.kvCache),
    some(d.recurrentState),
    gib(d.compute),
    some(d.margin),
    gib(d.total),
    d.free === undefined ? "-" : d.free < 0n ? `-${gib(-d.free)}` : gib(d.free),
  ];
  const rows = [head, dev("VRAM", plan.vram), dev("RAM", plan.ram)];
  if (plan.swarm) {
    const cap = plan.swarm.assignments.reduce((s, a) => s + a.capacity, 0n);
    rows.push([
      "swarm",
      gib(cap),
      gib(plan.weights.swarm),
      "-",
      "-",
      "-",
      "-",
      gib(plan.swarm.heldBytes),
      gib(cap - plan.swarm.heldBytes),
    ]);
  }
  const widths = head.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)));
  for (const r of rows) lines.push(row(r, widths));
  lines.push("");
  const bytesOf = new Map(plan.layers.map((l) => [l.layer, l.bytes]));
  const sizes = (layers: readonly number[]) =>
    layers.length === 0
      ? ""
      : ` (${layers.length} layers, ${gib(layers.reduce((s, l) => s + bytesOf.get(l)!, 0n))})`;
  lines.push(`expert layers in VRAM:  ${formatLayers(plan.vramLayers)}${sizes(plan.vramLayers)}`);
  lines.push(`expert layers in RAM:   ${formatLayers(plan.ramLayers)}${sizes(plan.ramLayers)}`);
  if (plan.swarm || plan.swarmLayers.length > 0) {
    lines.push(`expert layers in swarm: ${formatLayers(plan.swarmLayers)}${sizes(plan.swarmLayers)}`);
  }
  if (plan.weights.skipped > 0n) lines.push(`not loaded (MTP):       ${gib(plan.weights.skipped)}`);
  lines.push(
    `compute reserve: ${gib(plan.computeBytes)} (estimate: logits ${gib(plan.compute.logits)}` +
      `${plan.compute.attentionScores > 0n ? `, attention scores ${gib(plan.compute.attentionScores)}` : ""}` +
      `, activations ${gib(plan.compute.activations)}, op-offload copy ${gib(plan.compute.offloadCopy)})`,
  );
  lines.push("");
  if (plan.overrideTensor) {
    lines.push(`llama.cpp: --override-tensor ${shellQuote(plan.overrideTensor)}`);
    lines.push(
      plan.nCpuMoe !== undefined
        ? `       or: --n-cpu-moe ${plan.nCpuMoe} (moves the same tensors)${plan.swarmLayers.length > 0 ? " with the swarm override" : ""}`
        : "       (no --n-cpu-moe equivalent: --n-cpu-moe N moves the first N layers)",
    );
  } else lines.push("llama.cpp: everything on the GPU, no override needed");
  lines.push(
    `command:   llama-server -m ${shellQuote(options.model ?? "model.gguf")} ${plan.llamaArgs.map(shellQuote).join(" ")}`,
  );
  if (plan.swarm) {
    lines.push("");
    lines.push("swarm slices:");
    for (const a of plan.swarm.assignments) {
      const s = a.slice;
      lines.push(
        s
          ? `  ${a.worker}: ${s.layers.length === 1 ? "layer" : "layers"} ${formatLayers(s.layers)} x experts ${s.expertRanges.map(formatRange).join(",")} ` +
              `(${s.role}, ${gib(s.bytes)} of ${gib(a.capacity)})`
          : `  ${a.worker}: idle (${gib(a.capacity)})`,
      );
    }
  }
  lines.push("");
  lines.push(plan.fits ? "fits" : "DOES NOT FIT");
  for (const n of plan.notes) lines.push(`note: ${n}`);
  return `${lines.join("\n")}\n`;
}

function deviceJson(d: DeviceTotals) {
  const out: Record<string, unknown> = { fits: d.fits };
  for (const k of [
    "capacity",
    "weights",
    "kvCache",
    "recurrentState",
    "compute",
    "margin",
    "total",
    "free",
  ] as const) {
    const v = d[k];
    out[k] =
      v === undefined
        ? null
        : { bytes: v.toString(), gib: Number(toGiB(v < 0n ? -v : v, 3)) * (v < 0n ? -1 : 1) };
  }
  return out;
}

/** The plan as plain JSON (bytes as decimal strings beside GiB numbers). */
export function offloadPlanToJson(plan: OffloadPlan): Record<string, unknown> {
  const b = (v: bigint) => v.toString();
  return {
    arch: plan.arch,
    blockCount: plan.blockCount,
    modelBytes: b(plan.modelBytes),
    fits: plan.fits,
    context: plan.context,
    devices: { vram: deviceJson(plan.vram), ram: deviceJson(plan.ram) },
    weights: Object.fromEntries(Object.entries(plan.weights).map(([k, v]) => [k, b(v)])),
    vramLayers: plan.vramLayers,
    ramLayers: plan.ramLayers,
    swarmLayers: plan.swarmLayers,
    layers: plan.layers.map((l) => ({ layer: l.layer, bytes: b(l.bytes), device: l.device })),
    kvCache: {
      layers: plan.kv.layers,
      cells: plan.kv.cells,
      k: b(plan.kv.k),
      v: b(plan.kv.v),
      total: b(plan.kv.total),
    },
    recurrentState: { layers: plan.recurrent.layers, total: b(plan.recurrent.total) },
    compute: {
      reserved: b(plan.computeBytes),
      estimate: Object.fromEntries(
        Object.entries(plan.compute).map(([k, v]) => [k, typeof v === "bigint" ? b(v) : v]),
      ),
    },
    hostBuffers: b(plan.hostBuffers),
    overrideTensor: plan.overrideTensor ?? null,
    overrides: plan.overrides.map((o) => ({
      pattern: o.pattern,
      bufferType: o.bufferType,
      tensors: o.tensors.length,
    })),
    nCpuMoe: plan.nCpuMoe ?? null,
    llamaArgs: plan.llamaArgs,
    swarm: plan.swarm
      ? {
          layers: plan.swarm.layers,
          bytes: b(plan.swarm.bytes),
          heldBytes: b(plan.swarm.heldBytes),
          assignments: plan.swarm.assignments.map((a) => ({
            worker: a.worker,
            capacity: b(a.capacity),
            slice: a.slice
              ? {
                  layers: a.slice.layers,
                  experts: a.slice.expertRanges.map(formatRange).join(","),
                  bytes: b(a.slice.bytes),
                  role: a.slice.role,
                }
              : null,
          })),
        }
      : null,
    notes: plan.notes,
  };
}
