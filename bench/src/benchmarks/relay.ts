import type { ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { fileURLToPath } from "node:url";
import { isMoeswarmError, sleep } from "@moeswarm/core";
import { mintToken } from "@moeswarm/hub";
import { connectRelay, type DispatchRequest, type RelayConnection } from "@moeswarm/relay-client";
import { type Benchmark, measure, type Row } from "../harness.js";
import { spawnPeer as forkPeer, stopChildren } from "./children.js";

const EMBD = 3072;
const K = 8;
const MODEL = "bench-moe";
const MAX = 64 * 1024 * 1024;
const LATENCY_MS = 2500;
const THROUGHPUT_MS = 2500;
const DEPTH = 16;

const PEER = fileURLToPath(new URL("./relay-peer.ts", import.meta.url));

const spawnPeer = (args: { mode: string; [more: string]: unknown }) => forkPeer(PEER, args);

function makeRequest(n: number): DispatchRequest {
  const x = new Float32Array(n * EMBD);
  for (let i = 0; i < x.length; i++) x[i] = Math.sin(i);
  const ids = new Int32Array(n * K).map((_, i) => i % 8);
  const w = new Float32Array(n * K).fill(1 / K);
  // mode "sum": the worker answers n*embd values, the shape a dispatcher asks of a remote worker
  return { model: MODEL, layer: 0, n, embd: EMBD, x, k: K, ids, w, mode: "sum" };
}

/** Requests per second with DEPTH requests kept outstanding for `ms`. */
async function throughput(conn: RelayConnection, req: DispatchRequest, ms: number): Promise<number> {
  let done = 0;
  const end = performance.now() + ms;
  const lane = async () => {
    while (performance.now() < end) {
      await conn.request("echo", req, { deadlineMs: 30_000 });
      done++;
    }
  };
  const t0 = performance.now();
  await Promise.all(Array.from({ length: DEPTH }, lane));
  return (done * 1000) / (performance.now() - t0);
}

export const relay: Benchmark = {
  name: "relay",
  description:
    "dispatch round trips backbone -> relay -> echo worker -> relay -> backbone (three processes, loopback) vs a direct WebSocket to the same worker process",
  async run() {
    const secret = randomBytes(32).toString("hex");
    const children: ChildProcess[] = [];
    const conns: RelayConnection[] = [];
    try {
      const relayPeer = await spawnPeer({ mode: "relay", secret });
      children.push(relayPeer.child);
      const relayUrl = relayPeer.info.url!;
      // bound to the ids the peers say hello with: the relay refuses unbound tokens by default
      const token = (role: "worker" | "backbone", id: string) => mintToken({ role, id, ttlS: 3600 }, secret);
      const workerPeer = await spawnPeer({
        mode: "worker",
        relayUrl,
        token: token("worker", "echo"),
        model: MODEL,
      });
      children.push(workerPeer.child);
      const options = {
        role: "backbone" as const,
        id: "bench",
        maxFrameBytes: MAX,
        token: token("backbone", "bench"),
      };
      const viaRelay = await connectRelay(relayUrl, options);
      const direct = await connectRelay(workerPeer.info.directUrl!, options);
      conns.push(viaRelay, direct);

      // the worker's register may trail its connect: retry the first request until it is routable
      const probe = makeRequest(1);
      for (let i = 0; ; i++) {
        try {
          await viaRelay.request("echo", probe);
          break;
        } catch (error) {
          if (i > 200 || !isMoeswarmError(error, "MOESWARM_TRANSPORT_UNKNOWN_PEER")) throw error;
          await sleep(10);
        }
      }

      const rows: Row[] = [];
      const ratios: Record<string, number> = {};
      for (const n of [1, 64]) {
        const req = makeRequest(n);
        const mb = (n * EMBD * 4 * 2) / 1e6; // activations out + result back
        const stats: Record<string, { p50: number; p99: number; rps: number }> = {};
        for (const [path, conn] of [
          ["direct", direct],
          ["relay", viaRelay],
        ] as const) {
          const t = await measure(`${path} n=${n}`, () => conn.request("echo", req), {
            minTimeMs: LATENCY_MS,
            warmup: 20,
            minSamples: 50,
          });
          const rps = await throughput(conn, req, THROUGHPUT_MS);
          stats[path] = { p50: t.medianNs / 1e6, p99: t.p99Ns / 1e6, rps };
          rows.push({
            path,
            tokens: n,
            "frame KB": Math.round((n * EMBD * 4) / 1024),
            "p50 ms": t.medianNs / 1e6,
            "p99 ms": t.p99Ns / 1e6,
            samples: t.iterations,
            [`req/s @${DEPTH}`]: rps,
            "MB/s": rps * mb,
          });
        }
        const d = stats.direct!;
        const r = stats.relay!;
        ratios[`relay/direct p50 latency, ${n} token${n > 1 ? "s" : ""}`] = r.p50 / d.p50;
        ratios[`relay/direct p99 latency, ${n} token${n > 1 ? "s" : ""}`] = r.p99 / d.p99;
        ratios[`relay/direct throughput, ${n} token${n > 1 ? "s" : ""}`] = r.rps / d.rps;
      }
      return {
        rows,
        ratios,
        notes: [
          `n_embd ${EMBD}, k ${K}, f32 activations, mode "sum" (result = n x n_embd f32); the worker echoes without computing`,
          "relay and worker each run in their own process; the backbone (this process) uses @moeswarm/relay-client on both paths",
          `latency: one request at a time; throughput: ${DEPTH} requests outstanding`,
        ],
      };
    } finally {
      await Promise.all(conns.map((c) => c.close()));
      await stopChildren(children);
    }
  },
};
