import { codec } from "./benchmarks/codec.js";
import { combine } from "./benchmarks/combine.js";
import { computeCall } from "./benchmarks/compute-call.js";
import { decode } from "./benchmarks/decode.js";
import { dispatchInproc } from "./benchmarks/dispatch-inproc.js";
import { expertCompute } from "./benchmarks/expert-compute.js";
import { expertComputeShape } from "./benchmarks/expert-compute-shape.js";
import { expertShard } from "./benchmarks/expert-shard.js";
import { parse } from "./benchmarks/parse.js";
import { relay } from "./benchmarks/relay.js";
import { roundtrip } from "./benchmarks/roundtrip.js";
import { slice } from "./benchmarks/slice.js";
import { throughput } from "./benchmarks/throughput.js";
import { throughputContexts } from "./benchmarks/throughput-contexts.js";
import type { Benchmark } from "./harness.js";

// Every named benchmark, in the order `pnpm bench` runs them. Add new ones here.
export const benchmarks: Benchmark[] = [
  codec,
  parse,
  relay,
  roundtrip,
  dispatchInproc,
  combine,
  expertCompute,
  computeCall,
  expertComputeShape,
  slice,
  expertShard,
  decode,
  throughput,
  // last: createSwarmLlama must be the process's first getLlama (the plugin loads with the backends)
  throughputContexts,
];
