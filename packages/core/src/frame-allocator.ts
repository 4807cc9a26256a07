// glibc's malloc, left to its defaults, costs a process that receives large frames at a high rate
// (a hub's relay, a worker, a backbone at 64 tokens: 772 KB WebSocket messages, each a fresh
// ArrayBuffer from `ws`) page faults by the thousand. After the first large block is freed, glibc
// serves such blocks from its heap and gives the heap's top back to the kernel whenever more than
// twice that block lies free there; the next frames grow the heap again and fault every page back
// in, zeroed. Measured at 64 tokens over a ws:// relay on a 2-core machine: in a loop of 1000-trip
// windows, windows alternated between the steady cost and 1.5-3x it, a process's minor page faults
// per round trip rising from ~0 to 30-65 with its CPU; with the tunables below every process stayed
// at 0-1 faults per round trip and at its steady cost. In `pnpm bench roundtrip`'s soak rows (CPU
// per round trip, backbone / relay / worker): 499-523 / 713-763 / 453-472 us with them, 533-567 /
// 848-913 / 519-1245 without (three runs). The knobs must be set together: a trim threshold alone
// also fixes the mmap threshold at 128 KB, so every frame is mapped and unmapped (a worker went to
// 6.4 ms per round trip, 387 faults each).
//
// glibc reads its tunables once, before any JavaScript runs: they can only be given to a process
// in its environment, by whatever starts it (a service manager, a container, a launcher).

/**
 * The glibc malloc tunables for a process that moves large frames: memory is taken from the kernel
 * 64 MiB at a time, kept unless over 256 MiB lies free at the heap's top, and blocks up to 32 MiB
 * (glibc's limit for this knob) come from the heap instead of a mapping of their own.
 */
export const FRAME_MALLOC_TUNABLES: Readonly<Record<string, number>> = {
  "glibc.malloc.top_pad": 64 * 1024 * 1024,
  "glibc.malloc.trim_threshold": 256 * 1024 * 1024,
  "glibc.malloc.mmap_threshold": 32 * 1024 * 1024,
};

/**
 * `env` (default: this process's) with FRAME_MALLOC_TUNABLES added to `GLIBC_TUNABLES`, for a
 * child process that moves large frames (a worker, a hub, a dispatcher) to start with. Tunables the
 * environment already sets are kept as they are, ours only added where a key is missing. A copy;
 * `env` is not changed. Harmless where the C library is not glibc (nothing reads the variable).
 */
export function frameAllocatorEnv(env: NodeJS.ProcessEnv = process.env): NodeJS.ProcessEnv {
  const given = (env.GLIBC_TUNABLES ?? "").split(":").filter((entry) => entry !== "");
  const keys = new Set(given.map((entry) => entry.split("=")[0]));
  const added = Object.entries(FRAME_MALLOC_TUNABLES)
    .filter(([key]) => !keys.has(key))
    .map(([key, value]) => `${key}=${value}`);
  return { ...env, GLIBC_TUNABLES: [...given, ...added].join(":") };
}

/** Whether `env` gives every key of FRAME_MALLOC_TUNABLES (any value: an operator's choice stands). */
export function hasFrameAllocatorEnv(env: NodeJS.ProcessEnv = process.env): boolean {
  const keys = new Set((env.GLIBC_TUNABLES ?? "").split(":").map((entry) => entry.split("=")[0]));
  return Object.keys(FRAME_MALLOC_TUNABLES).every((key) => keys.has(key));
}

/**
 * What a process that moves large frames runs with: "tuned" (its environment gives every key of
 * FRAME_MALLOC_TUNABLES), "glibc defaults", or "not glibc" (another C library, or none known;
 * nothing to tune).
 */
export type FrameAllocatorState = "tuned" | "glibc defaults" | "not glibc";

/**
 * The FrameAllocatorState of a process started with `env` (default: this one's). `glibc`: whether
 * the C library is glibc (default: asked of Node's report, about 5 ms: once at start-up).
 */
export function frameAllocatorState(
  env: NodeJS.ProcessEnv = process.env,
  glibc: boolean = runsOnGlibc(),
): FrameAllocatorState {
  if (!glibc) return "not glibc";
  return hasFrameAllocatorEnv(env) ? "tuned" : "glibc defaults";
}

function runsOnGlibc(): boolean {
  if (process.platform !== "linux") return false;
  const report = process.report as unknown as {
    excludeNetwork?: boolean;
    getReport(): { header?: { glibcVersionRuntime?: unknown } };
  };
  // no network lookups in the report (they can take seconds); the process's own setting is restored
  const excluded = report.excludeNetwork;
  report.excludeNetwork = true;
  try {
    return typeof report.getReport().header?.glibcVersionRuntime === "string";
  } finally {
    report.excludeNetwork = excluded;
  }
}

/**
 * What an executable that moves large frames tells people at start-up about its malloc, for a
 * line of its own; undefined when there is nothing to say ("tuned", or no glibc to tune).
 */
export function frameAllocatorAdvice(state: FrameAllocatorState): string | undefined {
  if (state !== "glibc defaults") return undefined;
  const tunables = frameAllocatorEnv({}).GLIBC_TUNABLES;
  return `glibc's malloc runs with its defaults, which cost 10-40% more CPU per 64-token frame, at times 1.5-3x: start this process with GLIBC_TUNABLES=${tunables} (docs/deploy.md, "Memory allocator", in the moeswarm repository)`;
}
