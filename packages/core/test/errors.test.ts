import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import {
  AbortError,
  AuthError,
  abortReason,
  DispatchError,
  ERROR_CODES,
  errorFromCode,
  errorToWire,
  GgufError,
  HubError,
  InvalidArgumentError,
  IoError,
  isErrorCode,
  isMoeswarmError,
  MoeswarmError,
  NativeError,
  ProtocolError,
  TransportError,
  throwIfAborted,
} from "../src/index.js";

describe("MoeswarmError", () => {
  it("carries code, message, cause and details", () => {
    const cause = new Error("disk");
    const e = new GgufError("MOESWARM_GGUF_TRUNCATED", "header cut at 12", {
      cause,
      details: { offset: 12 },
    });
    expect(e.code).toBe("MOESWARM_GGUF_TRUNCATED");
    expect(e.message).toBe("header cut at 12");
    expect(e.cause).toBe(cause);
    expect(e.details).toEqual({ offset: 12 });
    expect(e.name).toBe("GgufError");
    expect(e).toBeInstanceOf(Error);
    expect(e).toBeInstanceOf(MoeswarmError);
    expect(e).toBeInstanceOf(GgufError);
    expect(e).not.toBeInstanceOf(ProtocolError);
    expect(e.toJSON()).toEqual({
      name: "GgufError",
      code: "MOESWARM_GGUF_TRUNCATED",
      message: "header cut at 12",
      details: { offset: 12 },
    });
  });

  it("defaults the message to the table's text", () => {
    expect(new DispatchError("MOESWARM_WORKER_TIMEOUT").message).toBe(
      ERROR_CODES.MOESWARM_WORKER_TIMEOUT.text,
    );
  });

  it("refuses a code from another area", () => {
    // @ts-expect-error: a protocol code is not a GgufError code
    expect(() => new GgufError("MOESWARM_PROTOCOL_MALFORMED")).toThrow(TypeError);
  });

  it("instanceof survives a second copy of the package (brand in the global symbol registry)", () => {
    // an object made by another copy of the class carries the same registry symbol
    const foreign = Object.create(Error.prototype) as Record<symbol | string, unknown>;
    Object.defineProperty(foreign, Symbol.for("moeswarm.error.kinds"), {
      value: ["GgufError", "MoeswarmError"],
    });
    foreign.code = "MOESWARM_GGUF_BAD_MAGIC";
    expect(foreign instanceof GgufError).toBe(true);
    expect(foreign instanceof MoeswarmError).toBe(true);
    expect(foreign instanceof ProtocolError).toBe(false);
    expect(isMoeswarmError(foreign, "MOESWARM_GGUF_BAD_MAGIC")).toBe(true);
    expect(isMoeswarmError(new Error("x"))).toBe(false);
    expect(isMoeswarmError(null)).toBe(false);
  });

  it("isErrorCode knows the table and nothing else", () => {
    expect(isErrorCode("MOESWARM_GGUF_IO")).toBe(true);
    expect(isErrorCode("MOESWARM_NOPE")).toBe(false);
    expect(isErrorCode("toString")).toBe(false);
  });
});

