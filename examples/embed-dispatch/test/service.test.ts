import { spawnSync } from "node:child_process";
import type { AddressInfo } from "node:net";
import { referenceMoe, route } from "@moeswarm/dispatch";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createMoeService, LAYER, N_EMBD, N_EXPERT, ROUTING, tinyExperts } from "../src/service.js";

const here = new URL("..", import.meta.url);

describe("the package resolves from plain consumers (built dist)", () => {
  // a tiny end-to-end dispatch printed by each consumer; both must agree
  const program = (load: string) => `${load}
const { dispatchExperts, InProcessTransport, Placement } = d;
const worker = (req) => ({ mode: req.mode, n: req.n, k: req.k, embd: req.embd, y: new Float32Array(req.n * req.k * req.embd).fill(0.5) });
const placement = Placement.fromRegistrations([{ id: "w", model: "m", layers: [0], experts: [0, 1] }]);
const routing = { n: 1, k: 2, ids: Int32Array.from([1, 0]), weights: Float32Array.from([0.25, 0.5]) };
Promise.resolve(dispatchExperts(new Float32Array(2), routing, { layer: 0, placement, transport: new InProcessTransport({ w: worker }) }))
  .then((y) => console.log(typeof dispatchExperts, Array.from(y).join(",")));`;

  it("ESM: import { dispatchExperts } from '@moeswarm/dispatch'", () => {
    const r = spawnSync(
      process.execPath,
      ["--input-type=module", "-e", program("import * as d from '@moeswarm/dispatch';")],
      { cwd: here, encoding: "utf8" },
    );
    expect(r.stderr).toBe("");
    expect(r.stdout.trim()).toBe("function 0.375,0.375");
  });

  it("CJS: require('@moeswarm/dispatch')", () => {
    const r = spawnSync(process.execPath, ["-e", program("const d = require('@moeswarm/dispatch');")], {
      cwd: here,
      encoding: "utf8",
    });
    expect(r.stderr).toBe("");
    expect(r.stdout.trim()).toBe("function 0.375,0.375");
  });
});

describe("the MoE service", () => {
  const { server, metrics } = createMoeService({ workers: 3 });
  let url = "";
  beforeAll(async () => {
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    url = `http://127.0.0.1:${(server.address() as AddressInfo).port}/moe`;
  });
  afterAll(async () => {
    await new Promise((resolve) => server.close(resolve));
  });

  const post = (body: unknown) =>
    fetch(url, { method: "POST", body: typeof body === "string" ? body : JSON.stringify(body) });

  it("routes, dispatches to the workers and returns the combined output", async () => {
    const hidden = Array.from({ length: 3 }, (_, i) =>
      Array.from({ length: N_EMBD }, (_, c) => Math.sin(i * 7 + c)),
    );
    const logits = Array.from({ length: 3 }, (_, i) =>
      Array.from({ length: N_EXPERT }, (_, e) => Math.cos(i + e * 3)),
    );
    const res = await post({ hidden, logits });
    expect(res.status).toBe(200);
    const body = (await res.json()) as { output: number[][]; ids: number[][]; metrics: { requests: number } };
    // against the f64 oracle on the same routing
    const routing = route(Float32Array.from(logits.flat()), ROUTING);
    expect(body.ids).toEqual([0, 1, 2].map((i) => Array.from(routing.ids.subarray(i * 2, i * 2 + 2))));
    const oracle = referenceMoe(Float32Array.from(hidden.flat()), routing, tinyExperts(), { layer: LAYER });
    const got = body.output.flat();
    for (let i = 0; i < got.length; i++) expect(got[i]).toBeCloseTo(oracle[i]!, 5);
    expect(body.metrics.requests).toBeGreaterThan(0);
    expect(metrics.snapshot().calls).toBe(1);
  });

  it("answers 400 to malformed requests and 404 elsewhere", async () => {
    expect((await post("{not json")).status).toBe(400);
    expect((await post({ hidden: [[1]], logits: [[1]] })).status).toBe(400);
    expect((await post({ hidden: [Array(N_EMBD).fill(0)], logits: [] })).status).toBe(400);
    expect((await fetch(url.replace("/moe", "/other"))).status).toBe(404);
  });
});
