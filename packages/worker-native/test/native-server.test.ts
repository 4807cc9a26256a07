import { spawn } from "node:child_process";
import { createHash } from "node:crypto";
import { join } from "node:path";
import { connect, type TLSSocket } from "node:tls";
import {
  AuthError,
  decodeFrame,
  encodeFrame,
  encodeLengthPrefixed,
  type Frame,
  FrameReader,
  type ResultFrame,
} from "@moeswarm/core";
import { GgmlType } from "@moeswarm/shard";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import {
  llamaCppBinsDir,
  llamaCpuAddonPath,
  loadLlamaCpuCompute,
  NativeExpertCompute,
  type NativeServer,
  nativeSliceOf,
  serveNative,
} from "../src/index.js";
import { bitsEqual, normals, randomIds, randomWeights, writeModel, writeSlice } from "./fixtures.js";
import { selfSigned } from "./plugin-native-fixture.js";
import { K, N_EMBD, nativeOrSkip } from "./sync-fixture.js";

// The native listener (docs/protocol.md section 10.9) of the real addon with real slices, spoken to
// by a node:tls client in section 7 framing with core's codec: the hello and its refusals, a
// dispatch's bits against the same compute's own run, the refusals of what it does not serve,
// the pinned fingerprint, the served counts, and a close (or an exit) with connections open.

const { status } = await nativeOrSkip("the native listener tests");
// the llama-cpu build of the addon (what the demo's workers compute with) has its own listener
let llamaMissing: string | undefined = llamaCpuAddonPath() ? undefined : "the llama-cpu addon is not built";
try {
  llamaCppBinsDir();
} catch (error) {
  llamaMissing ??= (error as Error).message;
}
if (llamaMissing) {
  if (process.env.CI && process.platform === "linux" && process.arch === "x64") {
    throw new Error(`CI must build the llama-cpu addon: ${llamaMissing}`);
  }
  console.warn(`skipping the llama-cpu listener test: ${llamaMissing}`);
}
const MODEL = "synthetic/native";
const WORKER = "w-native";

/** A client of the listener: frames in, decoded frames out, in order. */
class Client {
  readonly socket: TLSSocket;
  readonly #reader = new FrameReader();
  readonly #frames: Frame[] = [];
  /** Every payload as it came, for byte checks. */
  readonly payloads: Uint8Array[] = [];
  #waiting: ((f: Frame | undefined) => void) | undefined;
  closed = false;
  readonly ready: Promise<void>;

  constructor(port: number) {
    this.socket = connect({ host: "127.0.0.1", port, rejectUnauthorized: false });
    this.ready = new Promise((resolve, reject) => {
      this.socket.once("secureConnect", () => resolve());
      this.socket.once("error", reject);
    });
    this.socket.on("data", (chunk: Buffer) => {
      for (const p of this.#reader.push(chunk)) {
        this.payloads.push(Uint8Array.from(p));
        this.#push(decodeFrame(p));
      }
    });
    this.socket.on("error", () => {});
    this.socket.on("close", () => {
      this.closed = true;
      this.#waiting?.(undefined);
      this.#waiting = undefined;
    });
  }

  #push(f: Frame): void {
    if (this.#waiting) {
      const w = this.#waiting;
      this.#waiting = undefined;
      w(f);
    } else this.#frames.push(f);
  }

  send(f: Frame): void {
    this.socket.write(encodeLengthPrefixed(f));
  }

  /** The next frame, or undefined once the connection closed. */
  next(): Promise<Frame | undefined> {
    const f = this.#frames.shift();
    if (f || this.closed) return Promise.resolve(f);
    return new Promise((resolve) => {
      this.#waiting = resolve;
    });
  }

  async hello(ticket: string, id = "bb-1"): Promise<Frame | undefined> {
    await this.ready;
    this.send({ t: "hello", v: 1, role: "backbone", id, token: ticket });
    return this.next();
  }

  close(): void {
    this.socket.destroy();
  }
}

