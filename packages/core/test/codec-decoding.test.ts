import { encode as msgpackEncode } from "@msgpack/msgpack";
import { describe, expect, it } from "vitest";
import {
  type DispatchFrame,
  decodeFrame,
  dispatchFrame,
  encodeFrame,
  errorFrame,
  type Frame,
  helloFrame,
  InvalidArgumentError,
  isMoeswarmError,
  PROTOCOL_LIMITS,
  pingFrame,
  type ResultFrame,
  registerFrame,
  resultFrame,
  validateFrame,
} from "../src/index.js";
import { bytes, codeOf, fromHex, hex, pack, protocolError, rawDispatch } from "./codec-helpers.js";

describe("decodeFrame: what it accepts", () => {
  it("round-trips typed arrays", () => {
    const frame = decodeFrame(pack(rawDispatch())) as DispatchFrame;
    expect(frame.x).toBeInstanceOf(Float32Array);
    expect(Array.from(frame.x)).toEqual([1, 2, 3, 4, 5, 6]);
    expect(Array.from(frame.ids)).toEqual([0, 1, 2, -1]);
    expect(Array.from(frame.w!)).toEqual([0.5, 0.5, 1, 0]);
  });

  it("accepts keys in any order and ignores unknown keys of any shape", () => {
    const o = rawDispatch({
      zz: { a: [1, { b: new Uint8Array(3) }] },
      extra: null,
      "": 1,
      veryLongUnknownKey: "x",
    });
    const reversed = Object.fromEntries(Object.entries(o).reverse());
    const frame = decodeFrame(pack(reversed)) as DispatchFrame;
    expect(Object.keys(frame).sort()).toEqual(Object.keys(rawDispatch()).sort());
    expect(frame.id).toBe(42);
  });

  it("ignores unknown keys that share a known key's length and first and last bytes", () => {
    // keys are found by a hash of their length and first and last bytes: each look-alike must
    // still be compared byte by byte, and skipped as unknown
    const lookalikes = { mxde: "each", exxd: 9, ixs: 7, dxxxxxxe: 1, fxom: "z" };
    const frame = decodeFrame(pack(rawDispatch(lookalikes))) as DispatchFrame;
    expect(frame).toMatchObject({ mode: "sum", embd: 3 });
    expect(Object.keys(frame).sort()).toEqual(Object.keys(rawDispatch()).sort());
    expect(Array.from(frame.ids)).toEqual([0, 1, 2, -1]);
  });

  it("matches frame types by every byte: a type name off by one byte or one length is unknown", () => {
    for (const t of ["dispatch", "result", "ping", "hello", "error"]) {
      for (const name of [t.slice(0, -1), `${t}x`, `x${t.slice(1)}`, `${t.slice(0, -1)}X`, t.toUpperCase()]) {
        expect(codeOf(pack({ ...rawDispatch(), t: name })), name).toBe("MOESWARM_PROTOCOL_UNKNOWN_TYPE");
      }
    }
    // a known type's frame decodes with the type's own string (the same for every frame)
    const a = decodeFrame(pack({ t: "ping", v: 1, seq: 1, ts: 2 }));
    const b = decodeFrame(pack({ t: "ping", v: 1, seq: 2, ts: 3 }));
    expect([a.t, b.t]).toEqual(["ping", "ping"]);
  });

  it("ignores unknown keys inside caps too", () => {
    const hello = decodeFrame(
      pack({
        t: "hello",
        v: 1,
        role: "worker",
        id: "w",
        token: "",
        caps: { gpu: { vram: 80 }, maxFrame: 1024 },
      }),
    );
    expect(hello).toEqual({ t: "hello", v: 1, role: "worker", id: "w", token: "", caps: { maxFrame: 1024 } });
  });

  it("accepts any integer encoding for uint fields and floats or ints for float fields", () => {
    // n as int8 (0xd0 0x02), embd as uint64 (0xcf ...), ts as float32
    const canonical = encodeFrame(decodeFrame(pack(rawDispatch())));
    const h = hex(canonical)
      .replace("a16e02", "a16ed002")
      .replace("a4656d626403", "a4656d6264cf0000000000000003");
    const frame = decodeFrame(fromHex(h)) as DispatchFrame;
    expect(frame.n).toBe(2);
    expect(frame.embd).toBe(3);
    // ping { seq: 1, ts: float32 1.5 }
    const ping = decodeFrame(fromHex("84 a174 a470696e67 a176 01 a3736571 01 a27473 ca3fc00000"));
    expect(ping).toEqual({ t: "ping", v: 1, seq: 1, ts: 1.5 });
  });

  it("returns views over the input when aligned, one copy otherwise, always a copy with copy: true", () => {
    const payload = encodeFrame(decodeFrame(pack(rawDispatch())));
    const xAt = hex(payload).indexOf("a178c418") / 2 + 4; // data of x (24 bytes)
    for (let shift = 0; shift < 4; shift++) {
      const buf = new Uint8Array(payload.length + 8);
      buf.set(payload, shift);
      const input = buf.subarray(shift, shift + payload.length);
      const frame = decodeFrame(input) as DispatchFrame;
      const aligned = (shift + xAt) % 4 === 0;
      expect(frame.x.buffer === buf.buffer, `shift ${shift}`).toBe(aligned);
      if (aligned) expect(frame.x.byteOffset).toBe(shift + xAt);
      expect(Array.from(frame.x)).toEqual([1, 2, 3, 4, 5, 6]);
      const copied = decodeFrame(input, { copy: true }) as DispatchFrame;
      expect(copied.x.buffer === buf.buffer).toBe(false);
      expect(copied.ids.buffer === buf.buffer).toBe(false);
      expect(Array.from(copied.x)).toEqual([1, 2, 3, 4, 5, 6]);
    }
  });

  it("gets frames from encodeFrame with the main tensor 8-byte aligned, so they decode without a copy", () => {
    for (const n of [1, 3, 8]) {
      for (const model of ["m", "qwen3-30b-a3b", "x".repeat(40)]) {
        for (const dtype of ["f32", "f16"] as const) {
          const frame = dispatchFrame({
            id: 70000 * n,
            ...(n > 1 ? { to: "peer" } : {}),
            model,
            layer: 17,
            n,
            embd: 100,
            dtype,
            x: dtype === "f32" ? new Float32Array(n * 100) : new Uint16Array(n * 100),
            k: 8,
            ids: new Int32Array(n * 8),
            w: new Float32Array(n * 8),
            mode: "sum",
          } as never);
          const payload = encodeFrame(frame);
          const x = (decodeFrame(payload) as DispatchFrame).x;
          expect(x.buffer === payload.buffer, `${n} ${model} ${dtype}`).toBe(true);
          expect(x.byteOffset % 8).toBe(0);
        }
      }
    }
    const r = resultFrame({ id: 5, mode: "each", n: 2, k: 2, embd: 30, y: new Float32Array(120), ms: 0.25 });
    const bytesOut = encodeFrame(r);
    expect((decodeFrame(bytesOut) as typeof r).y.buffer === bytesOut.buffer).toBe(true);
  });

  it("carries the request id in error details once it has read it", () => {
    const e = protocolError(() => decodeFrame(pack(rawDispatch({ dtype: "f64" }))));
    expect(e.code).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
    expect(e.details).toMatchObject({ type: "dispatch", field: "dtype", id: 42 });
  });
});

