// GET /api/health: for load balancers and for whoever deploys the hub. It says the hub answers,
// which store keeps its state (and on which SQLite driver), and the client address the hub sees
// for this request: behind a reverse proxy, the address X-Forwarded-For names when the proxy is
// trusted (--trust-proxy), else the proxy's own (docs/deploy.md).
import { clientAddress } from "../client-address.js";
import { sendJson } from "../http-errors.js";
import type { Handler } from "./context.js";

export const getHealth: Handler = (ctx, { req, res, head }) => {
  const client = clientAddress(req, ctx.settings.trustProxy);
  sendJson(
    res,
    200,
    {
      ok: true,
      store: {
        kind: ctx.store.kind,
        ...(ctx.store.driver ? { driver: ctx.store.driver } : {}),
      },
      client: { address: client.address, ...(client.proxy ? { proxy: client.proxy } : {}) },
    },
    { "cache-control": "no-store" },
    head,
  );
};
