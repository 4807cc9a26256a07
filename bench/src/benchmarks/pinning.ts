// Pinning a benchmark's processes to CPUs for one measurement (util-linux `taskset`, Linux). On a
// 2-CPU machine a 3-process chain is moved between the CPUs by the scheduler, and each move costs
// a process its caches: measured in the roundtrip bench, a relay's CPU per round trip was 55-70%
// higher unpinned than with the relay on a CPU of its own, and more so for a relay that touches
// more code per frame. Pinned, the ratios show the work each chain does with that noise removed.
import { spawnSync } from "node:child_process";
import { availableParallelism } from "node:os";

export interface Pinner {
  /** Pins every thread of `pid` to `cpu`. */
  pin(pid: number, cpu: number): void;
  /** Lets every thread of `pid` run on any CPU again. */
  unpin(pid: number): void;
}

/** A pinner, or why there is none here (no taskset, one CPU, not Linux). */
export function pinner(): Pinner | string {
  const cpus = availableParallelism();
  if (process.platform !== "linux") return "not Linux";
  if (cpus < 2) return "one CPU";
  const taskset = (cpuList: string, pid: number) => {
    const out = spawnSync("taskset", ["-a", "-p", "-c", cpuList, String(pid)], { encoding: "utf8" });
    if (out.error || out.status !== 0) throw new Error(`taskset failed: ${out.error?.message ?? out.stderr}`);
  };
  if (spawnSync("taskset", ["-p", String(process.pid)]).status !== 0) return "no taskset (util-linux)";
  return {
    pin: (pid, cpu) => taskset(String(cpu), pid),
    unpin: (pid) => taskset(`0-${cpus - 1}`, pid),
  };
}
