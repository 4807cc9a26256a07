// docs/deploy.md, run: Debian's nginx on loopback with a generated certificate, configured with
// the page's own `nginx` block, in front of a plain-HTTP hub; the demo's pieces (worker processes,
// the backbone bridge, llama.cpp with the plugin) reach the hub only through it. The tokens and
// logits must equal plain llama.cpp's, and the hub must count clients under their own addresses:
// nginx connects to the hub from 127.0.0.2 (proxy_bind, this test's only addition to the file),
// the clients come from 127.0.0.1 and 127.0.0.3.
import { type ChildProcess, spawn, spawnSync } from "node:child_process";
import { mkdirSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createLocalFallback, runLogitsHarness, serveBackboneBridge } from "@moeswarm/backbone";
import { createHub, createLoopbackCertificates, mintToken } from "@moeswarm/hub";
import { ensureSyntheticModel, findExpertTensors, readGguf } from "@moeswarm/shard";
import { Agent, request, WebSocket } from "undici";
import { afterAll, describe, expect, it } from "vitest";
import { spawnWorkers, stopWorkers, type WorkerView } from "../src/workers.js";

const repo = join(import.meta.dirname, "..", "..", "..");
const NGINX = ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"].find(
  (p) => spawnSync(p, ["-v"]).status === 0,
);
if (!NGINX) {
  console.log(
    "nginx-proxy test skipped: no nginx on this machine (CI installs Debian's: apt-get install nginx)",
  );
}

const tmp = mkdtempSync(join(tmpdir(), "moeswarm-nginx-"));
const cleanup: Array<() => unknown> = [];
afterAll(async () => {
  for (const step of cleanup.reverse()) {
    try {
      await step();
    } catch {
      // keep closing the rest
    }
  }
  rmSync(tmp, { recursive: true, force: true });
});

async function freePort(): Promise<number> {
  const server = createServer();
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as { port: number }).port;
  await new Promise((resolve) => server.close(resolve));
  return port;
}

/** docs/deploy.md's nginx block, pointed at this test's hub, port and certificate. */
function deployConfig(hubPort: number, port: number, cert: string, key: string): string {
  const doc = readFileSync(join(repo, "docs", "deploy.md"), "utf8");
  const block = /```nginx\n([\s\S]*?)```/.exec(doc)?.[1];
  if (!block) throw new Error("docs/deploy.md has no ```nginx block");
  let conf = block;
  const swap = (from: string, to: string) => {
    if (!conf.includes(from))
      throw new Error(`docs/deploy.md's nginx block no longer has ${JSON.stringify(from)}`);
    conf = conf.replace(from, to);
  };
  swap("server 127.0.0.1:8443;", `server 127.0.0.1:${hubPort};`);
  swap("listen 443 ssl;", `listen 127.0.0.1:${port} ssl;`);
  swap("listen [::]:443 ssl;", "");
  swap("/etc/letsencrypt/live/hub.example.org/fullchain.pem", cert);
  swap("/etc/letsencrypt/live/hub.example.org/privkey.pem", key);
  // the one addition: the proxy's own address differs from the clients'
  swap("proxy_pass http://moeswarm_hub;", "proxy_pass http://moeswarm_hub;\n        proxy_bind 127.0.0.2;");
  const dir = join(tmp, "nginx");
  for (const d of ["body", "proxy", "fastcgi", "uwsgi", "scgi"]) mkdirSync(join(dir, d), { recursive: true });
  return [
    // as root nginx's workers would drop to nobody, who cannot read this test's temp dirs
    process.getuid?.() === 0 ? "user root root;" : "",
    "daemon off;",
    "worker_processes 1;",
    `pid ${join(dir, "nginx.pid")};`,
    "error_log stderr warn;",
    "events { worker_connections 1024; }",
    "http {",
    "    access_log off;",
    ...["body", "proxy", "fastcgi", "uwsgi", "scgi"].map(
      (d) => `    ${d === "body" ? "client_body" : d}_temp_path ${join(dir, d)};`,
    ),
    conf,
    "}",
    "",
  ].join("\n");
}

