import { readFile } from "node:fs/promises";
import { GgufError, InvalidArgumentError, parseRange } from "@moeswarm/core";
import { type GgufHeader, readGguf } from "../gguf-reader.js";
import { formatOffloadPlan, offloadPlanToJson } from "../plan/format.js";
import { KV_CACHE_TYPES, type KvCacheType } from "../plan/memory.js";
import { type OffloadOrder, type PlanOffloadOptions, planOffload } from "../plan/offload.js";
import type { ExpertDemand, SwarmWorker } from "../plan/swarm.js";
import {
  type Command,
  type CommandContext,
  FILE_SIZE_OPTION,
  fileSizeFlag,
  openInput,
  stringFlag as str,
  usageError as usage,
} from "./command.js";
import { toJson } from "./io.js";

function int(ctx: CommandContext, name: string): number | undefined {
  const v = str(ctx, name);
  if (v === undefined) return undefined;
  if (!/^\d{1,9}$/.test(v)) throw usage(`--${name} must be a positive integer, got ${v}`);
  return Number(v);
}

/** `47,46,45` or `40:48` (ascending) in the given order. */
function layerList(text: string, what: string): number[] {
  const out: number[] = [];
  for (const part of text.split(",")) {
    const r = parseRange(part.trim());
    if (r.end - r.start > 4096) throw usage(`${what} range ${part} is too large`);
    for (let i = r.start; i < r.end; i++) out.push(i);
  }
  return out;
}

async function readJson(path: string, what: string): Promise<unknown> {
  let text: string;
  try {
    text = await readFile(path, "utf8");
  } catch (error) {
    throw new GgufError("MOESWARM_GGUF_IO", `cannot read ${what} ${path}: ${(error as Error).message}`, {
      cause: error,
    });
  }
  try {
    return JSON.parse(text);
  } catch (error) {
    throw usage(`${what} ${path} is not JSON: ${(error as Error).message}`);
  }
}

/** `gpu-a=6GiB,phone=2GiB` */
function inlineWorkers(text: string): SwarmWorker[] {
  return text.split(",").map((part) => {
    const eq = part.lastIndexOf("=");
    if (eq <= 0) throw usage(`--workers entries are id=capacity, got ${JSON.stringify(part)}`);
    return { id: part.slice(0, eq).trim(), capacity: part.slice(eq + 1).trim() };
  });
}

async function headerOf(
  input: string,
  signal: AbortSignal,
  fileSize: bigint | undefined,
): Promise<{ header: GgufHeader; source: string }> {
  const source = await openInput(input, signal);
  try {
    const header = await readGguf(source, { signal, ...(fileSize === undefined ? {} : { fileSize }) });
    return { header, source: source.description };
  } finally {
    await source.close();
  }
}

/** The command line's flags as planOffload options (reads the --workers/--demand files). */
async function planOptions(ctx: CommandContext): Promise<PlanOffloadOptions> {
  const vram = str(ctx, "vram");
  if (!vram) throw usage("--vram is required");
  const options: PlanOffloadOptions = {
    vram,
    ram: str(ctx, "ram"),
    ctx: int(ctx, "ctx"),
    kvType: str(ctx, "kv-type") as KvCacheType | undefined,
    kvTypeV: str(ctx, "kv-type-v") as KvCacheType | undefined,
    batch: int(ctx, "batch"),
    ubatch: int(ctx, "ubatch"),
    seqs: int(ctx, "parallel"),
    reserve: str(ctx, "reserve") as PlanOffloadOptions["reserve"],
    margin: str(ctx, "margin"),
    loadMtp: ctx.flags["load-mtp"] === true,
    maxCopies: int(ctx, "max-copies"),
  };
  const fa = str(ctx, "flash-attn");
  if (fa !== undefined) {
    if (fa !== "on" && fa !== "off") throw usage(`--flash-attn must be on or off, got ${fa}`);
    options.flashAttention = fa === "on";
  }
  const order = str(ctx, "order");
  if (order !== undefined) {
    options.order = (
      ["last", "first", "demand"].includes(order) ? order : layerList(order, "order")
    ) as OffloadOrder;
  }
  const workers = str(ctx, "workers");
  if (workers !== undefined) {
    options.workers = workers.endsWith(".json")
      ? ((await readJson(workers, "workers file")) as SwarmWorker[])
      : inlineWorkers(workers);
  }
  const demand = str(ctx, "demand");
  if (demand !== undefined) {
    const value = await readJson(demand, "demand file");
    if (typeof value !== "object" || value === null || Array.isArray(value)) {
      throw usage("the demand file must be an object {layer: [selections per expert]}");
    }
    options.demand = value as ExpertDemand;
  }
  const swarm = str(ctx, "swarm");
  if (swarm !== undefined) {
    options.swarm = swarm === "offloaded" || swarm === "overflow" ? swarm : layerList(swarm, "swarm");
  }
  return options;
}

