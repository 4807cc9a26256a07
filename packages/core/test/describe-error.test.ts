import { parseArgs } from "node:util";
import { describe, expect, it } from "vitest";
import { describeError, InvalidArgumentError, TransportError } from "../src/index.js";

describe("describeError", () => {
  it("gives a MoeswarmError's code, message and details", () => {
    const e = new TransportError("MOESWARM_TRANSPORT_CLOSED", "gone", { details: { url: "x" } });
    expect(describeError(e)).toEqual({
      code: "MOESWARM_TRANSPORT_CLOSED",
      message: "gone",
      details: { url: "x" },
    });
    expect(describeError(new InvalidArgumentError("bad"))).toMatchObject({
      code: "MOESWARM_INVALID_ARGUMENT",
      message: "bad",
    });
  });

  it("turns a parseArgs error into MOESWARM_INVALID_ARGUMENT", () => {
    let error: unknown;
    try {
      parseArgs({ args: ["--nope"], options: {}, strict: true });
    } catch (e) {
      error = e;
    }
    expect(describeError(error)).toEqual({
      code: "MOESWARM_INVALID_ARGUMENT",
      message: (error as Error).message,
    });
  });

  it("names anything else by its string code, its name, or Error", () => {
    const enoent = Object.assign(new Error("no such file"), { code: "ENOENT" });
    expect(describeError(enoent)).toEqual({ code: "ENOENT", message: "no such file" });
    expect(describeError(new RangeError("out"))).toEqual({ code: "RangeError", message: "out" });
    expect(describeError("plain")).toEqual({ code: "Error", message: "plain" });
    expect(describeError(null)).toEqual({ code: "Error", message: "null" });
  });
});
