import type { ExpertTransport } from "@moeswarm/core";
import type { DispatchOptions } from "./dispatch-options.js";
import { Liveness } from "./liveness.js";
import { Verification } from "./verification.js";

// The defaults of trust and liveness, decided per call from the options and the transport.
// A transport that says it is `trusted` (its workers run in this process) keeps the behaviour of
// before: no verification, fixed deadlines, no hedging unless asked. Any other transport (the
// relay: strangers' devices) gets trust "verify" and liveness unless told otherwise. The state
// (quarantine, round times, circuits) must outlive one call, so a call without its own objects
// shares one per transport.

const verifications = new WeakMap<ExpertTransport, Verification>();
const livenesses = new WeakMap<ExpertTransport, Liveness>();

export interface ResolvedTrust {
  readonly verification: Verification | undefined;
  readonly liveness: Liveness | undefined;
  readonly hedgeMs: number | "adaptive" | undefined;
}

function shared<T extends object>(map: WeakMap<ExpertTransport, T>, t: ExpertTransport, make: () => T): T {
  let v = map.get(t);
  if (!v) {
    v = make();
    map.set(t, v);
  }
  return v;
}

/** The call's verification, liveness and hedge delay from its options and transport. */
export function resolveTrust(options: DispatchOptions): ResolvedTrust {
  const trusted = options.transport.trusted === true;
  const trust = options.trust ?? (trusted ? "own" : "verify");
  const verification =
    trust === "verify"
      ? (options.verification ?? shared(verifications, options.transport, () => new Verification()))
      : undefined;
  const liveness =
    options.liveness === false
      ? undefined
      : (options.liveness ??
        (trusted ? undefined : shared(livenesses, options.transport, () => new Liveness())));
  // hedgeMs 0: off. Unset: adaptive under trust "own" with liveness (verify already asks two owners)
  const h = options.hedgeMs;
  const hedgeMs =
    h !== undefined
      ? h > 0
        ? h
        : undefined
      : trust === "own" && liveness
        ? ("adaptive" as const)
        : undefined;
  return { verification, liveness, hedgeMs };
}