async function startNginx(config: string, url: string, ca: string): Promise<ChildProcess> {
  const file = join(tmp, "nginx", "nginx.conf");
  writeFileSync(file, config);
  const test = spawnSync(NGINX as string, ["-t", "-p", join(tmp, "nginx"), "-c", file], { encoding: "utf8" });
  expect(test.status, test.stderr).toBe(0);
  const child = spawn(NGINX as string, ["-p", join(tmp, "nginx"), "-c", file], {
    stdio: ["ignore", "inherit", "pipe"],
  });
  let stderr = "";
  child.stderr?.on("data", (c: Buffer) => {
    stderr += c.toString();
  });
  cleanup.push(async () => {
    const exited = new Promise((resolve) => child.once("exit", resolve));
    child.kill("SIGQUIT");
    await exited;
  });
  const agent = new Agent({ connect: { ca } });
  for (let i = 0; ; i++) {
    try {
      const r = await request(`${url}/api/health`, { dispatcher: agent });
      await r.body.dump();
      if (r.statusCode === 200) break;
    } catch (error) {
      if (i > 200 || child.exitCode !== null) throw new Error(`nginx did not come up: ${stderr} ${error}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
  await agent.close();
  return child;
}

async function health(url: string, agent: Agent, headers: Record<string, string> = {}) {
  const r = await request(`${url}/api/health`, { dispatcher: agent, headers });
  return (await r.body.json()) as { client: { address: string; proxy?: string } };
}

/** Waits (long-polls through the proxy) until every expert has `replicas` owners. */
async function waitForCoverage(
  url: string,
  model: string,
  agent: Agent,
  workers: WorkerView[],
  replicas: number,
) {
  let since = 0;
  const deadline = Date.now() + 180_000;
  for (;;) {
    const dead = workers.find((w) => w.exitCode !== undefined);
    if (dead) throw new Error(`${dead.id} exited: ${dead.stderr.join("\n")}`);
    if (Date.now() > deadline) throw new Error("the workers did not cover the model through the proxy");
    const r = await request(`${url}/api/models/${model}/placement?since=${since}&wait=30`, {
      dispatcher: agent,
    });
    if (r.statusCode === 304) {
      await r.body.dump();
      continue;
    }
    const body = (await r.body.json()) as {
      version: number;
      missing: unknown[];
      registrations: Array<{ id: string; layers: number[]; experts: number[] }>;
    };
    since = body.version;
    const owners = new Map<string, Set<string>>();
    for (const reg of body.registrations)
      for (const l of reg.layers)
        for (const e of reg.experts)
          owners.set(`${l}:${e}`, (owners.get(`${l}:${e}`) ?? new Set()).add(reg.id));
    if (
      body.missing.length === 0 &&
      owners.size > 0 &&
      Math.min(...[...owners.values()].map((s) => s.size)) >= replicas
    )
      return;
  }
}

describe.skipIf(!NGINX)("a hub behind nginx on TLS, as docs/deploy.md configures it", () => {
  it("serves workers and a backbone through the proxy: identical tokens and logits, clients counted by their own address", async () => {
    const started = performance.now();
    const certs = await createLoopbackCertificates({ hosts: ["localhost", "127.0.0.1"], days: 1 });
    const [certFile, keyFile, caFile] = ["cert.pem", "key.pem", "ca.pem"].map((f) => join(tmp, f)) as [
      string,
      string,
      string,
    ];
    writeFileSync(certFile, certs.cert);
    writeFileSync(keyFile, certs.key);
    writeFileSync(caFile, certs.ca);

    const model = await ensureSyntheticModel("tiny", { cacheDir: join(tmp, "models") });
    const moe = findExpertTensors(await readGguf(model.path));
    const expertBytes = moe.layers.reduce((sum, l) => sum + Number(l.bytesPerExpert) * l.nExpert, 0);
    const id = "tiny";
    const secret = "nginx-proxy-test-secret-0123456789";
    const hub = createHub({
      secret,
      models: [{ id, path: model.path }],
      manifestDir: join(tmp, "manifests"),
      trustProxy: ["127.0.0.2"],
      limits: { maxUnauthenticatedPerAddress: 3 },
    });
    cleanup.push(() => hub.close());
    const direct = await hub.listen(0, "127.0.0.1");
    const port = await freePort();
    const url = `https://127.0.0.1:${port}`;
    await startNginx(deployConfig(direct.port, port, certFile, keyFile), url, certs.ca);

    // the proxy passes the client's address; a direct client cannot claim one (127.0.0.1 is not trusted)
    const agent = new Agent({ connect: { ca: certs.ca } });
    const agent3 = new Agent({ localAddress: "127.0.0.3", connect: { ca: certs.ca } });
    cleanup.push(
      () => agent.close(),
      () => agent3.close(),
    );
    expect((await health(url, agent)).client).toEqual({ address: "127.0.0.1", proxy: "127.0.0.2" });
    expect((await health(url, agent3, { "x-forwarded-for": "10.9.9.9" })).client).toEqual({
      address: "127.0.0.3",
      proxy: "127.0.0.2",
    });
    expect((await health(direct.url, new Agent(), { "x-forwarded-for": "10.9.9.9" })).client).toEqual({
      address: "127.0.0.1",
    });

    // two workers (processes) through the proxy: claim, download (streamed through nginx), serve
    const ids = ["worker-0", "worker-1"];
    const workers = spawnWorkers({
      count: 2,
      ids,
      hubUrl: url,
      model: id,
      tokens: ids.map((w) => mintToken({ role: "worker", id: w, ttlS: 3600 }, secret)),
      capacityBytes: ids.map(() => Math.ceil(expertBytes * 1.15)),
      caFile,
      cacheDirs: ids.map((w) => join(tmp, w)),
      threads: 1,
      onEvent: () => {},
    });
    cleanup.push(() => stopWorkers(workers));
    await waitForCoverage(url, id, agent, workers, 2);

    // the backbone: its bridge linked to the hub through the proxy (wss relay, placement, stats)
    const fallback = await createLocalFallback(model.path, { threads: 1 });
    cleanup.push(() => fallback.close());
    const bridge = await serveBackboneBridge({
      socket: join(tmp, "bridge.sock"),
      hub: {
        url,
        token: mintToken({ role: "backbone", id: "bb", ttlS: 3600 }, secret),
        model: id,
        ca: certs.ca,
      },
      fallback: fallback.compute,
    });
    cleanup.push(() => bridge.close());
    const common = {
      modelPath: model.path,
      prompt: "The proxy passes",
      nPredict: 8,
      threads: 1,
      noMmap: true,
    };
    const plain = await runLogitsHarness({ ...common, logitsPath: join(tmp, "plain.bin") });
    expect(plain.ok, plain.stderr).toBe(true);
    const swarm = await runLogitsHarness({
      ...common,
      logitsPath: join(tmp, "swarm.bin"),
      plugin: { bridge: bridge.address, layers: "all", model: id },
    });
    expect(swarm.ok, swarm.stderr).toBe(true);
    expect(swarm.tokens).toEqual(plain.tokens);
    expect(readFileSync(join(tmp, "swarm.bin")).equals(readFileSync(join(tmp, "plain.bin")))).toBe(true);
    const m = bridge.metrics();
    // every part answered through the proxy: no failover, no fallback; the only local computes
    // are the default audits, counted apart, as many as the verification audited
    expect(m.failovers).toBe(0);
    expect(m.fallbacks).toBe(0);
    expect(m.audits).toBeGreaterThan(0);
    expect(m.audits).toBe(m.verification?.audits);
    expect(m.requests).toBeGreaterThan(0);

    // per-address limits see the clients: three relay sockets from 127.0.0.3 that never say hello
    // fill its allowance and its fourth is refused (503), while 127.0.0.1 (the workers and the
    // backbone, also through the proxy) still opens one and decodes again
    const sockets: WebSocket[] = [];
    const open = (dispatcher: Agent) =>
      new Promise<boolean>((resolve) => {
        const ws = new WebSocket(`wss://127.0.0.1:${port}/relay`, { dispatcher } as never);
        sockets.push(ws);
        ws.onopen = () => resolve(true);
        ws.onerror = () => resolve(false);
      });
    expect([await open(agent3), await open(agent3), await open(agent3)]).toEqual([true, true, true]);
    // another client's allowance is its own (under the proxy's address this would be the fourth)
    expect(await open(agent)).toBe(true);
    expect(await open(agent3)).toBe(false);
    for (const ws of sockets) ws.close();
    const metrics = await (await request(`${url}/metrics`, { dispatcher: agent })).body.text();
    expect(metrics).toMatch(/moeswarm_hub_connections_refused_total\{reason="unauthenticated-cap"\} 1\b/);
    const again = await runLogitsHarness({
      ...common,
      logitsPath: join(tmp, "again.bin"),
      plugin: { bridge: bridge.address, layers: "all", model: id },
    });
    expect(again.tokens).toEqual(plain.tokens);
    console.log(`nginx-proxy test: ${((performance.now() - started) / 1000).toFixed(1)} s`);
  });
});
