import { createHash } from "node:crypto";

/*
 * The dashboard (GET /): one self-contained page, no build step, no external resources. It polls
 * GET /api/status every two seconds and renders the coverage heatmap (layers x experts, colour =
 * live replicas, hot experts outlined, leased ones striped), the workers with their state (a
 * paused one: who paused it, since when and why; a paused worker the hub no longer lists: when it
 * was last seen and when its pause lapses), slices, credits and latency, the leases, and
 * the tokens/s the backbones report. Data is only ever put in the page with textContent and data
 * attributes, never parsed as HTML: worker ids come from the network. With private reads, open
 * it as /#token=<token>.
 */

const STYLE = `
:root { color-scheme: light dark; --bg: #0f1115; --fg: #e6e6e6; --muted: #8b93a1; --panel: #171a21; --line: #262b36;
  --r0: #c4424a; --r1: #9fd8a8; --r2: #4cc38a; --r3: #2b9a66; --r4: #1b6b47; --hot: #ffb224; --lease: #6e8efb; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", sans-serif; background: var(--bg); color: var(--fg); }
header { display: flex; gap: 24px; align-items: baseline; padding: 16px 24px; border-bottom: 1px solid var(--line); flex-wrap: wrap; }
h1 { font-size: 18px; margin: 0; font-weight: 600; }
h2 { font-size: 15px; margin: 0 0 8px; font-weight: 600; }
main { padding: 16px 24px; display: grid; gap: 16px; }
section { background: var(--panel); border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px; overflow-x: auto; }
.big { font-size: 28px; font-weight: 600; font-variant-numeric: tabular-nums; }
.muted { color: var(--muted); }
.chips { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 8px; }
.chip { background: var(--bg); border: 1px solid var(--line); border-radius: 12px; padding: 2px 10px; font-size: 12px; }
.heat { display: grid; gap: 1px; width: max-content; }
.rowlabel { font-size: 10px; color: var(--muted); padding-right: 6px; text-align: right; line-height: 12px; }
.cell { width: 12px; height: 12px; border-radius: 2px; background: var(--r0); position: relative; }
.cell[data-replicas="1"] { background: var(--r1); }
.cell[data-replicas="2"] { background: var(--r2); }
.cell[data-replicas="3"] { background: var(--r3); }
.cell[data-replicas="4+"] { background: var(--r4); }
.cell[data-hot="true"] { box-shadow: inset 0 0 0 2px var(--hot); }
.cell[data-pending="true"] { background-image: repeating-linear-gradient(45deg, transparent 0 3px, var(--lease) 3px 5px); }
.legend { display: flex; gap: 12px; align-items: center; font-size: 12px; margin-top: 8px; flex-wrap: wrap; }
.legend .cell { display: inline-block; vertical-align: middle; margin-right: 4px; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line); font-size: 13px; white-space: nowrap; }
th { color: var(--muted); font-weight: 500; }
.live { color: var(--r2); } .offline { color: var(--muted); } .draining { color: var(--hot); } .paused { color: var(--lease); }
#error { color: var(--r0); }
svg { vertical-align: middle; }
`;

