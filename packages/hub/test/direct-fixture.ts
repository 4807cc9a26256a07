// The hub the direct-link tests run against (direct.test.ts, direct-credit.test.ts): the tiny
// synthetic model served without leases, one replica, no dashboard, tokens minted with the test's
// secret, and JSON calls with a bearer token. `store` restarts a hub on the same state.
import { createHub, type Hub, type HubStore, mintToken } from "../src/index.js";
import { call, json, syntheticModel } from "./hub-helpers.js";

export const DIRECT_MODEL = "m";

export type Role = "worker" | "backbone" | "admin";

export interface DirectHub {
  readonly hub: Hub;
  readonly url: string;
  readonly relayUrl: string;
  /** A token of this hub (600 s). */
  token(role: Role, id?: string): string;
  /** A JSON request (a bearer token when `token` is given) and its JSON answer. */
  send(
    method: string,
    path: string,
    body?: unknown,
    token?: string,
    // biome-ignore lint/suspicious/noExplicitAny: the answers' shapes are what the tests check
  ): Promise<{ status: number; body: any }>;
  close(): Promise<void>;
}

/** A hub listening on a free port, serving DIRECT_MODEL. */
export async function startDirectHub(secret: string, options: { store?: HubStore | string } = {}) {
  const path = await syntheticModel("tiny");
  const hub = createHub({
    secret,
    models: [{ id: DIRECT_MODEL, path }],
    requireLeases: false,
    replicas: 1,
    dashboard: false,
    ...(options.store !== undefined ? { store: options.store } : {}),
  });
  const { url, relayUrl } = await hub.listen(0);
  const fixture: DirectHub = {
    hub,
    url,
    relayUrl,
    token: (role, id) => mintToken({ role, ...(id ? { id } : {}), ttlS: 600 }, secret),
    async send(method, path, body, token) {
      const r = await call(`${url}${path}`, {
        method,
        headers: {
          ...(token !== undefined ? { authorization: `Bearer ${token}` } : {}),
          "content-type": "application/json",
        },
        ...(body !== undefined ? { body: JSON.stringify(body) } : {}),
      });
      return { status: r.status, body: r.body.length > 0 ? json(r) : undefined };
    },
    close: () => hub.close(),
  };
  return fixture;
}
