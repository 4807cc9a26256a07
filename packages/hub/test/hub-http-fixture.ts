// The hubs the hub's test files start on the tiny model: `useHub`, the one hub both hub-http test
// files share (hub-http-serving: models, manifests, expert-shard; hub-http-operations: errors,
// writes, private reads, failures, close, embedding, metrics); `useHubs`, a hub or more per test
// with the tokens and relay peers the trust tests (trust, trust-owners) set up.
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import { afterAll, afterEach, beforeAll } from "vitest";
import { createHub, type Hub, type HubEvent, type HubOptions, mintToken } from "../src/index.js";
import { call, copyModel, json, syntheticModel, type TempDir, tempDir } from "./hub-helpers.js";

export const SECRET = "hub-test-secret-0123456789abcdef";
export const ID = "tiny";

export interface HubFixture {
  tmp: TempDir;
  tinyPath: string;
  hub: Hub;
  base: string;
  events: HubEvent[];
}

/** A hub on a free port serving a copy of the tiny model from a fresh temp dir. */
export async function startHub(): Promise<HubFixture> {
  const events: HubEvent[] = [];
  const tmp = tempDir();
  const tinyPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
  const hub = createHub({
    secret: SECRET,
    models: [{ id: ID, path: tinyPath }],
    modelDir: tmp.dir,
    chunkSize: 4096, // many chunks even for the tiny model: exercises the streaming path
    onEvent: (e) => events.push(e),
  });
  const base = (await hub.listen(0)).url;
  return { tmp, tinyPath, hub, base, events };
}

/**
 * The fixture hub of a test file: started before its tests, closed (its temp dir removed) after
 * them. Its fields are set once `beforeAll` has run; `shardUrl` builds an expert-shard URL on it.
 */
export function useHub(): HubFixture & { shardUrl(query: string, id?: string): string } {
  const fx = {} as HubFixture;
  beforeAll(async () => {
    Object.assign(fx, await startHub());
  });
  afterAll(async () => {
    await fx.hub?.close();
    fx.tmp?.remove();
  });
  return Object.assign(fx, {
    shardUrl: (query: string, id = ID) => `${fx.base}/api/models/${id}/expert-shard?${query}`,
  });
}

// biome-ignore lint/suspicious/noExplicitAny: JSON answers, probed field by field by the assertions
export type Body = Record<string, any>;

/** A request to `base` + `path`: POST with a JSON body, GET without one (or `method`); the answer's JSON. */
export async function http(base: string, path: string, body?: unknown, auth?: string, method = "POST") {
  const a = await call(`${base}${path}`, {
    method: body === undefined && method === "POST" ? "GET" : method,
    headers: {
      "content-type": "application/json",
      ...(auth === undefined ? {} : { authorization: `Bearer ${auth}` }),
    },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  return { status: a.status, body: (a.body.byteLength > 0 ? json(a) : {}) as Body };
}

export interface HubsFixture {
  /** The test file's temp dir (it holds the tiny model's copy); set once `beforeAll` has run. */
  tmp: TempDir;
  /** A hub on a free port serving the tiny model as {@link ID}: the file's secret and defaults, `options` over them. */
  start(options?: Partial<HubOptions>): Promise<{ hub: Hub; base: string; relayUrl: string }>;
  /** A token of `role` signed with the file's secret (10 minutes), bound to `id` and naming `owner` when given. */
  token(role: "worker" | "backbone" | "admin", id?: string, owner?: string): string;
  /** A fake peer that said hello on the relay as `id` (a worker answers every dispatch with nothing). */
  peer(relayUrl: string, role: "worker" | "backbone", id: string, token?: string): Promise<RelayConnection>;
  /** Closes the peers, then the hubs, started so far: after each test, and where a test restarts its hub. */
  closeAll(): Promise<void>;
}

/**
 * The hubs of a test file whose tests each start their own: the tiny model copied into a temp dir
 * before the tests, every hub `start` made and every `peer` closed after each test, the temp dir
 * removed after them all. `defaults` are the file's hub options (its clock, say).
 */
export function useHubs(secret: string, defaults: Partial<HubOptions> = {}): HubsFixture {
  let tinyPath = "";
  const open: RelayConnection[] = [];
  const hubs: Hub[] = [];
  const token: HubsFixture["token"] = (role, id, owner) =>
    mintToken(
      { role, ...(id === undefined ? {} : { id }), ...(owner === undefined ? {} : { owner }), ttlS: 600 },
      secret,
    );
  const fx: HubsFixture = {
    tmp: undefined as unknown as TempDir,
    async start(options = {}) {
      const hub = createHub({ secret, models: [{ id: ID, path: tinyPath }], ...defaults, ...options });
      hubs.push(hub);
      const l = await hub.listen(0);
      return { hub, base: l.url, relayUrl: l.relayUrl };
    },
    token,
    async peer(relayUrl, role, id, tok = token(role, id)) {
      const c = await connectRelay(relayUrl, {
        role,
        id,
        token: tok,
        reconnect: false,
        ...(role === "worker" ? { onDispatch: () => ({ y: new Float32Array(0) }) } : {}),
      });
      open.push(c);
      return c;
    },
    async closeAll() {
      await Promise.all(open.splice(0).map((c) => c.close()));
      await Promise.all(hubs.splice(0).map((h) => h.close()));
    },
  };
  beforeAll(async () => {
    fx.tmp = tempDir();
    tinyPath = copyModel(await syntheticModel("tiny"), fx.tmp.dir, "tiny.gguf");
  });
  afterEach(() => fx.closeAll());
  afterAll(() => fx.tmp?.remove());
  return fx;
}
