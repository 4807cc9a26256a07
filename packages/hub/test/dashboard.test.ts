import { existsSync, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { connectRelay, type RelayConnection } from "@moeswarm/relay-client";
import { type BrowserContext, chromium, type Page } from "playwright-core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createHub, type Hub, mintToken } from "../src/index.js";
import {
  call,
  copyModel,
  relayDispatch,
  syntheticModel,
  type TempDir,
  tempDir,
  waitFor,
} from "./hub-helpers.js";

/*
 * The dashboard in a real browser: Debian's chromium, driven by playwright-core (no browser
 * download). CI installs chromium (.ci/run); where it is absent the test says so and is skipped.
 */
const CHROMIUM = process.env.MOESWARM_CHROMIUM ?? "/usr/bin/chromium";
const hasChromium = existsSync(CHROMIUM);
if (!hasChromium) {
  console.warn(
    `dashboard.test.ts skipped: no Chromium at ${CHROMIUM} (apt-get install -y chromium, or set MOESWARM_CHROMIUM)`,
  );
}
// the page's globals, for the functions evaluated in it (this package compiles without the DOM lib)
declare const document: {
  querySelector(selector: string): { getAttribute(name: string): string | null } | null;
};
declare function getComputedStyle(element: unknown): { backgroundColor: string; boxShadow: string };

const OUTPUT = fileURLToPath(new URL("../test-output/", import.meta.url));

const SECRET = "hub-dashboard-secret-0123456789abcdef";
const ID = "tiny";

let tmp: TempDir;
let hub: Hub;
let base: string;
let relayUrl: string;
let profile: string;
let context: BrowserContext | undefined;
let page: Page;
const errors: string[] = [];
const open: RelayConnection[] = [];

async function worker(id: string, layers: number[], experts: number[]): Promise<void> {
  const c = await connectRelay(relayUrl, {
    role: "worker",
    id,
    token: mintToken({ role: "worker", id, ttlS: 600 }, SECRET),
    reconnect: false,
    onDispatch: () => ({ y: new Float32Array(0) }),
  });
  open.push(c);
  c.register({ model: ID, layers, experts });
}

describe.skipIf(!hasChromium)("dashboard (headless Chromium)", () => {
  beforeAll(async () => {
    tmp = tempDir();
    hub = createHub({
      secret: SECRET,
      models: [{ id: ID, path: copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf") }],
      // one copy per expert, and fake workers that register without claiming
      replicas: 1,
      requireLeases: false,
      // the backbone's rate must still be fresh when the page reads it: launching Chromium on a
      // loaded machine has taken longer than the default 30 s
      market: { statsStaleMs: 600_000 },
    });
    const l = await hub.listen(0);
    base = l.url;
    relayUrl = l.relayUrl;
    await worker("worker-a", [0], [0, 1, 2, 3]);
    await worker("worker-b", [0, 1], [4, 5, 6, 7]);
    await waitFor(() => hub.market.summary(ID, Date.now()).uncovered === 4, "two registrations");
    // the report below is bounded by what the relay carried from backbone-1
    const bb = await connectRelay(relayUrl, {
      role: "backbone",
      id: "backbone-1",
      token: mintToken({ role: "backbone", id: "backbone-1", ttlS: 600 }, SECRET),
      reconnect: false,
    });
    const layer1 = [...new Array(4000).fill(0), ...Array.from({ length: 70 }, (_, i) => 1 + (i % 7))];
    await Promise.allSettled([
      relayDispatch(bb, "worker-b", ID, 1, Int32Array.from(layer1), 1),
      relayDispatch(bb, "worker-a", ID, 0, new Int32Array(1234).fill(0), 1),
    ]);
    await bb.close();
    const stats = await call(`${base}/api/models/${ID}/stats`, {
      method: "POST",
      headers: {
        authorization: `Bearer ${mintToken({ role: "backbone", id: "backbone-1", ttlS: 600 }, SECRET)}`,
        "content-type": "application/json",
      },
      body: JSON.stringify({
        tokens: 30,
        ms: 10_000,
        counts: { "1": [4000, 10, 10, 10, 10, 10, 10, 10] },
        receipts: { "worker-a": { expertTokens: 1234 } },
      }),
    });
    expect(stats.status).toBe(200);

    profile = mkdtempSync(join(tmpdir(), "moeswarm-chromium-"));
    context = await chromium.launchPersistentContext(profile, {
      executablePath: CHROMIUM,
      headless: true,
      args: [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
      ],
      viewport: { width: 1280, height: 900 },
    });
    page = context.pages()[0] ?? (await context.newPage());
    page.on("pageerror", (e) => errors.push(`pageerror: ${e.message}`));
    page.on("console", (m) => {
      if (m.type() === "error") errors.push(`console: ${m.text()}`);
    });
  }, 120_000);

  afterAll(async () => {
    await context?.close();
    await Promise.all(open.map((c) => c.close()));
    await hub?.close();
    tmp?.remove();
    if (profile) rmSync(profile, { recursive: true, force: true });
  });

  it("shows the heatmap of what the workers registered, hot experts, workers, credits and tokens/s", async () => {
    const answer = await page.goto(`${base}/`);
    expect(answer?.status()).toBe(200);
    expect(answer?.headers()["content-security-policy"]).toMatch(/script-src 'sha256-/);
    await page.waitForSelector("body[data-renders]");

    const cells = await page.$$eval(".heat .cell", (els) =>
      els.map((e) => ({
        layer: Number(e.getAttribute("data-layer")),
        expert: Number(e.getAttribute("data-expert")),
        replicas: e.getAttribute("data-replicas"),
        hot: e.getAttribute("data-hot"),
        colour: getComputedStyle(e).backgroundColor,
        outline: getComputedStyle(e).boxShadow,
      })),
    );
    expect(cells).toHaveLength(16);
    const at = (layer: number, expert: number) => cells.find((c) => c.layer === layer && c.expert === expert);
    for (let e = 0; e < 8; e++) {
      expect(at(0, e)?.replicas, `layer 0 expert ${e}`).toBe("1");
      expect(at(1, e)?.replicas, `layer 1 expert ${e}`).toBe(e < 4 ? "0" : "1");
    }
    // colour says covered or not; the hot expert is outlined
    const uncovered = at(1, 1)?.colour;
    const covered = at(0, 0)?.colour;
    expect(uncovered).toMatch(/^rgb/);
    expect(covered).toMatch(/^rgb/);
    expect(uncovered).not.toBe(covered);
    expect(at(1, 0)?.hot).toBe("true");
    expect(at(1, 0)?.outline).not.toBe("none");
    expect(at(1, 1)?.hot).toBe("false");
    expect(at(1, 1)?.outline).toBe("none");

    const rows = await page.$$eval("#workers tr", (trs) =>
      trs.map((tr) => [...tr.querySelectorAll("td")].map((td) => td.textContent)),
    );
    expect(rows).toEqual([
      ["worker-a", "live", `${ID} L0:1 E0:4`, "1234", "-", expect.any(String), "0"],
      ["worker-b", "live", `${ID} L0:2 E4:8`, "0", "-", expect.any(String), "0"],
    ]);
    expect(await page.textContent("#tps")).toBe("3.00");
    expect(await page.textContent("#backbones")).toContain("backbone-1");

    // it refreshes itself: a third worker covers the rest, the page shows it without a reload
    await worker("worker-c", [1], [0, 1, 2, 3]);
    await page.waitForFunction(
      () =>
        document.querySelector('.cell[data-layer="1"][data-expert="1"]')?.getAttribute("data-replicas") ===
        "1",
      undefined,
      { timeout: 10_000 },
    );
    expect(await page.getAttribute('.cell[data-layer="1"][data-expert="0"]', "data-replicas")).toBe("1");
    expect(await page.textContent('[data-stat="uncovered"]')).toBe("0 uncovered");

    mkdirSync(OUTPUT, { recursive: true });
    const shot = join(OUTPUT, "dashboard.png");
    await page.screenshot({ path: shot, fullPage: true });
    expect(existsSync(shot)).toBe(true);
    expect(errors).toEqual([]);
  });

  it("shows a paused worker as paused: by whom, since when and why; live again once resumed", async () => {
    const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
    const post = (action: string, body: unknown) =>
      call(`${base}/api/workers/worker-b/${action}`, {
        method: "POST",
        headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
        body: JSON.stringify(body),
      });
    const paused = await post("pause", { reason: "maintenance" });
    expect(paused.status).toBe(200);
    const at = (JSON.parse(paused.body.toString()) as { hub: { at: number } }).hub.at;
    await page.waitForSelector('[data-worker="worker-b"] td[data-state="paused"]', { timeout: 10_000 });
    const cell = await page.$eval('[data-worker="worker-b"] td[data-state]', (td) => ({
      text: td.textContent,
      by: td.getAttribute("data-paused-by"),
      at: td.getAttribute("data-paused-at"),
      title: td.getAttribute("title"),
    }));
    expect(cell).toEqual({
      text: expect.stringMatching(/^paused by the operator since .+: maintenance$/),
      by: "operator",
      at: String(at),
      title: "connected, left out of placements until resumed",
    });
    // the time is the pause's, as the browser writes a date
    const since = await page.evaluate((ms) => new Date(ms).toLocaleString(), at);
    expect(cell.text).toBe(`paused by the operator since ${since}: maintenance`);
    expect(await page.getAttribute('[data-worker="worker-a"] td[data-state]', "data-state")).toBe("live");
    expect((await post("resume", {})).status).toBe(200);
    await page.waitForSelector('[data-worker="worker-b"] td[data-state="live"]', { timeout: 10_000 });
    expect(await page.textContent('[data-worker="worker-b"] td[data-state]')).toBe("live");
    expect(errors).toEqual([]);
  });

  it("shows the pause of a worker the hub does not list: not seen since when, dropped when", async () => {
    const admin = mintToken({ role: "admin", ttlS: 600 }, SECRET);
    const ghost = (action: string) =>
      call(`${base}/api/workers/ghost-1/${action}`, {
        method: "POST",
        headers: { authorization: `Bearer ${admin}`, "content-type": "application/json" },
        body: JSON.stringify(action === "pause" ? { reason: "stolen" } : {}),
      });
    const paused = await ghost("pause");
    const body = JSON.parse(paused.body.toString()) as { hub: { at: number }; away: { dropsAt: number } };
    // never seen by this hub: listed nowhere else, and the retention (30 days) counts from the pause
    expect(body.away).toEqual({ listed: false, dropsAt: body.hub.at + 30 * 86_400_000 });
    const row = '[data-worker="ghost-1"][data-unlisted="true"] td[data-state="paused-unseen"]';
    await page.waitForSelector(row, { timeout: 10_000 });
    const cell = await page.$eval(row, (td) => ({
      text: td.textContent,
      by: td.getAttribute("data-paused-by"),
      dropsAt: td.getAttribute("data-drops-at"),
    }));
    const [since, drops] = await page.evaluate(
      ([a, d]) => [new Date(a as number).toLocaleString(), new Date(d as number).toLocaleString()],
      [body.hub.at, body.away.dropsAt],
    );
    expect(cell).toEqual({
      text: `paused by the operator (stolen), worker not seen since the pause (${since}); dropped ${drops} unless it returns or is resumed`,
      by: "operator",
      dropsAt: String(body.away.dropsAt),
    });
    // the known-workers count is of the workers the hub lists, not of these rows
    const known = hub.workers().length;
    expect(await page.textContent("#worker-count")).toBe(`${known} live / ${known} known`);
    expect(hub.workers().some((w) => w.id === "ghost-1")).toBe(false);
    expect((await ghost("resume")).status).toBe(200);
    await page.waitForSelector('[data-worker="ghost-1"]', { state: "detached", timeout: 10_000 });
    expect(errors).toEqual([]);
  });
});
