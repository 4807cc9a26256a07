import { InvalidArgumentError } from "@moeswarm/core";

/**
 * The expert FFN's activation, as `build_moe_ffn` applies it (src/llama-graph.cpp:2166-2248).
 * With a gate tensor the activation is gated (`act(gate) * up`); without one it applies to `up`.
 */
export type ExpertActivation =
  | {
      readonly kind: "silu";
      /**
       * `<arch>.swiglu_clamp_exp` of the layer (applied only when > 1e-6 and the gate is a
       * separate tensor, llama-graph.cpp:2168-2192). "clamp_output" (step35, bailingmoe3):
       * up clamped to ±limit and silu(gate) capped at limit; "clamp_input" (deepseek4,
       * `ggml_swiglu_clamp`): gate capped at limit and up clamped to ±limit before silu.
       */
      readonly limit?: number;
      readonly limitMode?: "clamp_output" | "clamp_input";
    }
  | { readonly kind: "gelu" }
  | { readonly kind: "relu" }
  | { readonly kind: "relu_sqr" }
  /** gpt-oss / minimax-m3: `min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, ±limit) + 1)`. */
  | { readonly kind: "swiglu_oai"; readonly alpha: number; readonly limit: number }
  /** kimi-k3: `beta*tanh(g/beta)*sigmoid(g) * (linearBeta > 0 ? linearBeta*tanh(u/linearBeta) : u)`. */
  | { readonly kind: "situ"; readonly beta: number; readonly linearBeta: number };

/** An activation object, or the name of one that takes no parameters. */
export type ActivationSpec = ExpertActivation | "silu" | "gelu" | "relu" | "relu_sqr" | "swiglu_oai";

/** build_moe_ffn's constants for LLM_FFN_SWIGLU_OAI_MOE (llama-graph.cpp:2223-2224). */
export const SWIGLU_OAI_ALPHA = 1.702;
export const SWIGLU_OAI_LIMIT = 7.0;

export function normalizeActivation(spec: ActivationSpec | undefined): ExpertActivation {
  if (spec === undefined || spec === "silu") return { kind: "silu" };
  if (spec === "gelu" || spec === "relu" || spec === "relu_sqr") return { kind: spec };
  if (spec === "swiglu_oai") return { kind: "swiglu_oai", alpha: SWIGLU_OAI_ALPHA, limit: SWIGLU_OAI_LIMIT };
  if (typeof spec === "object" && spec !== null) {
    switch (spec.kind) {
      case "silu":
        if (spec.limit !== undefined && !(Number.isFinite(spec.limit) && spec.limit >= 0)) break;
        return spec;
      case "gelu":
      case "relu":
      case "relu_sqr":
        return spec;
      case "swiglu_oai":
        if (!Number.isFinite(spec.alpha) || !Number.isFinite(spec.limit)) break;
        return spec;
      case "situ":
        if (!(spec.beta > 0) || !Number.isFinite(spec.linearBeta)) break;
        return spec;
    }
  }
  throw new InvalidArgumentError(`invalid expert activation ${JSON.stringify(spec)}`);
}

const SQRT_2_OVER_PI = Math.sqrt(2 / Math.PI);

function silu(x: number): number {
  return x / (1 + Math.exp(-x));
}

/** ggml's GELU is the tanh approximation (ggml-cpu/vec.h:968); ggml-cpu looks it up in an f16 table. */
function gelu(x: number): number {
  return 0.5 * x * (1 + Math.tanh(SQRT_2_OVER_PI * x * (1 + 0.044715 * x * x)));
}

function sigmoid(x: number): number {
  return 1 / (1 + Math.exp(-x));
}

/** One element of the activation in f64. `gate` is undefined for up-only experts. */
export function activate(act: ExpertActivation, gate: number | undefined, up: number): number {
  switch (act.kind) {
    case "silu": {
      if (gate === undefined) return silu(up);
      const limit = act.limit ?? 0;
      if (limit > 1e-6) {
        const u = Math.min(Math.max(up, -limit), limit);
        if (act.limitMode === "clamp_input") return silu(Math.min(gate, limit)) * u;
        return Math.min(silu(gate), limit) * u;
      }
      return silu(gate) * up;
    }
    case "gelu":
      return gate === undefined ? gelu(up) : gelu(gate) * up;
    case "relu":
      return gate === undefined ? Math.max(up, 0) : Math.max(gate, 0) * up;
    case "relu_sqr": {
      if (gate !== undefined) {
        // llama.cpp aborts on gated squared relu (llama-graph.cpp:2239)
        throw new InvalidArgumentError("relu_sqr takes no gate tensor");
      }
      const r = Math.max(up, 0);
      return r * r;
    }
    case "swiglu_oai": {
      if (gate === undefined) {
        throw new InvalidArgumentError("swiglu_oai needs a gate tensor");
      }
      const x = Math.min(gate, act.limit);
      const y = Math.min(Math.max(up, -act.limit), act.limit);
      return (x / (1 + Math.exp(-act.alpha * x))) * (y + 1);
    }
    case "situ": {
      if (gate === undefined) throw new InvalidArgumentError("situ needs a gate tensor");
      const a = act.beta * Math.tanh(gate / act.beta) * sigmoid(gate);
      const u = act.linearBeta > 0 ? act.linearBeta * Math.tanh(up / act.linearBeta) : up;
      return a * u;
    }
  }
}
