import type { ChildProcess } from "node:child_process";

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
