// The llama-server side of `throughput`: a group of llama-server processes (one, or two for
// "overlap") serving C clients, the clients themselves, and llama-server's own counters.
import { type LlamaServerProcess, startLlamaServer } from "@moeswarm/testkit/llama-server";

/**
 * How the C sequences are served:
 * - none: one llama-server, --parallel C (every busy slot in one batch: one round trip per
 *   remote layer per step, shared by the C sequences);
 * - draft: the same with a local draft model (`-md --spec-type draft-simple`): one round trip per
 *   remote layer verifies up to draftMax + 1 tokens of every slot;
 * - overlap: two llama-server processes with C/2 slots each on the same bridge: while one waits
 *   for its round trip the other computes (the plugin blocks only its own process's decode).
 */
export type Variant = "none" | "draft" | "overlap";
export const VARIANTS: readonly Variant[] = ["none", "draft", "overlap"];

export interface ServerGroupOptions {
  bin: string;
  model: string;
  variant: Variant;
  clients: number;
  nPredict: number;
  /** The draft model (needed by variant "draft" only). */
  draft: { path: string | undefined; max: number };
  /** How long a llama-server may take to load (default 120 s). */
  readyTimeoutMs?: number;
  /** The plugin's environment and flags, or undefined for plain llama-server. */
  plugin?: { env: NodeJS.ProcessEnv; override: string };
}

export interface ServerGroup {
  servers: LlamaServerProcess[];
  close(): Promise<void>;
}

export async function startServerGroup(o: ServerGroupOptions): Promise<ServerGroup> {
  const count = o.variant === "overlap" ? 2 : 1;
  const slots = Math.ceil(o.clients / count);
  const args = [
    "-m",
    o.model,
    "-t",
    "1",
    "--parallel",
    String(slots),
    "-c",
    String(slots * (o.nPredict + 64)),
  ];
  args.push("--metrics", "-fit", "off", "-kvu");
  if (o.variant === "draft") {
    if (o.draft.path === undefined) throw new Error("variant draft: this model has no draft model");
    args.push("-md", o.draft.path, "--spec-type", "draft-simple", "--spec-draft-n-max", String(o.draft.max));
  }
  if (o.plugin) args.push("-ot", o.plugin.override, "--load-mode", "none");
  const servers: LlamaServerProcess[] = [];
  const close = async () => {
    await Promise.all(servers.map((s) => s.close()));
  };
  try {
    for (let i = 0; i < count; i++) {
      const ready = o.readyTimeoutMs !== undefined ? { timeoutMs: o.readyTimeoutMs } : {};
      servers.push(
        await startLlamaServer(o.bin, args, { ...ready, ...(o.plugin ? { env: o.plugin.env } : {}) }),
      );
    }
  } catch (error) {
    await close();
    throw error;
  }
  return { servers, close };
}

/** llama-server's counters from GET /metrics (needs --metrics), summed over the group. */
export async function counters(
  group: ServerGroup,
): Promise<{ decodes: number; drafted: number; accepted: number }> {
  const out = { decodes: 0, drafted: 0, accepted: 0 };
  for (const s of group.servers) {
    const text = await (await fetch(`${s.url}/metrics`)).text();
    const get = (name: string) => Number(new RegExp(`^llamacpp:${name} (\\S+)$`, "m").exec(text)?.[1] ?? 0);
    out.decodes += get("n_decode_total");
    out.drafted += get("spec_decode_num_draft_tokens_total");
    out.accepted += get("spec_decode_num_accepted_tokens_total");
  }
  return out;
}

export interface Run {
  tokS: number;
  texts: string[];
  decodes: number;
  drafted: number;
  accepted: number;
}

/** C clients at once (client i on server i mod n), each one completion at temperature 0. */
export async function drive(group: ServerGroup, clients: number, nPredict: number): Promise<Run> {
  const c0 = await counters(group);
  const t0 = performance.now();
  const texts = await Promise.all(
    [...Array(clients).keys()].map(async (i) => {
      const server = group.servers[i % group.servers.length]!;
      const r = await fetch(`${server.url}/completion`, {
        method: "POST",
        body: JSON.stringify({
          prompt: `Client ${i} says`,
          n_predict: nPredict,
          temperature: 0,
          ignore_eos: true,
        }),
      });
      if (r.status !== 200) {
        const log = server
          .output()
          .split("\n")
          .filter((l) => /moeswarm|MOESWARM/.test(l));
        throw new Error(`llama-server answered ${r.status}: ${await r.text()}\n${log.slice(-5).join("\n")}`);
      }
      return ((await r.json()) as { content: string }).content;
    }),
  );
  const s = (performance.now() - t0) / 1000;
  const c1 = await counters(group);
  return {
    tokS: (clients * nPredict) / s,
    texts,
    decodes: c1.decodes - c0.decodes,
    drafted: c1.drafted - c0.drafted,
    accepted: c1.accepted - c0.accepted,
  };
}
