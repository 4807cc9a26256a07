import { describe, expect, it } from "vitest";
import { computeClassOf, wireDtypesOf } from "../src/compute-class.js";

describe("computeClassOf", () => {
  it("names backend, device and architecture, so x86 and aarch64 or CPU and GPU never share a class", () => {
    expect(computeClassOf("llama-cpu", { device: "llama-cpu" }, "x64")).toBe("llama-cpu/x64");
    expect(computeClassOf("native", { device: "CPU" }, "x64")).toBe("native/cpu/x64");
    expect(computeClassOf("worker", { device: "CPU" }, "arm64")).toBe("worker/cpu/arm64");
    expect(computeClassOf("worker", { device: "Vulkan0" }, "x64")).toBe("worker/vulkan0/x64");
    expect(computeClassOf("ts", {}, "x64")).toBe("ts/x64");
    expect(computeClassOf("worker", { device: "CPU" }, "x64")).not.toBe(
      computeClassOf("worker", { device: "CPU" }, "arm64"),
    );
  });

  it("fits the register frame's 64-byte field", () => {
    expect(computeClassOf("worker", { device: "x".repeat(100) }, "x64")).toHaveLength(64);
  });
});

describe("wireDtypesOf", () => {
  const q8 = ["f32", "f16", "bf16", "q8_0", "q8_K"];
  const plain = ["f32", "f16", "bf16"];

  it("q8_0 / q8_K only where ggml's CPU kernels compute: the addon, the CPU executable, llama-cpu", () => {
    expect(wireDtypesOf({ backend: "native", device: "CPU" })).toEqual(q8);
    expect(wireDtypesOf({ backend: "native", device: "llama-cpu" })).toEqual(q8);
    expect(wireDtypesOf({ backend: "worker", device: "cpu" })).toEqual(q8);
    expect(wireDtypesOf({ backend: "worker", device: "llama-cpu" })).toEqual(q8);
  });

  it("the plain dtypes alone on a GPU and in TypeScript; nothing when a native compute hides its device", () => {
    expect(wireDtypesOf({ backend: "native", device: "CUDA0" })).toEqual(plain);
    expect(wireDtypesOf({ backend: "worker", device: "vulkan0" })).toEqual(plain);
    expect(wireDtypesOf({ backend: "ts" })).toEqual(plain);
    expect(wireDtypesOf({ backend: "native" })).toBeUndefined();
  });
});
