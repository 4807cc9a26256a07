import { statfsSync } from "node:fs";
import { availableParallelism, freemem, totalmem } from "node:os";
import { dirname } from "node:path";

// What a participant offers when its owner does not say: a desktop gives half its free memory and
// all its cores; a phone (Android: Termux's Node reports platform "android") is also someone's
// phone, so it keeps most of its memory, its little cores and its storage for its owner.

export interface HostFacts {
  platform: NodeJS.Platform;
  env: NodeJS.ProcessEnv;
  freeBytes: number;
  totalBytes: number;
  cpus: number;
  /** Free bytes of the file system the cache lives on (undefined when unknown). */
  diskFreeBytes?: number | undefined;
}

export interface WorkerDefaults {
  phone: boolean;
  ramBytes: number;
  /** undefined: all CPUs. */
  threads: number | undefined;
  /** undefined: no limit. */
  cacheMaxBytes: number | undefined;
}

/** Android, or Termux on anything (its environment names its prefix). */
export function isPhone(facts: Pick<HostFacts, "platform" | "env">): boolean {
  return facts.platform === "android" || facts.env.TERMUX_VERSION !== undefined;
}

/** Phone cores worth computing on: big.LITTLE phones have 2-4 big cores out of 8. */
export const PHONE_THREADS = 4;

/**
 * Defaults from the host's facts: RAM half the free memory (a phone: also at most a quarter of the
 * total, Android kills apps long before free memory is gone); threads all (a phone: at most
 * {@link PHONE_THREADS}, the big cores, so it stays cool and usable); the cache unbounded (a phone:
 * half the free storage).
 */
export function workerDefaults(facts: HostFacts): WorkerDefaults {
  const phone = isPhone(facts);
  const half = Math.floor(facts.freeBytes / 2);
  if (!phone) return { phone, ramBytes: half, threads: undefined, cacheMaxBytes: undefined };
  return {
    phone,
    ramBytes: Math.min(half, Math.floor(facts.totalBytes / 4)),
    threads: Math.max(1, Math.min(PHONE_THREADS, facts.cpus)),
    cacheMaxBytes: facts.diskFreeBytes !== undefined ? Math.floor(facts.diskFreeBytes / 2) : undefined,
  };
}

/** Free bytes of the file system holding `dir` (or its nearest existing parent). */
function diskFree(dir: string): number | undefined {
  for (let d = dir, i = 0; i < 32; i++) {
    try {
      const s = statfsSync(d);
      return Number(s.bavail) * Number(s.bsize);
    } catch {
      const up = dirname(d);
      if (up === d) return undefined;
      d = up;
    }
  }
  return undefined;
}

/** This host's facts. */
export function hostFacts(env: NodeJS.ProcessEnv, cacheDir: string): HostFacts {
  return {
    platform: process.platform,
    env,
    freeBytes: freemem(),
    totalBytes: totalmem(),
    cpus: availableParallelism(),
    diskFreeBytes: diskFree(cacheDir),
  };
}
