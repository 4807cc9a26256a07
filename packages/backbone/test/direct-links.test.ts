// Direct links in a real decode: one llama-cpu worker that can only dial out (the relay carries
// its requests) and one that also listens on its own TLS endpoint (the backbone dials it, pinning
// the certificate's fingerprint from the hub's placement, with a ticket the hub signed). Both
// paths carry frames and the tokens and logits are bit-identical to plain llama.cpp; then the
// direct endpoint dies in the middle of a decode and nothing is lost (its requests go over the
// relay), still bit-identical.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { mintToken } from "@moeswarm/hub";
import {
  type DirectServer,
  DirectTransport,
  type IncomingDispatch,
  selfSignedCertificate,
  serveDirect,
} from "@moeswarm/relay-client";
import { Agent, request } from "undici";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type BackboneBridge, runLogitsHarness, serveBackboneBridge } from "../src/index.js";
import { connectComputeToRelay, firstByteDiff, nativeMissing, split } from "./helpers.js";
import { useRelaySwarm } from "./relay-swarm-fixture.js";

const missing = nativeMissing();
const SECRET = "backbone-direct-links-test-secret-01";
const MODEL_ID = "direct";
const N_PREDICT = 24;

describe.skipIf(Boolean(missing))(
  "direct links: one relay-only worker and one reachable one, in one decode",
  () => {
    const fx = useRelaySwarm({
      prefix: "mswb-direct-",
      secret: SECRET,
      model: MODEL_ID,
      preset: "small",
      tls: true,
    });
    let agent: Agent;
    let direct: DirectServer | undefined;
    /** What the direct endpoint does with each dispatch it gets (the kill test replaces it). */
    let onDirect: (
      d: IncomingDispatch,
      run: () => Promise<{ y: Float32Array }>,
    ) => Promise<{ y: Float32Array }> = (_d, run) => run();

    beforeAll(async () => {
      const certs = fx.swarm.certs!;
      agent = new Agent({ connect: { ca: certs.ca } });
      const [lo, hi] = split(fx.info.nExpert, 2) as [number[], number[]];

      // "rw": dials out to the relay only
      await fx.swarm.join("rw", lo);

      // "dw": the relay too, and its own endpoint, published to the hub before it registers
      const dw = await fx.swarm.spawn("dw", hi);
      const tls = await selfSignedCertificate();
      const workerToken = mintToken({ role: "worker", id: "dw", ttlS: 600 }, SECRET);
      direct = await serveDirect({
        id: "dw",
        ...tls,
        host: "127.0.0.1",
        hubKey: async () => {
          const { parseDirectKey } = await import("@moeswarm/relay-client");
          const res = await request(`${fx.url}/api/direct/key`, { dispatcher: agent });
          return parseDirectKey(await res.body.json());
        },
        onDispatch: (d) =>
          onDirect(d, async () => ({
            y: await dw.run(
              {
                layer: d.layer,
                x: d.activations(),
                ids: d.ids,
                k: d.k,
                ...(d.w ? { w: d.w } : {}),
                mode: d.mode,
              },
              { signal: d.signal },
            ),
          })),
      });
      const put = await request(`${fx.url}/api/workers/dw/direct`, {
        method: "PUT",
        dispatcher: agent,
        headers: { authorization: `Bearer ${workerToken}`, "content-type": "application/json" },
        body: JSON.stringify({
          endpoints: [`wss://127.0.0.1:${direct.port}`],
          fingerprint: direct.fingerprint,
        }),
      });
      expect(put.statusCode, await put.body.text()).toBe(200);
      const d = fx.swarm.track(
        "dw",
        await connectComputeToRelay(fx.swarm.relayUrl, {
          id: "dw",
          secret: SECRET,
          compute: dw,
          ca: certs.ca,
        }),
      );
      d.register({ model: MODEL_ID, layers: fx.info.layers, experts: hi, backend: "llama-cpu" });
    });
    afterAll(async () => {
      // before the fixture closes the swarm (its afterAll runs after this one)
      await direct?.close();
      await agent?.close();
    });

    it("both paths carry frames, tokens bit-identical; a direct link killed mid-decode loses nothing", async () => {
      await using bridge: BackboneBridge = await serveBackboneBridge({
        socket: join(fx.tmp.dir, "bridge.sock"),
        hub: {
          url: fx.url,
          token: mintToken({ role: "backbone", id: "bb-direct", ttlS: 3600 }, SECRET),
          model: MODEL_ID,
          ca: fx.swarm.certs!.ca,
          statsIntervalMs: 0,
          pollWaitS: 10,
          // after the kill, the relay carries the rest of the decode (no redial within the test)
          directBackoff: { initialDelayMs: 600_000, jitter: 0 },
        },
        trust: "own",
      });
      const link = bridge.hub!;
      const placed = await link.waitForPlacement((p) => p.missing.length === 0 && p.direct.has("dw"));
      expect(placed.direct.get("dw")).toEqual({
        endpoints: [`wss://127.0.0.1:${direct!.port}`],
        fingerprint: direct!.fingerprint,
      });
      expect(placed.direct.has("rw")).toBe(false);
      const transport = link.transport as DirectTransport;
      expect(transport).toBeInstanceOf(DirectTransport);
      expect(await transport.linked("dw")).toBe(true);

      const common = {
        modelPath: fx.modelPath,
        prompt: "Two paths, one answer",
        nPredict: N_PREDICT,
        threads: 1,
      };
      const plainLogits = join(fx.tmp.dir, "plain.bin");
      const plain = await runLogitsHarness({ ...common, logitsPath: plainLogits });
      expect(plain.ok, plain.stderr).toBe(true);
      const decode = async (name: string) => {
        const logitsPath = join(fx.tmp.dir, `${name}.bin`);
        const r = await runLogitsHarness({
          ...common,
          logitsPath,
          plugin: { bridge: bridge.address, layers: "all", model: MODEL_ID },
        });
        expect(r.ok, r.stderr).toBe(true);
        expect(r.tokens).toEqual(plain.tokens);
        expect(firstByteDiff(readFileSync(logitsPath), readFileSync(plainLogits))).toBe(-1);
        return bridge.metrics();
      };

      // 1. both paths in one decode
      const m1 = await decode("both");
      const c1 = link.metrics().direct!;
      const owners = m1.dispatch.owners;
      expect(owners.rw?.requests ?? 0).toBeGreaterThan(0);
      expect(owners.dw?.requests ?? 0).toBeGreaterThan(0);
      // every request to dw went direct (the link was up before the decode), every one to rw over the relay
      expect(c1.direct).toBe(owners.dw!.requests);
      expect(c1.relay).toBe(owners.rw!.requests);
      expect(direct!.stats()).toMatchObject({ accepted: 1, refused: 0, dispatches: c1.direct });
      expect(c1).toMatchObject({ retried: 0, dialFailures: 0, linked: ["dw"] });
      expect(m1.failed).toBe(0);
      expect(m1.failovers).toBe(0);
      expect(m1.fallbacks).toBe(0);

      // 2. the direct endpoint dies while it holds a request, halfway through the decode
      const killAt = Math.max(2, Math.floor(c1.direct / 2));
      let seen = 0;
      onDirect = async (d, run) => {
        seen++;
        if (seen !== killAt) return run();
        void direct!.close();
        // never answered: the link is gone, the backbone must send it again over the relay
        await new Promise((resolve) => d.signal.addEventListener("abort", resolve, { once: true }));
        throw new Error("killed");
      };
      const m2 = await decode("killed");
      const c2 = link.metrics().direct!;
      expect(seen).toBe(killAt);
      expect(c2.retried).toBe(1);
      expect(c2.linked).toEqual([]);
      // after the kill, dw's requests went over the relay
      expect(c2.relay - c1.relay).toBeGreaterThan(m2.dispatch.owners.rw!.requests - owners.rw!.requests);
      expect(m2.failed).toBe(0);
      expect(m2.fallbacks).toBe(0);
    });

    it("the hub mints tickets for backbone tokens only, and takes endpoints from the worker itself", async () => {
      const post = async (token: string, body: unknown) => {
        const r = await request(`${fx.url}/api/direct/tickets`, {
          method: "POST",
          dispatcher: agent,
          headers: { authorization: `Bearer ${token}`, "content-type": "application/json" },
          body: JSON.stringify(body),
        });
        return {
          status: r.statusCode,
          json: (await r.body.json()) as { error?: { code: string }; ticket?: string },
        };
      };
      const workerToken = mintToken({ role: "worker", id: "dw", ttlS: 60 }, SECRET);
      expect(await post(workerToken, { worker: "dw" })).toMatchObject({
        status: 403,
        json: { error: { code: "MOESWARM_AUTH_ROLE" } },
      });
      const bb = mintToken({ role: "backbone", id: "bb1", ttlS: 60 }, SECRET);
      expect(await post(bb, { worker: "dw", backbone: "bb2" })).toMatchObject({
        status: 403,
        json: { error: { code: "MOESWARM_AUTH_ROLE" } },
      });
      const minted = await post(bb, { worker: "dw" });
      expect(minted.status).toBe(200);
      const claims = JSON.parse(Buffer.from(minted.json.ticket!.split(".")[1]!, "base64url").toString());
      expect(claims).toMatchObject({ sub: "bb1", wk: "dw" });

      // another worker cannot move dw's endpoints
      const put = await request(`${fx.url}/api/workers/dw/direct`, {
        method: "PUT",
        dispatcher: agent,
        headers: {
          authorization: `Bearer ${mintToken({ role: "worker", id: "rw", ttlS: 60 }, SECRET)}`,
          "content-type": "application/json",
        },
        body: JSON.stringify({ endpoints: ["wss://evil:1"], fingerprint: direct!.fingerprint }),
      });
      expect(put.statusCode).toBe(403);
      expect(((await put.body.json()) as { error: { code: string } }).error.code).toBe("MOESWARM_AUTH_ROLE");
    });
  },
);