describe("decodeFrame: what it rejects, with which code", () => {
  it("MOESWARM_PROTOCOL_FRAME_TOO_LARGE above maxFrameBytes", () => {
    const b = pack(rawDispatch());
    expect(codeOf(b, { maxFrameBytes: b.length - 1 })).toBe("MOESWARM_PROTOCOL_FRAME_TOO_LARGE");
    expect(decodeFrame(b, { maxFrameBytes: b.length }).t).toBe("dispatch");
  });

  it("MOESWARM_PROTOCOL_MALFORMED for bytes that are not one plain msgpack map", () => {
    const valid = pack(rawDispatch());
    const cases: Record<string, Uint8Array> = {
      empty: new Uint8Array(0),
      array: pack([1, 2]),
      int: pack(5),
      trailing: Uint8Array.from([...pack({ t: "ping", v: 1, seq: 1, ts: 1 }), 0xc0]),
      truncated: valid.subarray(0, valid.length - 1),
      "bin past the end": fromHex("81 a178 c6ffffffff 00"),
      "map count past the end": fromHex("df ffffffff a174"),
      "array count past the end": fromHex("82 a174 a470696e67 a17a ddffffffff"),
      "ext (fixext 1)": fromHex("83 a174 a470696e67 a176 01 a178 d40000"),
      "ext in an unknown key": fromHex("85 a174 a470696e67 a176 01 a3736571 01 a27473 01 a17a c7010501"),
      "timestamp ext": fromHex("83 a174 a470696e67 a176 01 a27473 d6ff00000001"),
      "msgpackr record definition": fromHex("82 a174 a470696e67 a176 d47240"),
      "0xc1": fromHex("82 a174 c1 a176 01"),
      "int key": fromHex("83 a174 a470696e67 a176 01 01 01"),
      "duplicate key": pack(rawDispatch()).slice(), // replaced below
      "nested too deep": pack({
        t: "ping",
        v: 1,
        seq: 1,
        ts: 1,
        z: JSON.parse(`${"[".repeat(16)}${"]".repeat(16)}`),
      }),
    };
    // duplicate `n`: a map of 4 entries with n twice
    cases["duplicate key"] = fromHex("84 a174 a470696e67 a176 01 a3736571 01 a3736571 02");
    for (const [name, b] of Object.entries(cases)) {
      expect(codeOf(b), name).toBe("MOESWARM_PROTOCOL_MALFORMED");
    }
    // 15 levels of arrays inside the frame map (16 in all) are still fine
    const deep = pack({
      t: "ping",
      v: 1,
      seq: 1,
      ts: 1,
      z: JSON.parse(`${"[".repeat(15)}${"]".repeat(15)}`),
    });
    expect(decodeFrame(deep).t).toBe("ping");
  });

  it("MOESWARM_PROTOCOL_MISSING_FIELD for an absent required field", () => {
    const without = (key: string, o = rawDispatch()) => {
      delete o[key];
      return pack(o);
    };
    for (const key of ["t", "v", "id", "model", "layer", "n", "embd", "dtype", "x", "k", "ids", "mode"]) {
      const e = protocolError(() => decodeFrame(without(key)));
      expect(e.code, key).toBe("MOESWARM_PROTOCOL_MISSING_FIELD");
      expect(e.details?.field).toBe(key);
    }
    // w is required for "sum" only
    expect(codeOf(without("w"))).toBe("MOESWARM_PROTOCOL_MISSING_FIELD");
    expect(decodeFrame(without("w", rawDispatch({ mode: "each" }))).t).toBe("dispatch");
    expect(codeOf(pack({ t: "hello", v: 1, role: "worker", id: "a" }))).toBe(
      "MOESWARM_PROTOCOL_MISSING_FIELD",
    );
    expect(codeOf(pack({ t: "error", v: 1, msg: "x" }))).toBe("MOESWARM_PROTOCOL_MISSING_FIELD");
  });

  it("MOESWARM_PROTOCOL_VERSION for another version, MOESWARM_PROTOCOL_UNKNOWN_TYPE for another type", () => {
    const e = protocolError(() => decodeFrame(pack({ t: "ping", v: 2, seq: 1, ts: 1 })));
    expect(e.code).toBe("MOESWARM_PROTOCOL_VERSION");
    expect(e.details).toMatchObject({ version: 2 });
    expect(codeOf(pack({ t: "ping", v: 0 }))).toBe("MOESWARM_PROTOCOL_VERSION");
    expect(codeOf(pack({ t: "bogus", v: 1 }))).toBe("MOESWARM_PROTOCOL_UNKNOWN_TYPE");
    expect(codeOf(pack({ t: "x".repeat(1000), v: 1 }))).toBe("MOESWARM_PROTOCOL_UNKNOWN_TYPE");
    expect(codeOf(pack({ t: "", v: 1 }))).toBe("MOESWARM_PROTOCOL_UNKNOWN_TYPE");
  });

  it("MOESWARM_PROTOCOL_BAD_FIELD for a wrong type or a value out of range", () => {
    const L = PROTOCOL_LIMITS;
    const bad: Record<string, Record<string, unknown>> = {
      "t not a string": { t: 1 },
      "v not an int": { v: "1" },
      "v float": { v: 1.5 },
      "n = 0": { n: 0 },
      "n too large": { n: L.maxTokens + 1 },
      "k too large": { k: L.maxSlots + 1 },
      "embd negative": { embd: -3 },
      "id 2^32": { id: 2 ** 32 },
      "id float": { id: 1.5 },
      "layer too large": { layer: L.maxLayer + 1 },
      "dtype unknown": { dtype: "f64" },
      "mode unknown": { mode: "avg" },
      "model empty": { model: "" },
      "model too long": { model: "m".repeat(L.modelBytes + 1) },
      "model not a string": { model: new Uint8Array(1) },
      "x not bin": { x: "abc" },
      "x as array": { x: [1, 2, 3] },
      "to empty": { to: "" },
      "to too long": { to: "p".repeat(L.peerIdBytes + 1) },
      "deadline 2^32": { deadline: 2 ** 32 },
      "ids below -1": { ids: bytes(new Int32Array([0, 1, -2, -1])) },
      "w NaN": { w: bytes(new Float32Array([0.5, Number.NaN, 1, 0])) },
      "w infinite": { w: bytes(new Float32Array([0.5, 1, Number.POSITIVE_INFINITY, 0])) },
      "uint64 beyond 2^53": { id: 2n ** 60n },
    };
    for (const [name, overrides] of Object.entries(bad)) {
      const b = msgpackEncode(rawDispatch(overrides), { useBigInt64: true });
      expect(codeOf(b), name).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
    }
    // float64 1.0 where a uint is expected
    const h = hex(encodeFrame(decodeFrame(pack(rawDispatch())))).replace("a16e02", "a16ecb4000000000000000");
    expect(codeOf(fromHex(h))).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
    // invalid UTF-8 in a string field
    const utf8 = hex(pack(rawDispatch({ model: "ab" }))).replace("a26162", "a2c328");
    expect(codeOf(fromHex(utf8))).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
    // other frame types
    const others: Array<[string, Record<string, unknown>]> = [
      ["hello id too long", { t: "hello", v: 1, role: "worker", id: "w".repeat(129), token: "" }],
      ["hello role", { t: "hello", v: 1, role: "admin", id: "w", token: "" }],
      ["caps not a map", { t: "hello", v: 1, role: "worker", id: "w", token: "", caps: [1] }],
      ["caps maxFrame", { t: "hello", v: 1, role: "worker", id: "w", token: "", caps: { maxFrame: -1 } }],
      ["caps backends", { t: "hello", v: 1, role: "worker", id: "w", token: "", caps: { backends: [""] } }],
      [
        "caps too many",
        { t: "hello", v: 1, role: "worker", id: "w", token: "", caps: { dtypes: Array(65).fill("f") } },
      ],
      ["experts not ascending", { t: "register", v: 1, model: "m", layers: [0], experts: [1, 1] }],
      ["experts negative", { t: "register", v: 1, model: "m", layers: [0], experts: [-1] }],
      ["layers not ints", { t: "register", v: 1, model: "m", layers: ["0"], experts: [] }],
      ["layers too many", { t: "register", v: 1, model: "m", layers: Array(4097).fill(0), experts: [] }],
      ["capacity negative", { t: "register", v: 1, model: "m", layers: [], experts: [], capacity: -1 }],
      [
        "ms negative",
        { t: "result", v: 1, id: 1, mode: "sum", n: 1, k: 1, embd: 1, y: new Uint8Array(4), ms: -1 },
      ],
      ["code lowercase", { t: "error", v: 1, code: "moeswarm_x", msg: "" }],
      ["code too long", { t: "error", v: 1, code: `MOESWARM_${"X".repeat(60)}`, msg: "" }],
      ["msg too long", { t: "error", v: 1, code: "MOESWARM_X", msg: "x".repeat(16385) }],
      ["seq negative", { t: "ping", v: 1, seq: -1, ts: 0 }],
      ["ts NaN", { t: "ping", v: 1, seq: 1, ts: Number.NaN }],
      ["ts infinite", { t: "pong", v: 1, seq: 1, ts: Number.POSITIVE_INFINITY }],
      ["ts string", { t: "pong", v: 1, seq: 1, ts: "1" }],
      ["reason too long", { t: "drain", v: 1, reason: "r".repeat(1025) }],
      ["nil for an optional field", { t: "drain", v: 1, reason: null }],
    ];
    for (const [name, o] of others) expect(codeOf(pack(o)), name).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
    // a non-string key inside caps, or inside an unknown key, is malformed like one at the top
    const caps = fromHex(
      "86 a174 a568656c6c6f a176 01 a4726f6c65 a6776f726b6572 a26964 a177 a5746f6b656e a0",
    );
    expect(codeOf(Uint8Array.from([...caps, ...fromHex("a463617073 81 01 02")]))).toBe(
      "MOESWARM_PROTOCOL_MALFORMED",
    );
    expect(codeOf(Uint8Array.from([...caps, ...fromHex("a17a 91 81 c0 02")]))).toBe(
      "MOESWARM_PROTOCOL_MALFORMED",
    );
    // a repeated key inside caps
    expect(
      codeOf(Uint8Array.from([...caps, ...fromHex("a463617073 82 a6647479706573 90 a6647479706573 90")])),
    ).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
  });

  it("checks expert ids against maxExpert when given", () => {
    const b = pack(rawDispatch({ ids: bytes(new Int32Array([0, 7, 8, -1])) }));
    expect(decodeFrame(b, { maxExpert: 9 }).t).toBe("dispatch");
    const e = protocolError(() => decodeFrame(b, { maxExpert: 8 }));
    expect(e.code).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
    expect(e.details).toMatchObject({ field: "ids", id: 42 });
    const reg = pack({ t: "register", v: 1, model: "m", layers: [0], experts: [0, 8] });
    expect(decodeFrame(reg, { maxExpert: 9 }).t).toBe("register");
    expect(codeOf(reg, { maxExpert: 8 })).toBe("MOESWARM_PROTOCOL_BAD_FIELD");
  });

  it("MOESWARM_PROTOCOL_BAD_LENGTH when a tensor does not match its shape", () => {
    const cases: Record<string, Record<string, unknown>> = {
      "x one element short": { x: bytes(new Float32Array(5)) },
      "x one byte long": { x: new Uint8Array(25) },
      "x f16-sized for f32": { x: new Uint8Array(12) },
      "ids short": { ids: bytes(new Int32Array(3)) },
      "w long": { w: bytes(new Float32Array(5)) },
    };
    for (const [name, o] of Object.entries(cases)) {
      expect(codeOf(pack(rawDispatch(o))), name).toBe("MOESWARM_PROTOCOL_BAD_LENGTH");
    }
    expect(decodeFrame(pack(rawDispatch({ dtype: "bf16", x: new Uint8Array(12) }))).t).toBe("dispatch");
    const result = (mode: string, floats: number) =>
      pack({ t: "result", v: 1, id: 1, mode, n: 2, k: 3, embd: 4, y: new Uint8Array(floats * 4) });
    expect(decodeFrame(result("each", 24)).t).toBe("result");
    expect(decodeFrame(result("sum", 8)).t).toBe("result");
    expect(codeOf(result("each", 8))).toBe("MOESWARM_PROTOCOL_BAD_LENGTH");
    expect(codeOf(result("sum", 24))).toBe("MOESWARM_PROTOCOL_BAD_LENGTH");
  });

  it("rejects bad options and non-byte input with InvalidArgumentError", () => {
    const b = pack(rawDispatch());
    expect(() => decodeFrame(b, { maxFrameBytes: 0 })).toThrow(InvalidArgumentError);
    expect(() => decodeFrame(b, { maxExpert: -1 })).toThrow(InvalidArgumentError);
    expect(() => decodeFrame("x" as unknown as Uint8Array)).toThrow(InvalidArgumentError);
  });
});

