// The hub both market-http test files start (market-http-demand: demand, claims, leases, placement,
// backbone stats; market-http-workers: several slices per worker, a drain from the hub, the dashboard),
// and the HTTP and relay helpers they drive it with.
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import { parseManifest, type SliceManifest } from "@moeswarm/shard";
import { createHub, type Hub, type HubEvent, mintToken } from "../src/index.js";
import { call, copyModel, json, syntheticModel, type TempDir, tempDir } from "./hub-helpers.js";

export const SECRET = "hub-market-secret-0123456789abcdef";
export const ID = "tiny";
export const T0 = 1_700_000_000_000;

/** Relay connections a test opened; closed when its file ends. */
export const open: RelayConnection[] = [];
const at = { base: "", relayUrl: "" };

export const token = (role: "worker" | "backbone" | "admin", id?: string) =>
  mintToken({ role, ...(id === undefined ? {} : { id }), ttlS: 600 }, SECRET);
// biome-ignore lint/suspicious/noExplicitAny: JSON answers, probed field by field by the assertions
export type Body = Record<string, any>;

export const bearer = (t: string) => ({ authorization: `Bearer ${t}`, "content-type": "application/json" });

export async function post(path: string, body: unknown, auth?: string, method = "POST") {
  const a = await call(`${at.base}${path}`, {
    method,
    headers: auth === undefined ? { "content-type": "application/json" } : bearer(auth),
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return {
    status: a.status,
    headers: a.headers,
    body: a.body.byteLength > 0 ? (json(a) as Body) : {},
  };
}

export async function get(path: string, auth?: string) {
  const a = await call(`${at.base}${path}`, auth === undefined ? {} : { headers: bearer(auth) });
  return {
    status: a.status,
    headers: a.headers,
    body: a.body.byteLength > 0 ? (json(a) as Body) : {},
  };
}

export async function worker(id: string): Promise<RelayConnection> {
  const c = await connectRelay(at.relayUrl, {
    role: "worker",
    id,
    token: token("worker", id),
    reconnect: false,
    onDispatch: () => ({ y: new Float32Array(0) }),
  });
  open.push(c);
  return c;
}

export const capacity = { ramBytes: 1 << 30, backend: "cpu", bandwidthBps: 50e6 };

export interface MarketHub {
  tmp: TempDir;
  tinyPath: string;
  hub: Hub;
  base: string;
  relayUrl: string;
  manifest: SliceManifest;
  events: HubEvent[];
}

/** A hub on a free port with the tiny model, its market on `clock`; post/get/worker then talk to it. */
export async function startMarketHub(clock: () => number): Promise<MarketHub> {
  const events: HubEvent[] = [];
  const tmp = tempDir();
  const tinyPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
  const hub = createHub({
    secret: SECRET,
    models: [{ id: ID, path: tinyPath }],
    clock,
    market: { leaseTtlMs: 60_000, halfLifeMs: 600_000 },
    // these files test the market's HTTP API with one copy per expert, unbound tokens and fake
    // workers that register without claiming (trust.test.ts tests the defaults)
    replicas: 1,
    allowUnboundTokens: true,
    requireLeases: false,
    maxPollMs: 5000,
    maxStatsBytes: 256 * 1024,
    onEvent: (e) => events.push(e),
  });
  const l = await hub.listen(0);
  at.base = l.url;
  at.relayUrl = l.relayUrl;
  const manifest = parseManifest(json(await call(`${l.url}/api/models/${ID}/manifest`)));
  return { tmp, tinyPath, hub, base: l.url, relayUrl: l.relayUrl, manifest, events };
}
