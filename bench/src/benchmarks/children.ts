import { type ChildProcess, fork } from "node:child_process";

/**
 * Forks a benchmark child (`file`, with this process's tsx loader; `args` as its one argument) and
 * waits for its first message, what it listens on.
 */
export function spawnPeer(
  file: string,
  args: { mode: string; [more: string]: unknown },
): Promise<{ child: ChildProcess; info: Record<string, string> }> {
  const child = fork(file, [JSON.stringify(args)], { execArgv: process.execArgv, stdio: "inherit" });
  return new Promise((resolve, reject) => {
    child.once("message", (info) => resolve({ child, info: info as Record<string, string> }));
    child.once("exit", (code) => reject(new Error(`${file} exited with ${code}`)));
  });
}

/**
 * Asks each forked benchmark process to stop ("stop" over IPC) and waits for it to exit; one that
 * has not exited after 3 s is killed, so a hung child cannot hold the bench run open.
 */
export function stopChildren(children: readonly ChildProcess[]): Promise<void> {
  return Promise.all(
    children.map(
      (child) =>
        new Promise<void>((resolve) => {
          if (child.exitCode !== null) return resolve();
          const kill = setTimeout(() => child.kill("SIGKILL"), 3000);
          child.once("exit", () => {
            clearTimeout(kill);
            resolve();
          });
          child.send("stop");
        }),
    ),
  ).then(() => undefined);
}

/**
 * In a benchmark child: "cpu" from the parent is answered with this process's CPU time so far
 * (user + system, microseconds; `cpuTime` asks for it), any other message runs `stop`.
 */
export function onParentMessage(stop: () => unknown): void {
  process.on("message", (message) => {
    if (message === "cpu") {
      const { user, system } = process.cpuUsage();
      process.send?.({ cpuUs: user + system });
      return;
    }
    void stop();
  });
}

/** A child's CPU time so far in microseconds (the child listens with `onParentMessage`). */
export function cpuTime(child: ChildProcess): Promise<number> {
  return new Promise((resolve, reject) => {
    const onMessage = (message: unknown) => {
      const cpuUs = (message as { cpuUs?: unknown } | null)?.cpuUs;
      if (typeof cpuUs !== "number") return;
      child.off("message", onMessage);
      child.off("exit", onExit);
      resolve(cpuUs);
    };
    const onExit = () => {
      child.off("message", onMessage);
      reject(new Error("a benchmark child exited while asked for its CPU time"));
    };
    child.on("message", onMessage);
    child.once("exit", onExit);
    child.send("cpu");
  });
}
