import { describe, expect, it } from "vitest";
import { computeClassOf } from "../src/compute-class.js";

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