function dispatch(id: number, layer: number, ids: Int32Array, extra: Partial<Frame> = {}): Frame {
  const n = ids.length / K;
  return {
    t: "dispatch",
    v: 1,
    id,
    model: MODEL,
    layer,
    n,
    embd: N_EMBD,
    dtype: "f32",
    x: normals(n * N_EMBD, 100 + id),
    k: K,
    ids,
    w: randomWeights(n, K, 200 + id),
    mode: "sum",
    ...extra,
  } as Frame;
}

describe.skipIf(!status.available)("native listener (NativeServer)", () => {
  const tmp = tempDir("moeswarm-wn-native-server-");
  let whole: NativeExpertCompute;
  let half: NativeExpertCompute;
  let server: NativeServer;
  let certPem: string;
  const refused: string[] = [];

  beforeAll(async () => {
    const model = await writeModel(
      { type: GgmlType.Q8_0, nEmbd: N_EMBD, nFf: 256, nExpert: 8, layers: [0, 2], seed: 77 },
      tmp.dir,
    );
    const halfPath = join(tmp.dir, "half.gguf");
    await writeSlice(model, [0, 1, 2, 3], [2], halfPath);
    whole = await NativeExpertCompute.load(model.path, { threads: 1 });
    half = await NativeExpertCompute.load(halfPath, { threads: 1 });
    const tls = await selfSigned();
    certPem = tls.cert;
    server = await serveNative({
      host: "127.0.0.1",
      ...tls,
      id: WORKER,
      admit: async (backbone, ticket) => {
        await new Promise((r) => setTimeout(r, 5)); // a verdict that comes later, as a key fetch's
        if (ticket === "expired") throw new AuthError("MOESWARM_AUTH_TICKET_EXPIRED", "expired");
        if (ticket !== `good-for-${backbone}`) throw new AuthError("MOESWARM_AUTH_TICKET_INVALID", "bad");
      },
      onRefused: (e) => refused.push(e.code),
    });
    const routes = [
      { model: MODEL, layer: 0, slice: nativeSliceOf(whole)! },
      { model: MODEL, layer: 2, slice: nativeSliceOf(half)! },
    ];
    expect(server.setRoutes(routes)).toHaveLength(2);
  }, 60_000);

  afterAll(async () => {
    server?.close();
    await whole?.close();
    await half?.close();
    tmp.remove();
  });

  it("refuses a connection whose first frame is not a hello, or whose ticket is bad or expired", async () => {
    const c = new Client(server.port);
    await c.ready;
    c.send({ t: "ping", v: 1, seq: 1, ts: 0 });
    const e = await c.next();
    expect(e).toMatchObject({ t: "error", code: "MOESWARM_AUTH_MISSING" });
    expect((e as { id?: number }).id).toBeUndefined();
    expect(await c.next()).toBeUndefined(); // then closed
    // a first frame bigger than any hello is refused before it is read
    const big = new Client(server.port);
    await big.ready;
    const prefix = Buffer.alloc(4);
    prefix.writeUInt32LE(1 << 20);
    big.socket.write(prefix);
    expect(await big.next()).toMatchObject({ t: "error", code: "MOESWARM_AUTH_MISSING" });
    expect(await big.next()).toBeUndefined();
    for (const [ticket, code] of [
      ["mswt1.nope", "MOESWARM_AUTH_TICKET_INVALID"],
      ["good-for-someone-else", "MOESWARM_AUTH_TICKET_INVALID"],
      ["expired", "MOESWARM_AUTH_TICKET_EXPIRED"],
    ] as const) {
      const d = new Client(server.port);
      expect(await d.hello(ticket)).toMatchObject({ t: "error", code });
      expect(await d.next()).toBeUndefined();
    }
    expect(refused).toEqual([
      "MOESWARM_AUTH_TICKET_INVALID",
      "MOESWARM_AUTH_TICKET_INVALID",
      "MOESWARM_AUTH_TICKET_EXPIRED",
    ]);
  });

  it("pins: the fingerprint is the SHA-256 of the certificate the client sees (and of the PEM given)", async () => {
    const c = new Client(server.port);
    await c.ready;
    const der = c.socket.getPeerCertificate().raw;
    const hex = (b: Buffer) =>
      createHash("sha256").update(b).digest("hex").toUpperCase().match(/../g)!.join(":");
    expect(server.fingerprint).toBe(hex(der));
    const pemDer = Buffer.from(certPem.replace(/-----[^-]+-----|\s/g, ""), "base64");
    expect(server.fingerprint).toBe(hex(pemDer));
    c.close();
  });

  it("answers a dispatch with the compute's own bits, pings with pongs, and counts what it served", async () => {
    server.takeServed(); // nothing counted before
    const c = new Client(server.port);
    const hello = await c.hello("good-for-bb-1");
    expect(hello).toMatchObject({ t: "hello", role: "backbone", id: "bb-1", token: "" });
    expect((hello as { caps?: { maxFrame?: number } }).caps?.maxFrame).toBe(64 * 1024 * 1024);
    const ids = randomIds(5, K, [0, 1, 2, 3, 4, 5, 6, 7], 9, 3); // 3 empty slots
    const filled = ids.filter((i) => i !== -1).length;
    const d = dispatch(7, 0, ids) as Extract<Frame, { t: "dispatch" }>;
    c.send(d);
    const r = (await c.next()) as ResultFrame;
    expect(r).toMatchObject({ t: "result", id: 7, mode: "sum", n: 5, embd: N_EMBD });
    expect(r.ms).toBeGreaterThanOrEqual(0);
    const want = await whole.run({ layer: 0, x: d.x as Float32Array, ids, k: K, w: d.w!, mode: "sum" });
    expect(bitsEqual(r.y, want)).toBe(true);
    // the canonical bytes (section 8), padding entry included: y at 0 mod 8 in the frame
    expect(Buffer.from(c.payloads.at(-1) as Uint8Array).equals(Buffer.from(encodeFrame(r)))).toBe(true);
    // to, when present, must be this worker
    c.send(dispatch(8, 0, ids, { to: WORKER }));
    expect(await c.next()).toMatchObject({ t: "result", id: 8 });
    c.send(dispatch(9, 0, ids, { to: "w-other" }));
    expect(await c.next()).toMatchObject({ t: "error", id: 9, code: "MOESWARM_TRANSPORT_UNKNOWN_PEER" });
    c.send({ t: "ping", v: 1, seq: 42, ts: 1.5 });
    expect(await c.next()).toMatchObject({ t: "pong", seq: 42, ts: 1.5 });
    // the half slice of layer 2 computes its own experts
    const mine = new Int32Array([0, 3, -1, 1]);
    const d2 = dispatch(10, 2, mine) as Extract<Frame, { t: "dispatch" }>;
    c.send(d2);
    const r2 = (await c.next()) as ResultFrame;
    const want2 = await half.run({
      layer: 2,
      x: d2.x as Float32Array,
      ids: mine,
      k: K,
      w: d2.w!,
      mode: "sum",
    });
    expect(r2.t).toBe("result");
    expect(bitsEqual(r2.y, want2)).toBe(true);
    expect(server.takeServed()).toEqual([
      { backbone: "bb-1", model: MODEL, expertTokens: 2 * filled + 3, requests: 3 },
    ]);
    expect(server.takeServed()).toEqual([]);
    c.close();
  });

  it("refuses what it does not serve: another layer, an expert of another slice, anything after setRoutes([])", async () => {
    const c = new Client(server.port);
    expect(await c.hello("good-for-bb-2", "bb-2")).toMatchObject({ t: "hello" });
    c.send(dispatch(1, 1, new Int32Array([0, 1, 2, 3])));
    expect(await c.next()).toMatchObject({ t: "error", id: 1, code: "MOESWARM_INVALID_ARGUMENT" });
    c.send(dispatch(2, 2, new Int32Array([0, 1, 2, 5]))); // expert 5 is not in layer 2's slice
    expect(await c.next()).toMatchObject({ t: "error", id: 2, code: "MOESWARM_INVALID_ARGUMENT" });
    c.send(dispatch(3, 0, new Int32Array([0, 1, 2, 3]), { model: "other/model" }));
    expect(await c.next()).toMatchObject({ t: "error", id: 3, code: "MOESWARM_INVALID_ARGUMENT" });
    const routes = server.setRoutes([]);
    expect(routes).toEqual([]);
    c.send(dispatch(4, 0, new Int32Array([0, 1, 2, 3])));
    expect(await c.next()).toMatchObject({ t: "error", id: 4, code: "MOESWARM_TRANSPORT_DRAINING" });
    server.setRoutes([{ model: MODEL, layer: 0, slice: nativeSliceOf(whole)! }]);
    c.send(dispatch(5, 0, new Int32Array([0, 1, 2, 3])));
    expect(await c.next()).toMatchObject({ t: "result", id: 5 });
    // nothing refused was counted
    expect(server.takeServed()).toEqual([{ backbone: "bb-2", model: MODEL, expertTokens: 4, requests: 1 }]);
    c.close();
  });

  it("at most 64 connections wait for their hello: the next one gets MOESWARM_TRANSPORT_LIMIT, and room comes back", async () => {
    const waiting = Array.from({ length: 64 }, () => new Client(server.port));
    // counted from the accept, before the handshake that `ready` waits for
    await Promise.all(waiting.map((c) => c.ready));
    const over = new Client(server.port);
    await over.ready;
    expect(await over.next()).toMatchObject({ t: "error", code: "MOESWARM_TRANSPORT_LIMIT" });
    expect(await over.next()).toBeUndefined();
    for (const c of waiting) c.close();
    // their threads see the close and make room
    let admitted: Frame | undefined;
    for (let i = 0; i < 50 && admitted?.t !== "hello"; i++) {
      await new Promise((r) => setTimeout(r, 50));
      const c = new Client(server.port);
      admitted = await c.hello("good-for-bb-9", "bb-9");
      c.close();
    }
    expect(admitted).toMatchObject({ t: "hello", id: "bb-9" });
  });

  it("close() with connections open returns, and their sockets end", async () => {
    const tls = await selfSigned();
    const s = await serveNative({ host: "127.0.0.1", ...tls, id: WORKER, admit: () => {} });
    const a = new Client(s.port);
    expect(await a.hello("any")).toMatchObject({ t: "hello" });
    const b = new Client(s.port); // waiting for its hello
    await b.ready;
    s.close();
    s.close(); // idempotent
    expect(await a.next()).toBeUndefined();
    expect(await b.next()).toBeUndefined();
  });

  it("closes a connection silent past helloTimeoutMs before its hello, and one idle past idleTimeoutMs after it", async () => {
    const tls = await selfSigned();
    const s = await serveNative({
      host: "127.0.0.1",
      ...tls,
      id: WORKER,
      admit: () => {},
      helloTimeoutMs: 300,
      idleTimeoutMs: 600,
    });
    try {
      const silent = new Client(s.port);
      await silent.ready;
      const t0 = performance.now();
      expect(await silent.next()).toMatchObject({
        code: "MOESWARM_AUTH_MISSING",
        msg: "no hello within 300 ms",
      });
      expect(await silent.next()).toBeUndefined(); // then closed
      // never before its deadline (the handshake's wait began a little before t0)
      expect(performance.now() - t0).toBeGreaterThan(200);
      const idle = new Client(s.port);
      expect(await idle.hello("any")).toMatchObject({ t: "hello" });
      const t1 = performance.now();
      expect(await idle.next()).toBeUndefined();
      expect(performance.now() - t1).toBeGreaterThan(500);
      // a talking connection outlives both: three pings 250 ms apart
      const busy = new Client(s.port);
      expect(await busy.hello("any")).toMatchObject({ t: "hello" });
      for (let i = 0; i < 3; i++) {
        await new Promise((r) => setTimeout(r, 250));
        busy.send({ t: "ping", v: 1, seq: i, ts: 1 });
        expect(await busy.next()).toMatchObject({ t: "pong", seq: i });
      }
      busy.close();
    } finally {
      s.close();
    }
    await expect(
      serveNative({ host: "127.0.0.1", ...tls, id: WORKER, admit: () => {}, idleTimeoutMs: 0 }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
  });

  it("a process whose event loop ends with the listener open and a hello waiting for its verdict exits", async () => {
    const tls = await selfSigned();
    // the hello by hand (plain node, no workspace imports): {t:"hello",v:1,role:"backbone",id:"b",token:"x"}
    const script = `
      const tls = require("node:tls");
      const a = require(process.argv[1]);
      const s = new a.NativeServer({ host: "127.0.0.1", port: 0, cert: process.env.C, key: process.env.K, id: "w",
        maxFrame: 65536, onHello: () => {} });
      const str = (t) => Buffer.concat([Buffer.from([0xa0 | t.length]), Buffer.from(t)]);
      const p = Buffer.concat([Buffer.from([0x85]), str("t"), str("hello"), str("v"), Buffer.from([1]),
        str("role"), str("backbone"), str("id"), str("b"), str("token"), str("x")]);
      const len = Buffer.alloc(4);
      len.writeUInt32LE(p.length);
      const c = tls.connect({ host: "127.0.0.1", port: s.port, rejectUnauthorized: false }, () => {
        c.write(Buffer.concat([len, p]), () => { console.log("hello-sent"); c.unref(); });
      });
      process.on("exit", () => console.log("exiting"));
    `;
    const child = spawn(process.execPath, ["-e", script, status.path!], {
      env: { ...process.env, C: tls.cert, K: tls.key },
      stdio: ["ignore", "pipe", "pipe"],
    });
    let out = "";
    child.stdout.on("data", (d) => {
      out += String(d);
    });
    const code = await new Promise<number | null>((resolve) => {
      const t = setTimeout(() => {
        child.kill("SIGKILL");
        resolve(-1);
      }, 20_000);
      child.on("exit", (c) => {
        clearTimeout(t);
        resolve(c);
      });
    });
    expect(out).toContain("hello-sent");
    expect(out).toContain("exiting");
    expect(code).toBe(0);
  }, 30_000);
});

describe.skipIf(!status.available || llamaMissing !== undefined)(
  "native listener of the llama-cpu addon",
  () => {
    const tmp = tempDir("moeswarm-wn-native-llama-");
    afterAll(() => tmp.remove());

    it("serves a llama-cpu slice with its bits, and leaves out a slice of the other addon build", async () => {
      const model = await writeModel(
        { type: GgmlType.Q4_K, nEmbd: N_EMBD, nFf: 256, nExpert: 8, layers: [1], seed: 91 },
        tmp.dir,
      );
      await using llama = await loadLlamaCpuCompute(model.path, { threads: 1 });
      await using other = await NativeExpertCompute.load(model.path, { threads: 1 });
      const s = await serveNative({
        host: "127.0.0.1",
        ...(await selfSigned()),
        id: WORKER,
        compute: "llama-cpu",
        admit: () => {},
      });
      try {
        const taken = s.setRoutes([
          { model: MODEL, layer: 1, slice: nativeSliceOf(other)! },
          { model: "llama/model", layer: 1, slice: nativeSliceOf(llama)! },
        ]);
        expect(taken.map((r) => r.model)).toEqual(["llama/model"]);
        const c = new Client(s.port);
        expect(await c.hello("t")).toMatchObject({ t: "hello" });
        const ids = randomIds(4, K, [0, 1, 2, 3, 4, 5, 6, 7], 5, 2);
        const d = dispatch(3, 1, ids, { model: "llama/model" }) as Extract<Frame, { t: "dispatch" }>;
        c.send(d);
        const r = (await c.next()) as ResultFrame;
        const want = await llama.run({ layer: 1, x: d.x as Float32Array, ids, k: K, w: d.w!, mode: "sum" });
        expect(r.t).toBe("result");
        expect(bitsEqual(r.y, want)).toBe(true);
        c.send(dispatch(4, 1, ids)); // MODEL: the native build's slice was not routed
        expect(await c.next()).toMatchObject({ t: "error", id: 4, code: "MOESWARM_INVALID_ARGUMENT" });
        c.close();
      } finally {
        s.close();
      }
    }, 60_000);
  },
);