const SCRIPT = `
"use strict";
(() => {
  const POLL_MS = 2000;
  const hash = new URLSearchParams(location.hash.slice(1));
  if (hash.get("token")) sessionStorage.setItem("moeswarm-token", hash.get("token"));
  const token = sessionStorage.getItem("moeswarm-token");
  const $ = (id) => document.getElementById(id);
  const el = (tag, attrs, ...kids) => {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") e.className = v; else e.setAttribute(k, v);
    }
    for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
    return e;
  };
  const fmtBytes = (n) => {
    const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
    while (n >= 1024 && i < u.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n : n.toFixed(1)) + " " + u[i];
  };
  const fmtNum = (n) => n >= 1e9 ? (n / 1e9).toFixed(2) + " G" : n >= 1e6 ? (n / 1e6).toFixed(2) + " M" : n >= 1e4 ? (n / 1e3).toFixed(1) + " k" : String(n);
  const history = [];
  const grids = new Map();

  function sparkline(values) {
    const w = 160, h = 32, max = Math.max(1e-9, ...values);
    const pts = values.map((v, i) => (values.length < 2 ? 0 : (i * w) / (values.length - 1)).toFixed(1) + "," + (h - (v / max) * (h - 2) - 1).toFixed(1)).join(" ");
    const ns = "http://www.w3.org/2000/svg";
    const svg = document.createElementNS(ns, "svg");
    svg.setAttribute("width", w); svg.setAttribute("height", h); svg.setAttribute("aria-label", "tokens per second, last minutes");
    const line = document.createElementNS(ns, "polyline");
    line.setAttribute("points", pts); line.setAttribute("fill", "none"); line.setAttribute("stroke", "#4cc38a"); line.setAttribute("stroke-width", "1.5");
    svg.append(line);
    return svg;
  }

  function heatmap(m) {
    const key = m.id + "|" + m.layers.join(",") + "|" + m.grid.nExpert.join(",");
    let g = grids.get(m.id);
    if (!g || g.key !== key) {
      const width = Math.max(...m.grid.nExpert);
      const root = el("div", { class: "heat", "data-model": m.id });
      root.style.gridTemplateColumns = "auto repeat(" + width + ", 12px)";
      const cells = [];
      m.layers.forEach((layer, r) => {
        root.append(el("div", { class: "rowlabel" }, "L" + layer));
        const row = [];
        for (let e = 0; e < width; e++) {
          const c = el("div", { class: "cell", "data-layer": String(layer), "data-expert": String(e) });
          if (e >= m.grid.nExpert[r]) c.style.visibility = "hidden";
          root.append(c); row.push(c);
        }
        cells.push(row);
      });
      g = { key, root, cells };
      grids.set(m.id, g);
    }
    m.layers.forEach((layer, r) => {
      for (let e = 0; e < m.grid.nExpert[r]; e++) {
        const c = g.cells[r][e];
        const rep = m.grid.replicas[r][e], target = m.grid.targets[r][e], pend = m.grid.pending[r][e];
        const set = (k, v) => { if (c.getAttribute(k) !== v) c.setAttribute(k, v); };
        set("data-replicas", rep >= 4 ? "4+" : String(rep));
        set("data-target", String(target));
        set("data-hot", String(target > 1));
        set("data-pending", String(pend > 0));
        set("title", "layer " + layer + ", expert " + e + ": " + rep + " replica(s), target " + target + (pend ? ", " + pend + " leased" : "") + ", load " + m.grid.load[r][e] + "x");
      }
    });
    return g.root;
  }

  // a paused worker says who paused it and since when: its owner or the operator (the hub's pause,
  // kept across hub restarts) or itself (a phone's battery or heat)
  const PAUSERS = { owner: "its owner", operator: "the operator", self: "itself" };
  function stateCell(w) {
    const state = w.quarantined ? "quarantined" : w.draining ? "draining" : w.paused ? "paused" : w.live ? "live" : "offline";
    const cls = state === "quarantined" ? "draining" : state;
    if (state !== "paused") return el("td", { class: cls, "data-state": state }, state);
    const p = w.paused;
    const text = "paused by " + (PAUSERS[p.by] || p.by) + " since " + new Date(p.at).toLocaleString() + (p.reason ? ": " + p.reason : "");
    return el("td", { class: cls, "data-state": state, "data-paused-by": p.by, "data-paused-at": String(p.at), title: (w.live ? "connected" : "offline") + ", left out of placements until resumed" }, text);
  }

  // a pause kept for a worker the hub no longer lists (it forgot it, or never saw it): without
  // this row the operator would not know the pause still waits for it
  function unlistedRow(p) {
    const side = p.hub ? { by: p.hub.by, at: p.hub.at, reason: p.hub.reason } : { by: "self", at: p.self.at, reason: p.self.reason };
    const a = p.away || {};
    const text = "paused by " + (PAUSERS[side.by] || side.by) + (side.reason ? " (" + side.reason + ")" : "") +
      ", worker not seen " + (a.lastSeen === undefined ? "since the pause (" + new Date(side.at).toLocaleString() + ")" : "since " + new Date(a.lastSeen).toLocaleString()) +
      (a.dropsAt === undefined ? "" : "; dropped " + new Date(a.dropsAt).toLocaleString() + " unless it returns or is resumed");
    return el("tr", { "data-worker": p.worker, "data-unlisted": "true" },
      el("td", {}, p.worker),
      el("td", { class: "paused", "data-state": "paused-unseen", "data-paused-by": side.by, "data-last-seen": a.lastSeen === undefined ? "" : String(a.lastSeen), "data-drops-at": String(a.dropsAt) }, text),
      el("td", {}, "-"), el("td", {}, "-"), el("td", {}, "-"), el("td", {}, "-"), el("td", {}, "-"));
  }

  function render(s) {
    const tps = s.tokensPerSecond;
    history.push(tps); if (history.length > 90) history.shift();
    $("tps").textContent = tps.toFixed(tps < 10 ? 2 : 1);
    $("spark").replaceChildren(sparkline(history));
    $("updated").textContent = "updated " + new Date(s.time).toLocaleTimeString();
    $("error").textContent = "";

    const models = $("models");
    const keep = [];
    for (const m of s.models) {
      const sec = el("section", { "data-model": m.id });
      sec.append(el("h2", {}, m.id + (m.arch ? " (" + m.arch + ")" : "")));
      sec.append(el("div", { class: "chips" },
        el("span", { class: "chip" }, m.layers.length + " MoE layers x " + m.experts + " experts"),
        el("span", { class: "chip", "data-stat": "uncovered" }, m.uncovered + " uncovered"),
        el("span", { class: "chip", "data-stat": "below-target" }, m.belowTarget + " below target"),
        el("span", { class: "chip", "data-stat": "hot" }, m.hot + " hot"),
        el("span", { class: "chip" }, m.leases + " leased"),
        el("span", { class: "chip" }, m.tokensPerSecond.toFixed(2) + " tok/s"),
        el("span", { class: "chip" }, "placement v" + m.placementVersion)));
      sec.append(heatmap(m));
      sec.append(el("div", { class: "legend" },
        el("span", {}, el("span", { class: "cell", "data-replicas": "0" }), "no replica"),
        el("span", {}, el("span", { class: "cell", "data-replicas": "1" }), "1"),
        el("span", {}, el("span", { class: "cell", "data-replicas": "2" }), "2"),
        el("span", {}, el("span", { class: "cell", "data-replicas": "3" }), "3"),
        el("span", {}, el("span", { class: "cell", "data-replicas": "4+" }), "4+ replicas"),
        el("span", {}, el("span", { class: "cell", "data-replicas": "1", "data-hot": "true" }), "hot (target > 1)"),
        el("span", {}, el("span", { class: "cell", "data-replicas": "0", "data-pending": "true" }), "leased, downloading")));
      keep.push(sec);
    }
    models.replaceChildren(...keep);

    const rows = s.workers.map((w) => el("tr", { "data-worker": w.id },
      el("td", {}, w.id),
      stateCell(w),
      el("td", {}, w.slices.map((x) => x.model + " L" + x.layers + " E" + x.experts).join("; ") || "-"),
      el("td", { "data-credits": String(w.expertTokens) }, fmtNum(w.expertTokens)),
      el("td", {}, w.latencyMs === undefined ? "-" : w.latencyMs.toFixed(1) + " ms"),
      el("td", {}, w.rttMs === undefined ? "-" : w.rttMs.toFixed(1) + " ms"),
      el("td", {}, w.inFlight === undefined ? "-" : String(w.inFlight))));
    $("workers").replaceChildren(...rows, ...(s.unlistedPauses || []).map(unlistedRow));
    $("worker-count").textContent = s.workers.filter((w) => w.live).length + " live / " + s.workers.length + " known";

    $("leases").replaceChildren(...s.leases.map((l) => el("tr", {},
      el("td", {}, l.worker), el("td", {}, l.model), el("td", {}, "L" + l.layers + " E" + l.experts),
      el("td", {}, fmtBytes(l.bytes)), el("td", {}, Math.max(0, Math.round((l.expiresAt - s.time) / 1000)) + " s"))));
    $("backbones").replaceChildren(...s.backbones.map((b) => el("tr", {},
      el("td", {}, b.id), el("td", {}, b.model), el("td", {}, b.tokensPerSecond.toFixed(2)))));
    document.body.dataset.renders = String(Number(document.body.dataset.renders || "0") + 1);
  }

  async function poll() {
    try {
      const res = await fetch("/api/status", { headers: token ? { authorization: "Bearer " + token } : {}, cache: "no-store" });
      if (!res.ok) {
        let msg = res.status + " " + res.statusText;
        try { const b = await res.json(); msg = b.error.code + ": " + b.error.message; } catch {}
        if (res.status === 401) msg += " (open this page as /#token=<token>)";
        throw new Error(msg);
      }
      render(await res.json());
    } catch (e) {
      $("error").textContent = "cannot read the hub's status: " + e.message;
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }
  poll();
})();
`;

