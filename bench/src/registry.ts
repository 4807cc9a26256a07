import type { Benchmark } from "./harness.js";

// Every named benchmark, in the order `pnpm bench` runs them. Add new ones here.
export const benchmarks: Benchmark[] = [];
