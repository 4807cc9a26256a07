// The dashboard page (`/`), the data it polls (`/api/status`) and the Prometheus scrape (`/metrics`).
import { dashboardPage } from "../dashboard.js";
import { sendJson } from "../http-errors.js";
import type { Handler } from "./context.js";

export const getDashboard: Handler = (_ctx, { res, head }) => {
  const { html, csp } = dashboardPage();
  res.writeHead(200, {
    "content-type": "text/html; charset=utf-8",
    "content-length": html.byteLength,
    "cache-control": "no-cache",
    "content-security-policy": csp,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
  });
  res.end(head ? undefined : html);
};

export const getStatus: Handler = (ctx, { res, head, query }) => {
  const model = new URLSearchParams(query).get("model") ?? undefined;
  if (model !== undefined) ctx.models.get(model);
  sendJson(res, 200, ctx.status(model === undefined ? {} : { model }), {}, head);
};

export const getMetrics: Handler = async (ctx, { res, head }) => {
  const text = Buffer.from(await ctx.metrics.text());
  res.writeHead(200, {
    "content-type": ctx.metrics.contentType,
    "content-length": text.byteLength,
    "cache-control": "no-store",
  });
  res.end(head ? undefined : text);
};
