import { PassThrough } from "node:stream";

/** What `captureStream` returns: the stream to hand a CLI, and what was written to it. */
export interface CapturedStream {
  readonly stream: PassThrough;
  /** Everything written so far. */
  text(): string;
  /** Resolves with the first line written (now or later) that matches. */
  line(match: RegExp): Promise<string>;
}

/**
 * A writable stream that keeps its text, for a CLI's injectable stdout/stderr (the backbone's
 * dispatcher, the hub's CLI): tests read what it printed, or wait for a line that matches.
 */
export function captureStream(): CapturedStream {
  const stream = new PassThrough();
  let text = "";
  const waiters: (() => void)[] = [];
  stream.on("data", (d: Buffer) => {
    text += d.toString();
    for (const w of waiters.splice(0)) w();
  });
  return {
    stream,
    text: () => text,
    async line(match: RegExp): Promise<string> {
      for (;;) {
        const hit = text.split("\n").find((l) => match.test(l));
        if (hit) return hit;
        await new Promise<void>((r) => waiters.push(r));
      }
    },
  };
}