const BODY = `<header>
  <h1>moeswarm hub</h1>
  <div><span class="big" id="tps">-</span> <span class="muted">tokens/s</span> <span id="spark"></span></div>
  <div class="muted" id="worker-count"></div>
  <div class="muted" id="updated"></div>
  <div id="error"></div>
</header>
<main>
  <div id="models"></div>
  <section><h2>Workers</h2>
    <table><thead><tr><th>worker</th><th>state</th><th>slices</th><th>credits (expert-tokens)</th><th>latency</th><th>heartbeat rtt</th><th>in flight</th></tr></thead>
    <tbody id="workers"></tbody></table></section>
  <section><h2>Leases</h2>
    <table><thead><tr><th>worker</th><th>model</th><th>slice</th><th>size</th><th>expires in</th></tr></thead>
    <tbody id="leases"></tbody></table></section>
  <section><h2>Backbones</h2>
    <table><thead><tr><th>backbone</th><th>model</th><th>tokens/s</th></tr></thead>
    <tbody id="backbones"></tbody></table></section>
</main>`;

let page: { html: Buffer; csp: string } | undefined;

/** The page and its Content-Security-Policy (the inline script allowed by its hash only). */
export function dashboardPage(): { html: Buffer; csp: string } {
  if (!page) {
    const hash = createHash("sha256").update(SCRIPT).digest("base64");
    page = {
      html: Buffer.from(
        `<!doctype html>\n<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">` +
          `<link rel="icon" href="data:,"><title>moeswarm hub</title><style>${STYLE}</style></head><body>${BODY}<script>${SCRIPT}</script></body></html>\n`,
      ),
      csp: [
        "default-src 'none'",
        `script-src 'sha256-${hash}'`,
        "style-src 'unsafe-inline'",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
      ].join("; "),
    };
  }
  return page;
}
