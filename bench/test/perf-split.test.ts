// The roundtrip bench's perf rows: a process's perf report summed by where each sample ran.
import { describe, expect, it } from "vitest";
import { perfCategory, splitLine, splitOfReport } from "../src/benchmarks/perf-split.js";

// lines of `perf report -q --no-children --sort dso,sym -g none -F period,dso,sym` of a relay,
// as perf printed them (the JIT object's name holds spaces)
const REPORT = [
  "     347300000  [JIT] tid 21930      [.] JS:*indexMap file:///work/main/packages/core/dist/index.js:1465:18",
  "    2387000000  [kernel.kallsyms]    [k] pvm_irq_enable",
  "     464100000  node                 [.] _aesni_ctr32_ghash_6x",
  "     117500000  libc.so.6            [.] __memmove_avx512_unaligned_erms",
  "      37700000  node                 [.] Builtins_CallFunction_ReceiverIsAny",
  "      57600000  node                 [.] v8::internal::(anonymous namespace)::Invoke",
  "      41800000  node                 [.] uv__io_poll",
  "      12100000  node                 [.] node::crypto::TLSWrap::EncOut",
  "      10000000  node                 [.] node::StreamBase::WriteBuffer",
  "        100000  libm.so.6            [.] __exp_finite",
  "       2000000  [unknown]            [.] 0x00007f2654001234",
  "",
  "# a comment perf may print",
].join("\n");

describe("perf split", () => {
  it("sums each sample's period by where it ran, in µs per trip", () => {
    const split = splitOfReport(REPORT, 1000);
    expect(split.JavaScript).toBeCloseTo(347.3 + 2.0, 6);
    expect(split.kernel).toBeCloseTo(2387, 6);
    // the TLS code Node wraps OpenSSL with counts as OpenSSL: both are the cost of TLS
    expect(split.OpenSSL).toBeCloseTo(464.1 + 12.1, 6);
    expect(split.libc).toBeCloseTo(117.5, 6);
    expect(split["V8 builtins"]).toBeCloseTo(37.7, 6);
    expect(split["V8 runtime"]).toBeCloseTo(57.6, 6);
    expect(split.libuv).toBeCloseTo(41.8, 6);
    expect(split["Node C++"]).toBeCloseTo(10, 6);
    expect(split.other).toBeCloseTo(0.1, 6);
  });

  it("tells V8's builtins from its runtime and from compiled JavaScript", () => {
    expect(perfCategory("node", "Builtins_KeyedStoreIC_Megamorphic")).toBe("V8 builtins");
    expect(perfCategory("node", "v8::internal::ConcurrentMarking::RunMajor")).toBe("V8 runtime");
    expect(perfCategory("[JIT] tid 7", "JS:^#onMessage file:///x.js:1:2")).toBe("JavaScript");
    expect(perfCategory("node", "BIO_read")).toBe("OpenSSL");
    expect(perfCategory("libc.so.6", "malloc")).toBe("libc");
  });

  it("writes a split as its total, then the categories from the largest", () => {
    const line = splitLine(splitOfReport(REPORT, 1000));
    expect(line).toBe(
      "3477.2 = kernel 2387.0, OpenSSL 476.2, JavaScript 349.3, libc 117.5, V8 runtime 57.6, libuv 41.8, V8 builtins 37.7, Node C++ 10.0, other 0.1",
    );
  });
});