describe("validateFrame, builders and encodeFrame", () => {
  const base = {
    id: 1,
    model: "m",
    layer: 0,
    n: 2,
    embd: 2,
    dtype: "f32" as const,
    x: new Float32Array(4),
    k: 1,
    ids: new Int32Array(2),
    mode: "each" as const,
  };

  function invalid(fn: () => unknown, protocolCode: string) {
    try {
      fn();
    } catch (error) {
      expect(error).toBeInstanceOf(InvalidArgumentError);
      expect(isMoeswarmError(error, "MOESWARM_INVALID_ARGUMENT")).toBe(true);
      expect((error as InvalidArgumentError).details?.protocolCode).toBe(protocolCode);
      return;
    }
    throw new Error("expected an InvalidArgumentError");
  }

  it("checks the same rules as the decoder", () => {
    expect(dispatchFrame(base).t).toBe("dispatch");
    invalid(() => dispatchFrame({ ...base, x: new Float32Array(3) }), "MOESWARM_PROTOCOL_BAD_LENGTH");
    invalid(
      () => dispatchFrame({ ...base, x: new Float64Array(4) as unknown as Float32Array }),
      "MOESWARM_PROTOCOL_BAD_FIELD",
    );
    invalid(
      () => dispatchFrame({ ...base, dtype: "f16", x: new Float32Array(4) } as never),
      "MOESWARM_PROTOCOL_BAD_FIELD",
    );
    invalid(() => dispatchFrame({ ...base, mode: "sum" }), "MOESWARM_PROTOCOL_MISSING_FIELD");
    invalid(() => dispatchFrame({ ...base, ids: new Int32Array([0, -2]) }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => dispatchFrame({ ...base, n: 2.5 }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => dispatchFrame({ ...base, model: "\uD800" }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => dispatchFrame({ ...base, model: "é".repeat(129) }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => registerFrame({ model: "m", layers: [0], experts: [3, 2] }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => pingFrame({ seq: 2 ** 53, ts: 0 }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => pingFrame({ seq: 1, ts: Number.NaN }), "MOESWARM_PROTOCOL_BAD_FIELD");
    invalid(() => helloFrame({ role: "worker", id: "w" } as never), "MOESWARM_PROTOCOL_MISSING_FIELD");
    invalid(
      () => resultFrame({ id: 1, mode: "sum", n: 1, k: 2, embd: 2, y: new Float32Array(4) }),
      "MOESWARM_PROTOCOL_BAD_LENGTH",
    );
    invalid(() => encodeFrame({ t: "nope", v: 1 } as unknown as Frame), "MOESWARM_PROTOCOL_UNKNOWN_TYPE");
    invalid(
      () => encodeFrame({ ...pingFrame({ seq: 1, ts: 1 }), v: 2 } as unknown as Frame),
      "MOESWARM_PROTOCOL_VERSION",
    );
    invalid(
      () => validateFrame(registerFrame({ model: "m", layers: [0], experts: [0, 8] }), { maxExpert: 8 }),
      "MOESWARM_PROTOCOL_BAD_FIELD",
    );
  });

  it("builders keep only the frame's fields, in canonical order", () => {
    const f = errorFrame({ msg: "m", code: "MOESWARM_X", id: 3, extra: 1 } as never);
    expect(Object.keys(f)).toEqual(["t", "v", "id", "code", "msg"]);
  });

  it("refuses to produce a frame larger than maxFrameBytes", () => {
    const frame = dispatchFrame({ ...base, n: 1024, x: new Float32Array(2048), ids: new Int32Array(1024) });
    const size = encodeFrame(frame).length;
    expect(protocolError(() => encodeFrame(frame, { maxFrameBytes: size - 1 })).code).toBe(
      "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
    );
    expect(protocolError(() => encodeFrame(frame, { maxFrameBytes: 100 })).code).toBe(
      "MOESWARM_PROTOCOL_FRAME_TOO_LARGE",
    );
    expect(encodeFrame(frame, { maxFrameBytes: size }).length).toBe(size);
  });
});

describe("compact results (mode each, the filled slots' rows only)", () => {
  const base = { id: 5, model: "m", layer: 1, n: 2, embd: 3, dtype: "f32" as const, k: 2 };
  const x = Float32Array.from([1, 2, 3, 4, 5, 6]);
  const ids = Int32Array.from([4, -1, 0, 7]);

  it("round-trips a compact dispatch and a compact result, as bool keys at the end", () => {
    const d = dispatchFrame({ ...base, x, ids, mode: "each", compact: true });
    const bytes = encodeFrame(d);
    // the last entry: fixstr "compact", then 0xc3
    expect(Buffer.from(bytes.subarray(bytes.length - 9)).toString("hex")).toBe(
      `a7${Buffer.from("compact").toString("hex")}c3`,
    );
    expect(decodeFrame(bytes)).toMatchObject({ t: "dispatch", compact: true, mode: "each" });
    // three filled slots: three rows
    const y = Float32Array.from({ length: 9 }, (_, i) => i / 2);
    const r = decodeFrame(
      encodeFrame(resultFrame({ id: 5, mode: "each", n: 2, k: 2, embd: 3, y, compact: true })),
    );
    expect(r).toMatchObject({ t: "result", compact: true });
    expect(Array.from((r as ResultFrame).y)).toEqual(Array.from(y));
  });

  it("refuses compact with mode sum, a compact length that is no whole rows, and a non-bool compact", () => {
    expect(() =>
      dispatchFrame({ ...base, x, ids, w: Float32Array.from([1, 1, 1, 1]), mode: "sum", compact: true }),
    ).toThrow(/compact/);
    expect(() =>
      resultFrame({ id: 5, mode: "each", n: 2, k: 2, embd: 3, y: new Float32Array(7), compact: true }),
    ).toThrow(/multiple of embd/);
    expect(() =>
      resultFrame({ id: 5, mode: "each", n: 2, k: 2, embd: 3, y: new Float32Array(15), compact: true }),
    ).toThrow(/up to n\*k\*embd/);
    // on the wire: compact as 1 instead of true
    const good = encodeFrame(dispatchFrame({ ...base, x, ids, mode: "each", compact: true }));
    const bad = Uint8Array.from(good);
    bad[bad.length - 1] = 0x01;
    expect(() => decodeFrame(bad)).toThrow(expect.objectContaining({ code: "MOESWARM_PROTOCOL_BAD_FIELD" }));
    // a decoder that never heard of compact would skip it: a full result stays valid without it
    const full = resultFrame({ id: 5, mode: "each", n: 2, k: 2, embd: 3, y: new Float32Array(12) });
    expect(decodeFrame(encodeFrame(full))).not.toHaveProperty("compact");
  });
});
