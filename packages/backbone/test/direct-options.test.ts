// The direct-links switches of the backbone: `hub.direct` is checked, and moeswarm-dispatcher's
// --no-direct turns it off (everything over the relay).
import { describe, expect, it } from "vitest";
import { hubOptions, parse } from "../src/cli/options.js";
import { checkHubOptions } from "../src/hub-options.js";

describe("direct-link options", () => {
  it("--no-direct sets hub.direct false; without it the default (direct links on) is left", () => {
    const base = ["--hub", "https://hub.example", "--token", "t", "--model-id", "m"];
    const off = parse([...base, "--no-direct"]).values;
    expect(hubOptions("https://hub.example", off as never, "m", 0).direct).toBe(false);
    const on = parse(base).values;
    expect(hubOptions("https://hub.example", on as never, "m", 0)).not.toHaveProperty("direct");
  });

  it("refuses a hub.direct that is not a boolean", () => {
    const hub = { url: "https://hub.example", token: "t", model: "m" };
    expect(() => checkHubOptions({ ...hub, direct: "yes" as never })).toThrow(
      /hub.direct must be true or false/,
    );
    expect(() => checkHubOptions({ ...hub, direct: false })).not.toThrow();
  });
});
