import { setFlagsFromString } from "node:v8";

// A process that receives large frames at a high rate (a hub's relay, a worker, a backbone at 64
// tokens: 772 KB WebSocket messages, each a fresh ArrayBuffer from `ws`) allocates little
// JavaScript but much external memory. After some thousands of frames V8 then starts marking the
// old generation at every allocation-limit check: the old generation's limit (about 2.4x a 16 MB
// live heap) leaves less room than the young generation has grown to, so a full collection follows
// every few frames. Measured at 64 tokens (bench/src/benchmarks/roundtrip.ts, "soak" rows): the
// relay's CPU per round trip went from 0.7-1 ms to 2.5-4.5 ms after 1000-5000 round trips, a
// worker's from 0.45 to 1.5-2.2 ms after 6000. A fixed growing factor of 4 (V8's own upper bound)
// keeps the limit above that: the same processes stayed at 0.7-0.9 ms (relay) over 12000 round
// trips. node's --min-semi-space-size only delayed it (to ~4000 round trips) and can only be set on
// the command line; this flag is read whenever V8 sizes the heap, so it works set at run time.

/** The V8 flag `tuneHeapForFrames` sets. */
export const FRAME_HEAP_FLAG = "--heap-growing-percent=300";

/**
 * Sizes V8's old generation for a process that receives large frames at a high rate (see above):
 * the heap may grow to 4x what is live before a full collection. Process-wide; call it once at
 * start-up, as the moeswarm-hub, moeswarm-worker and moeswarm-dispatcher executables do. Embedders
 * that run a relay, worker or backbone in their own process decide for themselves.
 */
export function tuneHeapForFrames(): void {
  setFlagsFromString(FRAME_HEAP_FLAG);
}
