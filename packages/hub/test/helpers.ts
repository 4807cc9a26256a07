import { createServer, type Server, type Socket, connect as tcpConnect } from "node:net";

export { waitFor } from "@moeswarm/testkit";

export interface TcpProxy {
  readonly port: number;
  /** Stops moving bytes both ways on the open connections (a black hole); new ones pass. */
  freeze(): void;
  thaw(): void;
  /** Destroys every open connection (both sides see a reset). */
  kill(): void;
  close(): Promise<void>;
}

/** A loopback TCP proxy in front of `targetPort`, to cut or black-hole a peer's link. */
export async function startProxy(targetPort: number): Promise<TcpProxy> {
  const pairs = new Set<[Socket, Socket]>();
  const server: Server = createServer((client) => {
    const upstream = tcpConnect(targetPort, "127.0.0.1");
    const pair: [Socket, Socket] = [client, upstream];
    pairs.add(pair);
    const drop = () => {
      pairs.delete(pair);
      client.destroy();
      upstream.destroy();
    };
    client.on("error", drop).on("close", drop);
    upstream.on("error", drop).on("close", drop);
    client.pipe(upstream);
    upstream.pipe(client);
  });
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  const port = (server.address() as { port: number }).port;
  return {
    port,
    freeze() {
      for (const [a, b] of pairs) {
        a.unpipe(b);
        b.unpipe(a);
        a.pause();
        b.pause();
      }
    },
    thaw() {
      for (const [a, b] of pairs) {
        a.pipe(b);
        b.pipe(a);
      }
    },
    kill() {
      for (const [a, b] of pairs) {
        a.destroy();
        b.destroy();
      }
      pairs.clear();
    },
    close() {
      for (const [a, b] of pairs) {
        a.destroy();
        b.destroy();
      }
      return new Promise<void>((resolve) => server.close(() => resolve()));
    },
  };
}

export interface ComputeInput {
  layer: number;
  n: number;
  embd: number;
  k: number;
  x: Float32Array;
  ids: Int32Array;
  w: Float32Array | undefined;
  mode: "each" | "sum";
}

/**
 * The test workers' deterministic "expert": slot (i,j) of expert e gives
 * x_i * (e + 1) + salt + layer, zero for an empty slot. `salt` differs per worker, so a request
 * routed to the wrong worker gives different bytes. Mode "sum" combines in f32 in slot order.
 */
export function fakeExperts(salt: number, req: ComputeInput): Float32Array {
  const { n, embd, k } = req;
  const each = new Float32Array(n * k * embd);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < k; j++) {
      const e = req.ids[i * k + j]!;
      if (e < 0) continue;
      for (let d = 0; d < embd; d++) {
        each[(i * k + j) * embd + d] = Math.fround(req.x[i * embd + d]! * (e + 1) + salt + req.layer);
      }
    }
  }
  if (req.mode === "each") return each;
  const sum = new Float32Array(n * embd);
  for (let i = 0; i < n; i++) {
    for (let d = 0; d < embd; d++) {
      let acc = 0;
      for (let j = 0; j < k; j++) {
        acc = Math.fround(acc + Math.fround(req.w![i * k + j]! * each[(i * k + j) * embd + d]!));
      }
      sum[i * embd + d] = acc;
    }
  }
  return sum;
}

export function randomRequest(
  rand: () => number,
  shape: { n: number; embd: number; k: number; experts: number; mode: "each" | "sum"; layer?: number },
) {
  const { n, embd, k, experts, mode } = shape;
  const x = new Float32Array(n * embd).map(() => rand() * 2 - 1);
  const ids = new Int32Array(n * k).map(() => (rand() < 0.1 ? -1 : Math.floor(rand() * experts)));
  const w = new Float32Array(n * k).map(() => rand());
  return { model: "test-moe", layer: shape.layer ?? 0, n, embd, k, x, ids, w, mode };
}

export function sameBytes(a: Float32Array, b: Float32Array): boolean {
  return Buffer.from(a.buffer, a.byteOffset, a.byteLength).equals(
    Buffer.from(b.buffer, b.byteOffset, b.byteLength),
  );
}
