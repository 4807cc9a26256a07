import { createRequire } from "node:module";
import { dirname, join } from "node:path";
import { describe, expect, it } from "vitest";

// ws masks every client frame and unmasks every frame a server reads, in a JavaScript byte loop
// unless it finds bufferutil (an optional dependency here, prebuilt for linux-x64, darwin and
// win32): that loop took ~2.5 ms for each 772 KB activation frame on the relay path, 3-4x the
// whole round trip with bufferutil. This keeps the dependency from going missing unnoticed.
const wsMain = createRequire(import.meta.url).resolve("ws");
const prebuilt = ["linux-x64", "darwin-x64", "darwin-arm64", "win32-x64"].includes(
  `${process.platform}-${process.arch}`,
);
if (!prebuilt) {
  console.warn(
    `skipping the native-mask test: bufferutil has no prebuild for ${process.platform}-${process.arch}`,
  );
}

describe.skipIf(!prebuilt)("ws's masking", () => {
  it("is bufferutil's native code, not ws's JavaScript fallback", () => {
    const util = createRequire(wsMain)(join(dirname(wsMain), "lib", "buffer-util.js")) as {
      mask: { name: string };
      unmask: { name: string };
    };
    // the fallbacks are ws's own _mask and _unmask; with bufferutil, wrappers that call it
    expect(util.unmask.name).not.toBe("_unmask");
    expect(util.mask.name).not.toBe("_mask");
    const bytes = Buffer.alloc(64, 0x5a);
    const mask = Buffer.from([1, 2, 3, 4]);
    (util as unknown as { unmask(b: Buffer, m: Buffer): void }).unmask(bytes, mask);
    expect(bytes[0]).toBe(0x5a ^ 1);
    expect(bytes[63]).toBe(0x5a ^ 4);
  });
});
