// Shared by market-claims.test.ts and market-slices.test.ts: the README example and a market with numbered leases.
import { CoverageMarket, type MarketModel } from "./market-helpers.js";

export const MiB = 1 << 20;
export const T0 = 1_700_000_000_000;

/** The README's worked example: one MoE layer of 4 experts, 1 MiB each. */
export const EXAMPLE: MarketModel = { id: "ex", layers: [{ layer: 0, nExpert: 4, bytesPerExpert: MiB }] };

export function counter(): () => string {
  let i = 0;
  return () => `lease-${++i}`;
}

export function market(options: ConstructorParameters<typeof CoverageMarket>[0] = {}) {
  return new CoverageMarket({ newId: counter(), ...options });
}

export const cap = (bytes: number) => ({ ramBytes: bytes });
