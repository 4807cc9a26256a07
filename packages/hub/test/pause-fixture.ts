// What the pause tests (worker-pause, pause-persist) share: hubs on the tiny model (leases of a
// minute), workers that claim a slice of layer 0 and serve it on the relay while collecting the
// notices the relay sends them, and the requests they make with a token. Each test file says in
// its own words what a pause does; this file only starts and stops things.
import { connectRelay, type RelayConnection, type RelayEvent } from "@moeswarm/relay-client";
import { afterAll, afterEach, beforeAll, expect } from "vitest";
import { createHub, type Hub, type HubEvent, type HubOptions, mintToken } from "../src/index.js";
import { call, copyModel, json, syntheticModel, type TempDir, tempDir, waitFor } from "./hub-helpers.js";

export const ID = "tiny";

// biome-ignore lint/suspicious/noExplicitAny: JSON answers, probed field by field by the assertions
export type Body = Record<string, any>;

export interface PauseHubs {
  /** The file's temp dir (the tiny model's copy is in it); set once `beforeAll` has run. */
  readonly tmp: TempDir;
  /** The operator's token (10 minutes). */
  readonly admin: string;
  /** A worker token bound to `id`, naming `owner` when given (10 minutes). */
  workerToken(id: string, owner?: string): string;
  /** A hub on a free port (the file's secret, the tiny model as `ID`), `options` over those; its events. */
  start(
    options?: Partial<HubOptions>,
  ): Promise<{ base: string; relayUrl: string; hub: Hub; events: HubEvent[] }>;
  /** A JSON request with a bearer token (POST by default); the status and the parsed body ({} if none). */
  request(
    base: string,
    path: string,
    auth?: string,
    body?: unknown,
    method?: string,
  ): Promise<{ status: number; body: Body }>;
  /** The ids the model's placement routes to, sorted. */
  placed(base: string): Promise<string[]>;
  /** `id` (a token of `owner`) on the relay, registering layer 0 `experts`; relay notices go to `notices`. */
  connect(
    relayUrl: string,
    id: string,
    owner: string,
    experts: number[],
    notices?: string[],
  ): Promise<RelayConnection>;
  /** Claims layer 0 experts [from, to) for `id`, connects it and waits until the placement lists it. */
  serve(
    base: string,
    relayUrl: string,
    id: string,
    owner: string,
    experts: [number, number],
    notices?: string[],
  ): Promise<RelayConnection>;
  /** Closes the relay connections made so far (a worker leaving, or before a hub restart). */
  closePeers(): Promise<void>;
}

/** The pause tests' hubs and workers: every hub and connection closed after each test. */
export function usePauseHubs(secret: string, prefix: string): PauseHubs {
  let tmp: TempDir | undefined;
  let tinyPath = "";
  const open: RelayConnection[] = [];
  const hubs: Hub[] = [];
  const workerToken = (id: string, owner?: string) =>
    mintToken({ role: "worker", id, ...(owner ? { owner } : {}), ttlS: 600 }, secret);
  const closePeers = async () => {
    await Promise.all(open.splice(0).map((c) => c.close()));
  };

  beforeAll(async () => {
    tmp = tempDir(prefix);
    tinyPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
  });
  afterEach(async () => {
    await closePeers();
    await Promise.all(hubs.splice(0).map((h) => h.close()));
  });
  afterAll(() => tmp?.remove());

  const fx: PauseHubs = {
    get tmp() {
      if (!tmp) throw new Error("the temp dir is made in beforeAll");
      return tmp;
    },
    admin: mintToken({ role: "admin", ttlS: 600 }, secret),
    workerToken,
    async start(options = {}) {
      const events: HubEvent[] = [];
      const hub = createHub({
        secret,
        models: [{ id: ID, path: tinyPath }],
        market: { leaseTtlMs: 60_000 },
        onEvent: (e) => events.push(e),
        ...options,
      });
      hubs.push(hub);
      const l = await hub.listen(0);
      return { base: l.url, relayUrl: l.relayUrl, hub, events };
    },
    async request(base, path, auth, body, method = "POST") {
      const a = await call(`${base}${path}`, {
        method,
        headers: {
          "content-type": "application/json",
          ...(auth ? { authorization: `Bearer ${auth}` } : {}),
        },
        ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
      });
      return { status: a.status, body: (a.body.byteLength > 0 ? json(a) : {}) as Body };
    },
    async placed(base) {
      const p = await call(`${base}/api/models/${ID}/placement`);
      return [...new Set<string>((json(p) as Body).registrations.map((r: Body) => r.id as string))].sort();
    },
    async connect(relayUrl, id, owner, experts, notices = []) {
      const c = await connectRelay(relayUrl, {
        role: "worker",
        id,
        token: workerToken(id, owner),
        reconnect: false,
        onDispatch: () => ({ y: new Float32Array(0) }),
      });
      open.push(c);
      c.on((e: RelayEvent) => {
        if (e.type === "notice") notices.push(`${e.error.code}: ${e.error.message}`);
      });
      c.register({ model: ID, layers: [0], experts });
      return c;
    },
    async serve(base, relayUrl, id, owner, [from, to], notices = []) {
      const claimed = await fx.request(base, "/api/claims", workerToken(id, owner), {
        worker: id,
        model: ID,
        layers: "0:1",
        experts: `${from}:${to}`,
        capacity: { ramBytes: 1 << 30 },
      });
      expect(claimed.status).toBe(201);
      const list = Array.from({ length: to - from }, (_, i) => from + i);
      const c = await fx.connect(relayUrl, id, owner, list, notices);
      await waitFor(async () => (await fx.placed(base)).includes(id), `${id} registered`);
      return c;
    },
    closePeers,
  };
  return fx;
}
