// The README's main command, end to end on the tiny model: a hub, two worker processes that cover
// the model by themselves, llama.cpp plain and with the swarm. The verdict is the exit code.
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";

const main = join(import.meta.dirname, "..", "src", "main.ts");
const tsx = join(import.meta.dirname, "..", "node_modules", ".bin", "tsx");

function demo(args: string[]) {
  const cacheDir = mkdtempSync(join(tmpdir(), "moeswarm-demo-test-"));
  try {
    return spawnSync(tsx, [main, "--cache-dir", cacheDir, "--fresh", ...args], {
      encoding: "utf8",
      timeout: 180_000,
    });
  } finally {
    rmSync(cacheDir, { recursive: true, force: true });
  }
}

describe("local-swarm demo", () => {
  it("decodes identically with the swarm and exits 0", () => {
    const r = demo(["--preset", "tiny", "--tokens", "12", "--workers", "2"]);
    expect(r.status, `${r.stdout}\n${r.stderr}`).toBe(0);
    expect(r.stdout).toMatch(/^OK +12\/12 tokens identical to the local run; logits bit-identical/m);
    // the generated text reads as words (the synthetic models carry a small language model)
    expect(r.stdout).toMatch(/^plain {5}\.\.\.[ ,.]*[A-Za-z]+ [A-Za-z]+/m);
    expect(r.stdout).not.toContain("\uFFFD");
    // both workers claimed, downloaded, verified and served their own part
    for (const w of ["worker-0", "worker-1"]) {
      expect(r.stdout).toMatch(new RegExp(`\\[${w}\\] downloaded`));
      expect(r.stdout).toMatch(new RegExp(`\\[${w}\\] verified`));
      expect(r.stdout).toMatch(new RegExp(`\\[${w}\\] serving`));
      // one slice or several ("layers 0:2 experts 0:5 + layer 1 experts 5:8")
      const slice = "layers? \\d+(:\\d+)? experts \\d+:\\d+";
      expect(r.stdout).toMatch(
        new RegExp(`^  ${w} +${slice}( \\+ ${slice})*, downloaded .*computed [1-9]\\d* expert-tokens`, "m"),
      );
    }
    // no failover and no fallback: the only local computes are the audits, counted apart, as many
    // as the verification's own count of audited parts
    const m = /(\d+) failovers, (\d+) local fallbacks, (\d+) local audits/.exec(r.stdout);
    const audited = Number(/^ {2}audit +(\d+) agreed parts re-computed/m.exec(r.stdout)?.[1]);
    expect(audited).toBeGreaterThan(0);
    expect(m?.slice(1).map(Number)).toEqual([0, 0, audited]);
    // every answer was checked against a second worker's (the hub places two copies by default)
    expect(r.stdout).toMatch(
      /^ {2}verify +[1-9]\d* parts answered by two workers and compared, 0 disagreements/m,
    );
  });

  it("--liar: one more worker lies (outputs x1.05); it is caught and named, and every token and logit stays right", () => {
    const r = demo(["--preset", "tiny", "--tokens", "12", "--workers", "2", "--liar"]);
    expect(r.status, `${r.stdout}\n${r.stderr}`).toBe(0);
    expect(r.stdout).toMatch(/^OK +12\/12 tokens identical to the local run; logits bit-identical/m);
    expect(r.stdout).toMatch(
      /^ {2}verify +[1-9]\d* parts answered by two workers and compared, [1-9]\d* disagreements/m,
    );
    expect(r.stdout).toMatch(/^ {2}caught +liar quarantined/m);
  });

  it("--trust own: the workers hold whole layers (one copy) and the plugin sends them their splits natively", () => {
    const r = demo(["--preset", "tiny", "--tokens", "12", "--workers", "2", "--trust", "own"]);
    expect(r.status, `${r.stdout}\n${r.stderr}`).toBe(0);
    expect(r.stdout).toMatch(/^OK +12\/12 tokens identical to the local run; logits bit-identical/m);
    const m =
      /^ {2}native +(\d+) of (\d+) splits went straight to a worker \((\d+) layers? in the table\), (\d+) fell back/m.exec(
        r.stdout,
      );
    expect(m, r.stdout).not.toBeNull();
    const [native, total, , fellBack] = m!.slice(1).map(Number) as [number, number, number, number];
    // every split, but the first may come before the plugin has read its table
    expect(native).toBeGreaterThan(0);
    expect(total - native).toBeLessThanOrEqual(1);
    expect(fellBack).toBe(0);
    expect(r.stdout).toMatch(/ms round trip, \d+\.\d+ ms above the worker's compute/);
  });

  it("rejects a bad option with a clear message and a non-zero exit", () => {
    const r = demo(["--workers", "zero"]);
    expect(r.status).not.toBe(0);
    expect(r.status).toBe(2);
    expect(r.stderr).toMatch(/^demo: --workers must be an integer in 1..16/m);
    expect(r.stderr).not.toMatch(/\n {4}at /); // a message, not a stack trace
  });
});
