import { getEventListeners } from "node:events";
import { existsSync, readFileSync, writeFileSync } from "node:fs";
import { connect } from "node:net";
import { join } from "node:path";
import {
  dispatchFrame,
  type ErrorFrame,
  encodeFrame,
  encodeLengthPrefixed,
  pingFrame,
  type ResultFrame,
} from "@moeswarm/core";
import { tempDir } from "@moeswarm/testkit";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { spawnExpertWorker } from "../src/index.js";
import { normals, randomIds, rng } from "./fixtures.js";
import { Peer, prefixed, protocolVectors, rawFrame, startWorker } from "./wire.js";
import { binary, K, missing, N_EMBD, sliceExperts, writeTestSlice } from "./worker-exe-fixture.js";

describe.skipIf(Boolean(missing))("moeswarm-expert-worker: bad input, drain, TCP, spawn errors", () => {
  const tmp = tempDir("moeswarm-wn-");
  let slicePath: string;

  beforeAll(async () => {
    ({ slicePath } = await writeTestSlice(tmp.dir));
  });
  afterAll(() => tmp.remove());

  it("answers bad frames with error frames (the right code, the id when readable) and keeps serving", async () => {
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1", "--model", "synthetic-moe"]);
    await p.peer.frames(2);
    const x = normals(N_EMBD, 1);
    const good = {
      t: "dispatch",
      v: 1,
      id: 7,
      model: "synthetic-moe",
      layer: 1,
      n: 1,
      embd: N_EMBD,
      dtype: "f32",
      x: new Uint8Array(x.buffer),
      k: 2,
      ids: new Uint8Array(new Int32Array([0, 2]).buffer),
      mode: "each",
    };
    const deep: unknown[] = [];
    let cur = deep;
    for (let i = 0; i < 16; i++) {
      const next: unknown[] = [];
      cur.push(next);
      cur = next;
    }
    const cases: Array<[string, Uint8Array, string, number | undefined]> = [
      [
        "random bytes",
        prefixed(Uint8Array.from([0xc1, 0x01, 0xff])),
        "MOESWARM_PROTOCOL_MALFORMED",
        undefined,
      ],
      ["empty payload", prefixed(new Uint8Array(0)), "MOESWARM_PROTOCOL_MALFORMED", undefined],
      ["an array", rawFrame([1, 2, 3]), "MOESWARM_PROTOCOL_MALFORMED", undefined],
      [
        "trailing bytes",
        prefixed(Uint8Array.from([...encodeFrame(pingFrame({ seq: 1, ts: 1 })), 0x00])),
        "MOESWARM_PROTOCOL_MALFORMED",
        undefined,
      ],
      ["too deep", rawFrame({ ...good, zz: deep }), "MOESWARM_PROTOCOL_MALFORMED", undefined],
      ["no t", rawFrame({ v: 1, id: 3 }), "MOESWARM_PROTOCOL_MISSING_FIELD", 3],
      ["t not a string", rawFrame({ t: 5, v: 1 }), "MOESWARM_PROTOCOL_BAD_FIELD", undefined],
      ["unknown type", rawFrame({ t: "gossip", v: 1 }), "MOESWARM_PROTOCOL_UNKNOWN_TYPE", undefined],
      ["v a float", rawFrame({ t: "ping", v: 1.5, seq: 1, ts: 1 }), "MOESWARM_PROTOCOL_BAD_FIELD", undefined],
      ["missing x", rawFrame({ ...good, x: undefined }), "MOESWARM_PROTOCOL_MISSING_FIELD", 7],
      ["n a string", rawFrame({ ...good, n: "1" }), "MOESWARM_PROTOCOL_BAD_FIELD", 7],
      ["k too large", rawFrame({ ...good, k: 257 }), "MOESWARM_PROTOCOL_BAD_FIELD", 7],
      ["dtype f64", rawFrame({ ...good, dtype: "f64" }), "MOESWARM_PROTOCOL_BAD_FIELD", 7],
      [
        "x one byte short",
        rawFrame({ ...good, x: new Uint8Array(4 * N_EMBD - 1) }),
        "MOESWARM_PROTOCOL_BAD_LENGTH",
        7,
      ],
      ["sum without w", rawFrame({ ...good, mode: "sum" }), "MOESWARM_PROTOCOL_MISSING_FIELD", 7],
      [
        "id -2",
        rawFrame({ ...good, ids: new Uint8Array(new Int32Array([0, -2]).buffer) }),
        "MOESWARM_PROTOCOL_BAD_FIELD",
        7,
      ],
      [
        "w NaN",
        rawFrame({ ...good, mode: "sum", w: new Uint8Array(new Float32Array([1, Number.NaN]).buffer) }),
        "MOESWARM_PROTOCOL_BAD_FIELD",
        7,
      ],
      [
        "expert not in the slice",
        rawFrame({ ...good, ids: new Uint8Array(new Int32Array([0, 3]).buffer) }),
        "MOESWARM_NATIVE_COMPUTE",
        7,
      ],
      ["layer not in the slice", rawFrame({ ...good, layer: 0 }), "MOESWARM_NATIVE_COMPUTE", 7],
      [
        "embd of another model",
        rawFrame({ ...good, embd: 128, x: new Uint8Array(512) }),
        "MOESWARM_NATIVE_COMPUTE",
        7,
      ],
      ["another model", rawFrame({ ...good, model: "other" }), "MOESWARM_NATIVE_COMPUTE", 7],
      ["bad UTF-8 in a peer id", rawFrame({ ...good, to: "\ud800" }), "MOESWARM_PROTOCOL_BAD_FIELD", 7],
    ];
    let expected = 2;
    for (const [name, bytes, code, id] of cases) {
      p.peer.write(bytes);
      expected++;
      const got = (await p.peer.frames(expected)).at(-1)!.frame as ErrorFrame;
      expect(got, name).toMatchObject({ t: "error", code });
      expect(got.id, name).toBe(id);
    }
    // unknown keys, even nested maps, are skipped; the frame is served
    p.peer.write(rawFrame({ zz: { a: [1, { b: 2 }] }, ...good, extra: "ignored" }));
    const served = (await p.peer.frames(++expected)).at(-1)!.frame;
    expect(served).toMatchObject({ t: "result", id: 7 });
    p.child.stdin.end();
    expect(await p.exit).toEqual({ code: 0, signal: null });
  });

  it("survives hundreds of randomly mutated frames: an error frame or an answer, never a crash", async () => {
    const x = normals(2 * N_EMBD, 12);
    const seeds = [
      encodeFrame(
        dispatchFrame({
          id: 9,
          to: "a",
          from: "b",
          model: "m",
          layer: 1,
          n: 2,
          embd: N_EMBD,
          dtype: "f32",
          x,
          k: 2,
          ids: new Int32Array([5, 0, 2, -1]),
          w: new Float32Array([0.5, 0.5, 1, 0]),
          mode: "sum",
        }),
      ),
      encodeFrame(pingFrame({ seq: 3, ts: 4.5 })),
      encodeFrame({
        t: "hello",
        v: 1,
        role: "backbone",
        id: "bb",
        token: "t",
        caps: { backends: ["cpu"], dtypes: ["f32"], maxFrame: 1000 },
      }),
      encodeFrame({ t: "register", v: 1, model: "m", layers: [1, 2], experts: [0, 2, 5] }),
    ];
    const r = rng(4242);
    let p: ReturnType<typeof startWorker> | undefined;
    let seen = 0;
    let restarts = 0;
    for (let i = 0; i < 300; i++) {
      if (!p) {
        p = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
        await p.peer.frames(2);
        seen = 2;
      }
      const base = seeds[i % seeds.length]!;
      // mutate the msgpack structure (the first 160 bytes; tensors are opaque): flips, cuts, inserts
      const head = Array.from(base.subarray(0, Math.min(base.length, 160)));
      const tail = Array.from(base.subarray(Math.min(base.length, 160)));
      for (let e = 1 + Math.floor(r() * 4); e > 0; e--) {
        const at = Math.floor(r() * head.length);
        const op = r();
        if (op < 0.6) head[at] = Math.floor(r() * 256);
        else if (op < 0.8) head.splice(at, 1 + Math.floor(r() * 3));
        else head.splice(at, 0, Math.floor(r() * 256));
      }
      const cut = r() < 0.2 ? tail.slice(0, Math.floor(r() * tail.length)) : tail;
      p.peer.write(prefixed(Uint8Array.from([...head, ...cut])));
      p.peer.write(encodeLengthPrefixed(pingFrame({ seq: 10_000 + i, ts: 1 })));
      for (;;) {
        const frames = await p.peer.frames(seen + 1, 30_000);
        if (frames.length <= seen) {
          // the stream ended: only a frame of another protocol version may close the connection
          const last = p.peer.received.at(-1)!.frame;
          expect(last, `mutation ${i}`).toMatchObject({ t: "error", code: "MOESWARM_PROTOCOL_VERSION" });
          expect((await p.exit).code).toBe(1);
          p = undefined;
          restarts++;
          break;
        }
        seen = frames.length;
        const last = frames.at(-1)!.frame;
        if (last.t === "pong" && last.seq === 10_000 + i) break;
      }
    }
    if (p) {
      p.child.stdin.end();
      expect((await p.exit).code).toBe(0);
    }
    expect(restarts).toBeLessThan(30);
  });

  it("decodes every test vector of docs/protocol.md", async () => {
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
    await p.peer.frames(2);
    const vectors = protocolVectors();
    expect(vectors.size).toBeGreaterThanOrEqual(14);
    let seen = 2;
    let marker = 1000;
    // what the worker answers to one frame: everything before the pong to a ping sent after it
    const answersTo = async (bytes: Uint8Array) => {
      p.peer.write(prefixed(bytes));
      p.peer.write(encodeLengthPrefixed(pingFrame({ seq: ++marker, ts: 0 })));
      for (let count = seen + 1; ; count++) {
        const frames = await p.peer.frames(count);
        const last = frames.at(-1)!.frame;
        if (last.t === "pong" && last.seq === marker) {
          const answers = frames.slice(seen, -1).map((r) => r.frame);
          seen = count;
          return answers;
        }
      }
    };
    for (const [name, bytes] of vectors) {
      if (name.startsWith("drain")) continue;
      const answers = await answersTo(bytes);
      if (name.startsWith("dispatch")) {
        // decoded fine; the slice has another width, so the compute refuses it with the request's id
        expect(answers, name).toHaveLength(1);
        expect(answers[0], name).toMatchObject({ t: "error", code: "MOESWARM_NATIVE_COMPUTE" });
        expect((answers[0] as ErrorFrame).id, name).toBeTypeOf("number");
      } else if (name === "ping") {
        expect(answers, name).toEqual([{ t: "pong", v: 1, seq: 1, ts: 1234.5 }]);
      } else {
        expect(answers, name).toEqual([]);
      }
    }
    p.peer.write(prefixed(vectors.get("drain")!));
    expect((await p.exit).code).toBe(0);
  });

  it("closes the connection after an oversized frame, another version or a cut stream, never allocating", async () => {
    const big = startWorker(binary!, ["--slice", slicePath, "--threads", "1", "--max-frame", "4096"]);
    await big.peer.frames(2);
    big.peer.write(Uint8Array.from([0xff, 0xff, 0xff, 0xff]));
    const [, , tooLarge] = await big.peer.frames(3);
    expect(tooLarge!.frame).toMatchObject({ t: "error", code: "MOESWARM_PROTOCOL_FRAME_TOO_LARGE" });
    expect((tooLarge!.frame as ErrorFrame).id).toBeUndefined();
    expect((await big.exit).code).toBe(1);

    const v2 = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
    await v2.peer.frames(2);
    v2.peer.write(rawFrame({ t: "ping", v: 2, seq: 1, ts: 1, id: 9 }));
    const [, , version] = await v2.peer.frames(3);
    expect(version!.frame).toMatchObject({ t: "error", code: "MOESWARM_PROTOCOL_VERSION" });
    expect((version!.frame as ErrorFrame).id).toBeUndefined();
    expect((await v2.exit).code).toBe(1);

    const cut = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
    await cut.peer.frames(2);
    cut.peer.write(Uint8Array.from([100, 0, 0, 0, 0x82, 0xa1]));
    cut.child.stdin.end();
    const [, , truncated] = await cut.peer.frames(3);
    expect(truncated!.frame).toMatchObject({ t: "error", code: "MOESWARM_PROTOCOL_TRUNCATED" });
    expect((await cut.exit).code).toBe(1);
  });

  it("answers everything sent before drain, then exits 0", async () => {
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1"]);
    await p.peer.frames(2);
    const x = normals(2 * N_EMBD, 3);
    for (let id = 0; id < 3; id++) {
      p.peer.write(
        encodeLengthPrefixed(
          dispatchFrame({
            id,
            model: "m",
            layer: 1,
            n: 2,
            embd: N_EMBD,
            dtype: "f32",
            x,
            k: 1,
            ids: new Int32Array([5, 7]),
            mode: "each",
          }),
        ),
      );
    }
    p.peer.write(encodeLengthPrefixed({ t: "drain", v: 1, reason: "test" }));
    expect((await p.exit).code).toBe(0);
    await p.peer.done;
    expect(p.peer.received.slice(2).map((r) => [r.frame.t, (r.frame as ResultFrame).id])).toEqual([
      ["result", 0],
      ["result", 1],
      ["result", 2],
    ]);
  });

  it("serves TCP (--listen host:0, TCP_NODELAY) one connection after another until drain", async () => {
    const p = startWorker(binary!, ["--slice", slicePath, "--threads", "1", "--listen", "127.0.0.1:0"]);
    const line = await new Promise<string>((resolve) =>
      p.child.stdout.once("data", (d: Buffer) => resolve(d.toString())),
    );
    const port = Number(/^listening \S+ (\d+)/.exec(line)![1]);
    const session = async (drain: boolean) => {
      const socket = connect(port, "127.0.0.1");
      await new Promise<void>((resolve) => socket.once("connect", () => resolve()));
      const peer = new Peer(socket, socket);
      await peer.frames(2);
      socket.write(encodeLengthPrefixed(pingFrame({ seq: 5, ts: 6 })));
      const [, , pong] = await peer.frames(3);
      expect(pong!.frame).toMatchObject({ t: "pong", seq: 5, ts: 6 });
      socket.write(encodeLengthPrefixed(drain ? { t: "drain", v: 1 } : pingFrame({ seq: 6, ts: 7 })));
      if (!drain) await peer.frames(4);
      socket.end();
      await peer.done;
    };
    await session(false);
    await session(true);
    expect((await p.exit).code).toBe(0);
  });

  it("spawnExpertWorker: typed errors for bad slices and binaries, abort, a worker that dies", async () => {
    const bytes = readFileSync(slicePath);
    const truncated = join(tmp.dir, "cut.gguf");
    writeFileSync(truncated, bytes.subarray(0, bytes.length - 100));
    await expect(spawnExpertWorker(binary!, truncated)).rejects.toMatchObject({
      name: "GgufError",
      code: "MOESWARM_GGUF_TRUNCATED",
    });
    await expect(spawnExpertWorker(join(tmp.dir, "nope"), slicePath)).rejects.toMatchObject({
      name: "NativeError",
      code: "MOESWARM_NATIVE_LOAD",
    });
    await expect(spawnExpertWorker(binary!, slicePath, { threads: -1 })).rejects.toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
    });
    await expect(
      spawnExpertWorker(binary!, slicePath, { signal: AbortSignal.abort(new Error("no")) }),
    ).rejects.toThrow("no");

    const worker = await spawnExpertWorker(binary!, slicePath, { threads: 1, restart: false });
    const x = normals(N_EMBD, 2);
    await expect(
      worker.run({ layer: 1, x, ids: new Int32Array([3]), k: 1, mode: "each" }),
    ).rejects.toMatchObject({ code: "MOESWARM_INVALID_ARGUMENT" });
    const ctl = new AbortController();
    const big = 2048;
    const slow = worker.run(
      { layer: 1, x: normals(big * N_EMBD, 3), ids: randomIds(big, K, sliceExperts, 4), k: K, mode: "each" },
      { signal: ctl.signal },
    );
    ctl.abort(new Error("enough"));
    await expect(slow).rejects.toThrow("enough");
    expect(getEventListeners(ctl.signal, "abort")).toHaveLength(0);
    const ok = await worker.run({ layer: 1, x, ids: new Int32Array([5]), k: 1, mode: "each" });
    expect(ok.length).toBe(N_EMBD);

    const doomed = worker.run({
      layer: 2,
      x: normals(big * N_EMBD, 5),
      ids: randomIds(big, K, sliceExperts, 6),
      k: K,
      mode: "each",
    });
    process.kill(worker.pid!, "SIGKILL");
    await expect(doomed).rejects.toMatchObject({ name: "TransportError", code: "MOESWARM_TRANSPORT_CLOSED" });
    await expect(
      worker.run({ layer: 1, x, ids: new Int32Array([5]), k: 1, mode: "each" }),
    ).rejects.toMatchObject({ code: "MOESWARM_TRANSPORT_CLOSED" });
    await worker.close();
    expect(existsSync(slicePath)).toBe(true);
  });
});
