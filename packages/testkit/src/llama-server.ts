// A llama-server process for tests and benchmarks: spawned on a free port, ready once /health says
// so, its output kept for the assertions about what it logs.
import { type ChildProcess, spawn } from "node:child_process";
import { createServer } from "node:net";

export interface LlamaServerProcess extends AsyncDisposable {
  /** http://127.0.0.1:<port> */
  readonly url: string;
  readonly process: ChildProcess;
  /** Everything it wrote to stdout and stderr so far. */
  output(): string;
  /** Whether it exited (and its exit code, or the signal's name). */
  exited(): { code: number | string } | undefined;
  close(): Promise<void>;
}

/** A TCP port nobody listens on at the moment. */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const s = createServer();
    s.once("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address() as { port: number };
      s.close(() => resolve(port));
    });
  });
}

/**
 * Starts `bin` with `args` plus `--host 127.0.0.1 --port <free>` and waits until GET /health answers
 * 200 (the model loaded), or rejects with its output when it exits first or `timeoutMs` passes.
 */
export async function startLlamaServer(
  bin: string,
  args: readonly string[],
  o: { env?: NodeJS.ProcessEnv; timeoutMs?: number } = {},
): Promise<LlamaServerProcess> {
  const port = await freePort();
  const child = spawn(bin, [...args, "--host", "127.0.0.1", "--port", String(port)], {
    env: { ...process.env, ...o.env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let text = "";
  child.stdout?.on("data", (d: Buffer) => {
    text += d.toString();
  });
  child.stderr?.on("data", (d: Buffer) => {
    text += d.toString();
  });
  let exit: { code: number | string } | undefined;
  const gone = new Promise<void>((resolve) => {
    child.once("exit", (code, signal) => {
      exit = { code: code ?? signal ?? "?" };
      resolve();
    });
  });
  const url = `http://127.0.0.1:${port}`;
  const close = async () => {
    if (!exit) child.kill("SIGTERM");
    const timer = setTimeout(() => child.kill("SIGKILL"), 5000);
    await gone;
    clearTimeout(timer);
  };
  const deadline = Date.now() + (o.timeoutMs ?? 120_000);
  for (;;) {
    if (exit)
      throw new Error(`llama-server exited (${exit.code}) before it was ready:\n${text.slice(-4000)}`);
    if (Date.now() > deadline) {
      await close();
      throw new Error(
        `llama-server was not ready within ${o.timeoutMs ?? 120_000} ms:\n${text.slice(-4000)}`,
      );
    }
    const ok = await fetch(`${url}/health`)
      .then((r) => r.status === 200)
      .catch(() => false);
    if (ok) break;
    await new Promise((r) => setTimeout(r, 200));
  }
  return {
    url,
    process: child,
    output: () => text,
    exited: () => exit,
    close,
    [Symbol.asyncDispose]: close,
  };
}
