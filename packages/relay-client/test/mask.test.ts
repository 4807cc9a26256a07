import { describe, expect, it, vi } from "vitest";

// The WebSocket link's masks: an all-zero mask would make ws send the caller's bytes uncopied,
// after the connection has reused their memory (see link.ts). Randomness mocked to zeros here.
vi.mock("node:crypto", async (importOriginal) => ({
  ...(await importOriginal<typeof import("node:crypto")>()),
  randomFillSync: (b: Uint8Array) => b.fill(0),
}));

const { nonZeroMask } = await import("../src/link.js");

describe("nonZeroMask", () => {
  it("never returns four zero bytes, even from zero randomness", () => {
    const mask = Buffer.alloc(4);
    // past one refill of the pool (8 KiB = 2048 masks)
    for (let i = 0; i < 3000; i++) {
      mask.fill(0xff);
      nonZeroMask(mask);
      expect([...mask]).toEqual([1, 0, 0, 0]);
    }
  });
});