export const planCommand: Command = {
  name: "plan",
  summary: "plan which expert layers stay in VRAM, go to RAM or to the swarm; print the llama.cpp flags",
  usage: "plan <file|url> --vram 64GiB [--ram 128GiB] [--ctx 8192] [--json]",
  options: {
    vram: { type: "string", description: "GPU memory (bytes, 64GiB, 80GB)" },
    "file-size": FILE_SIZE_OPTION,
    ram: { type: "string", description: "host memory for offloaded layers (default: unchecked)" },
    ctx: { type: "string", description: "context size (default 4096)" },
    "kv-type": { type: "string", description: `KV cache type: ${KV_CACHE_TYPES.join(", ")} (default f16)` },
    "kv-type-v": { type: "string", description: "V cache type (default --kv-type)" },
    batch: { type: "string", description: "logical batch size (default 2048)" },
    ubatch: { type: "string", description: "physical batch size (default 512)" },
    parallel: { type: "string", description: "sequences (default 1)" },
    "flash-attn": { type: "string", description: "on|off (default on)" },
    reserve: { type: "string", description: "GPU compute buffer in bytes, or auto (default: estimated)" },
    margin: { type: "string", description: "VRAM left free (default 1GiB, as llama.cpp --fit-target)" },
    order: { type: "string", description: "offload order: last, first, demand, or layers (47,46,45)" },
    "load-mtp": { type: "boolean", description: "count MTP/NextN blocks as loaded" },
    workers: {
      type: "string",
      description: "swarm workers: id=capacity,... or a JSON file of {id,capacity,...}",
    },
    demand: { type: "string", description: "JSON file: {layer: [selections per expert]}" },
    swarm: { type: "string", description: "swarm layers: offloaded (default), overflow, or a list" },
    "max-copies": { type: "string", description: "most copies of one expert across workers (default 2)" },
    strict: { type: "boolean", description: "exit 1 (MOESWARM_PLAN_NO_FIT) when the plan does not fit" },
  },
  async run(ctx) {
    const [input, ...extra] = ctx.positionals;
    if (input === undefined) throw usage("missing <file|url>");
    if (extra.length > 0) throw usage(`unexpected argument ${JSON.stringify(extra[0])}`);
    const options = await planOptions(ctx);
    const { header, source } = await headerOf(input, ctx.signal, fileSizeFlag(ctx));
    let plan: ReturnType<typeof planOffload>;
    try {
      plan = planOffload(header, options);
    } catch (error) {
      // Every option came from the command line: a bad one is a usage error (exit status 2).
      if (error instanceof InvalidArgumentError && error.code === "MOESWARM_INVALID_ARGUMENT") {
        throw new InvalidArgumentError(error.message, {
          details: { ...(error.details as object | undefined), usage: true },
          cause: error,
        });
      }
      throw error;
    }
    if (ctx.flags.strict === true && !plan.fits) {
      throw new InvalidArgumentError(
        "MOESWARM_PLAN_NO_FIT",
        `${source} does not fit: ${plan.notes.join("; ")}`,
        {
          details: { vramFree: plan.vram.free?.toString(), ramFree: plan.ram.free?.toString() },
        },
      );
    }
    if (ctx.json) ctx.io.stdout.write(`${toJson({ source, ...offloadPlanToJson(plan) })}\n`);
    else ctx.io.stdout.write(formatOffloadPlan(plan, { model: input }));
  },
};
