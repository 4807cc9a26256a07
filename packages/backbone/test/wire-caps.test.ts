// Workers advertise the activation dtypes their compute takes (hello caps.dtypes), the hub hands
// them to the bridge with its placement, and the bridge's q8 sender follows them: through a real
// hub and its relay, with llama-cpu worker processes behind four kinds of relay connection:
//   adv    advertises q8_0/q8_K and takes them: q8 from its first request, never a refusal;
//   plain  advertises f32/f16/bf16 only: f32 from its first request, never a try;
//   old    says nothing and cannot take q8 (an older worker): tried once per layer, then f32;
//   liar   advertises q8 and refuses it: one refusal and one resend, then f32 on every layer.
// Every decode stays bit-identical to plain llama.cpp (q8 or f32, the same bits), without failover.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { isQuantizedActivationDtype, NativeError, WIRE_ACTIVATION_DTYPES } from "@moeswarm/core";
import { mintToken } from "@moeswarm/hub";
import { connectRelay, type IncomingDispatch } from "@moeswarm/relay-client";
import { loadActivationQuantizer, type WorkerProcessCompute } from "@moeswarm/worker-native";
import { beforeAll, describe, expect, it } from "vitest";
import { type BackboneBridge, runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import { firstByteDiff, nativeMissing, split } from "./helpers.js";
import { useRelaySwarm } from "./relay-swarm-fixture.js";

const missing = nativeMissing();
const SECRET = "backbone-wire-caps-test-secret-0123";
const MODEL_ID = "caps";
const N_PREDICT = 24;
const PLAIN = ["f32", "f16", "bf16"];

type Kind = "adv" | "plain" | "old" | "liar";

/** What one worker saw: each request's layer and dtype, in arrival order. */
type Seen = Array<{ layer: number; dtype: string }>;

describe.skipIf(Boolean(missing))("workers' advertised dtypes through a real hub", () => {
  const fx = useRelaySwarm({ prefix: "mswb-caps-", secret: SECRET, model: MODEL_ID, preset: "small" });
  const seen = new Map<Kind, Seen>();

  /** A llama-cpu process on `experts`, and a relay connection of the given kind answering from it. */
  async function join_(kind: Kind, experts: number[]): Promise<void> {
    const compute: WorkerProcessCompute = await fx.swarm.spawn(kind, experts);
    const log: Seen = [];
    seen.set(kind, log);
    const caps =
      kind === "adv" || kind === "liar"
        ? { dtypes: [...WIRE_ACTIVATION_DTYPES] }
        : kind === "plain"
          ? { dtypes: PLAIN }
          : undefined;
    const run = (d: IncomingDispatch) => {
      log.push({ layer: d.layer, dtype: d.dtype });
      const q8 = isQuantizedActivationDtype(d.dtype);
      if (q8 && kind === "liar") throw new NativeError("MOESWARM_NATIVE_WIRE_DTYPE", "said q8, takes f32");
      return compute.run(
        {
          layer: d.layer,
          // "old" reads f32 as a worker before q8 did: activations() refuses q8 rows (WIRE_DTYPE)
          ...(q8 && kind !== "old"
            ? { x: d.x as Uint8Array, xType: d.dtype as never }
            : { x: d.activations() }),
          ids: d.ids,
          k: d.k,
          ...(d.w ? { w: d.w } : {}),
          mode: d.mode,
        },
        { signal: d.signal },
      );
    };
    const c = await connectRelay(fx.swarm.relayUrl, {
      role: "worker",
      id: kind,
      token: mintToken({ role: "worker", id: kind, ttlS: 3600 }, SECRET),
      reconnect: false,
      ...(caps ? { caps } : {}),
      onDispatch: async (d) => ({ y: await run(d) }),
    });
    fx.swarm.track(kind, c);
    c.register({ model: MODEL_ID, layers: fx.info.layers, experts, backend: "llama-cpu" });
  }

  beforeAll(async () => {
    const parts = split(fx.info.nExpert, 4);
    const kinds: Kind[] = ["adv", "plain", "old", "liar"];
    await Promise.all(kinds.map((k, i) => join_(k, parts[i] as number[])));
  }, 120_000);

  it("q8 at once where advertised, f32 at once where not, one try for the silent, one resend for the liar", async () => {
    await using bridge: BackboneBridge = await serveBackboneBridge({
      socket: join(fx.tmp.dir, "caps.sock"),
      hub: {
        url: fx.swarm.url,
        token: mintToken({ role: "backbone", id: "bb-caps", ttlS: 3600 }, SECRET),
        model: MODEL_ID,
        statsIntervalMs: 0,
      },
      trust: "own",
      wire: await loadActivationQuantizer(fx.modelPath),
    });
    const p = await bridge.hub!.waitForPlacement((x) => x.missing.length === 0 && x.workers.length === 4);
    // the hub handed over what each hello said, and nothing for the silent one
    expect(p.placement.dtypes("adv")).toEqual([...WIRE_ACTIVATION_DTYPES]);
    expect(p.placement.dtypes("plain")).toEqual(PLAIN);
    expect(p.placement.dtypes("old")).toBeUndefined();

    const common = { modelPath: fx.modelPath, prompt: "Say what you take", nPredict: N_PREDICT, threads: 1 };
    const plainPath = join(fx.tmp.dir, "plain.bin");
    const plain = await runLogitsHarness({ ...common, logitsPath: plainPath });
    expect(plain.ok, plain.stderr).toBe(true);
    const swarmPath = join(fx.tmp.dir, "swarm.bin");
    const r = await runLogitsHarness({
      ...common,
      logitsPath: swarmPath,
      plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
    });
    expect(r.ok, r.stderr).toBe(true);
    expect(r.tokens).toEqual(plain.tokens);
    expect(firstByteDiff(readFileSync(swarmPath), readFileSync(plainPath))).toBe(-1);

    const dtypes = (k: Kind) => seen.get(k)!.map((s) => s.dtype);
    for (const k of ["adv", "plain", "old", "liar"] as const) expect(dtypes(k).length).toBeGreaterThan(1);
    // adv: q8 from the first request on (this model's experts read q8_0), so never a refusal
    expect(new Set(dtypes("adv"))).toEqual(new Set(["q8_0"]));
    // plain: never offered q8
    expect(new Set(dtypes("plain"))).toEqual(new Set(["f32"]));
    // old: per layer, its first request q8 (refused), every later one f32
    const old = seen.get("old")!;
    const layersOfOld = [...new Set(old.map((s) => s.layer))];
    for (const layer of layersOfOld) {
      const mine = old.filter((s) => s.layer === layer).map((s) => s.dtype);
      expect(mine[0]).toBe("q8_0");
      expect(mine.slice(1).every((d) => d === "f32")).toBe(true);
    }
    // liar: one q8 request in all (refused, sent again), f32 on every layer after it
    expect(dtypes("liar")[0]).toBe("q8_0");
    expect(
      dtypes("liar")
        .slice(1)
        .every((d) => d === "f32"),
    ).toBe(true);

    const m = bridge.metrics();
    expect(m.wire).toMatchObject({
      refusedAdvertised: 1,
      refusedDtype: 1 + layersOfOld.length,
      quantized: dtypes("adv").length,
    });
    expect(m.wire!.sentF32Unadvertised).toBe(dtypes("plain").length);
    // refusals are resent inside the q8 sender: no failover, no fallback, nothing failed
    expect(m).toMatchObject({ failed: 0, failovers: 0, fallbacks: 0 });
  }, 120_000);
});
