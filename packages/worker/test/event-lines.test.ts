// The start line for people: with glibc's malloc untuned it says what to set.
import { describe, expect, it } from "vitest";
import { formatWorkerEvent } from "../src/events.js";

const start = {
  event: "start",
  id: "wk",
  hub: "https://hub.example/",
  capacityBytes: 2 ** 30,
  cacheDir: "/cache",
  backend: "llama-cpu",
} as const;

describe("the start line", () => {
  it("asks for GLIBC_TUNABLES only where glibc runs with its defaults", () => {
    expect(formatWorkerEvent({ ...start, malloc: "glibc defaults" })).toMatch(
      /; glibc's malloc runs with its defaults, .*GLIBC_TUNABLES=glibc\.malloc\.top_pad=67108864:.*docs\/deploy\.md/,
    );
    for (const malloc of ["tuned", "not glibc"] as const) {
      expect(formatWorkerEvent({ ...start, malloc })).toBe(
        "worker wk starting: hub https://hub.example/, capacity 1.1 GB, cache /cache, backend llama-cpu",
      );
    }
  });
});