describe("error code table", () => {
  it("every code is MOESWARM_ prefixed, unique in text, and names a real class", () => {
    const classes = new Set([
      "InvalidArgumentError",
      "AbortError",
      "GgufError",
      "ProtocolError",
      "DispatchError",
      "TransportError",
      "AuthError",
      "NativeError",
      "HubError",
      "IoError",
    ]);
    for (const [code, { area, text }] of Object.entries(ERROR_CODES)) {
      expect(code).toMatch(/^MOESWARM_[A-Z0-9_]+$/);
      expect(classes.has(area)).toBe(true);
      expect(text.length).toBeGreaterThan(10);
    }
  });

  it("docs/errors.md documents exactly the codes of the table (regenerate with pnpm docs:errors)", () => {
    const doc = readFileSync(new URL("../../../docs/errors.md", import.meta.url), "utf8");
    const documented = new Map<string, string>();
    // cells are trimmed: the formatter pads markdown tables
    for (const line of doc.split("\n")) {
      const cells = line
        .replace(/^\|/, "")
        .replace(/\|$/, "")
        .split(" | ")
        .map((c) => c.trim());
      const code = /^`(MOESWARM_[A-Z0-9_]+)`$/.exec(cells[0] ?? "")?.[1];
      if (code && cells.length === 3) documented.set(code, `${cells[1]!.replaceAll("`", "")}|${cells[2]}`);
    }
    const table = new Map(Object.entries(ERROR_CODES).map(([c, { area, text }]) => [c, `${area}|${text}`]));
    expect(documented).toEqual(table);
  });
});

describe("errors across the wire", () => {
  const classes = {
    InvalidArgumentError,
    AbortError,
    GgufError,
    ProtocolError,
    DispatchError,
    TransportError,
    AuthError,
    NativeError,
    HubError,
    IoError,
  };

  it("errorFromCode gives every code of the table the class its area names", () => {
    for (const [code, { area }] of Object.entries(ERROR_CODES)) {
      const e = errorFromCode(code, `m ${code}`, { details: { peer: "w1" } });
      expect(e).toBeInstanceOf(classes[area]);
      expect(e.name).toBe(area);
      for (const [other, cls] of Object.entries(classes)) {
        if (other !== area) expect(e).not.toBeInstanceOf(cls);
      }
      expect(e.toJSON()).toEqual({ name: area, code, message: `m ${code}`, details: { peer: "w1" } });
    }
    const cause = new Error("socket");
    expect(errorFromCode("MOESWARM_AUTH_EXPIRED", "late", { cause }).cause).toBe(cause);
    expect(errorFromCode("MOESWARM_AUTH_EXPIRED", "late").details).toBeUndefined();
  });

  it("errorFromCode turns a code this build does not know into the fallback, keeping the code", () => {
    const e = errorFromCode("MOESWARM_FROM_THE_FUTURE", "news", { details: { from: "w2" } });
    expect(e).toBeInstanceOf(DispatchError);
    expect(e.toJSON()).toEqual({
      name: "DispatchError",
      code: "MOESWARM_DISPATCH_FAILED",
      message: "MOESWARM_FROM_THE_FUTURE: news",
      details: { from: "w2", code: "MOESWARM_FROM_THE_FUTURE" },
    });
    // `details.code` is the peer's even when the caller's details had one
    expect(errorFromCode("toString", "x", { details: { code: "mine" } }).details).toEqual({
      code: "toString",
    });
    const native = errorFromCode("NOT_A_CODE", "x", { fallback: "MOESWARM_NATIVE_COMPUTE" });
    expect(native).toBeInstanceOf(NativeError);
    expect(native).toMatchObject({ code: "MOESWARM_NATIVE_COMPUTE", details: { code: "NOT_A_CODE" } });
  });

  it("errorToWire keeps a moeswarm error's code, sends anything else as DISPATCH_FAILED, bounds msg", () => {
    expect(errorToWire(new AuthError("MOESWARM_AUTH_ROLE", "no"))).toEqual({
      code: "MOESWARM_AUTH_ROLE",
      msg: "no",
    });
    expect(errorToWire(new RangeError("bad"))).toEqual({ code: "MOESWARM_DISPATCH_FAILED", msg: "bad" });
    expect(errorToWire(42)).toEqual({ code: "MOESWARM_DISPATCH_FAILED", msg: "42" });
    const long = errorToWire(new HubError("MOESWARM_HUB_INTERNAL", "\u{1F600}".repeat(10_000)));
    expect(long.msg.length).toBe(4096);
    expect(Buffer.byteLength(long.msg)).toBeLessThanOrEqual(16 * 1024);
    // what one side writes, the other reads back as the same class and code
    const { code, msg } = errorToWire(new GgufError("MOESWARM_GGUF_TRUNCATED", "cut"));
    const back = errorFromCode(code, msg);
    expect(back).toBeInstanceOf(GgufError);
    expect(back).toMatchObject({ code: "MOESWARM_GGUF_TRUNCATED", message: "cut" });
  });
});

describe("abort helpers", () => {
  it("throwIfAborted passes when not aborted and throws the reason when aborted", () => {
    expect(() => throwIfAborted(undefined)).not.toThrow();
    const c = new AbortController();
    expect(() => throwIfAborted(c.signal)).not.toThrow();
    const reason = new Error("stop");
    c.abort(reason);
    expect(() => throwIfAborted(c.signal)).toThrow(reason);
  });

  it("wraps a non-Error reason in an AbortError", () => {
    const c = new AbortController();
    c.abort("because");
    const r = abortReason(c.signal);
    expect(r).toBeInstanceOf(AbortError);
    expect((r as AbortError).cause).toBe("because");
    expect(new InvalidArgumentError("MOESWARM_INVALID_ARGUMENT")).not.toBeInstanceOf(AbortError);
  });
});
