// Driving the executable at the byte level: raw frames in (any msgpack, valid or not), decoded
// frames out, as a peer on its stdin/stdout or TCP socket sees them.
import { type ChildProcessWithoutNullStreams, spawn } from "node:child_process";
import { readFileSync } from "node:fs";
import type { Readable, Writable } from "node:stream";
import { fileURLToPath } from "node:url";
import { decodeFrame, type Frame, readFrames } from "@moeswarm/core";
import { encode } from "@msgpack/msgpack";

export function prefixed(payload: Uint8Array): Uint8Array {
  const out = new Uint8Array(4 + payload.length);
  new DataView(out.buffer).setUint32(0, payload.length, true);
  out.set(payload, 4);
  return out;
}

/** Any value as msgpack (an independent encoder: @msgpack/msgpack), length-prefixed. */
export function rawFrame(value: unknown): Uint8Array {
  return prefixed(encode(value, { forceFloat32: false, ignoreUndefined: true }));
}

export interface Received {
  bytes: Uint8Array;
  frame: Frame;
}

/** A peer of the executable: write raw bytes, await the next frames. */
export class Peer {
  readonly received: Received[] = [];
  #waiters: Array<() => void> = [];
  #ended = false;
  readonly done: Promise<void>;

  constructor(
    readonly input: Writable,
    output: Readable,
  ) {
    this.done = (async () => {
      try {
        for await (const payload of readFrames(output)) {
          const bytes = Uint8Array.from(payload);
          this.received.push({ bytes, frame: decodeFrame(bytes, { copy: true }) });
          for (const w of this.#waiters.splice(0)) w();
        }
      } catch {
        // a truncated stream from a process that was killed: the tests look at what arrived
      } finally {
        this.#ended = true;
        for (const w of this.#waiters.splice(0)) w();
      }
    })();
  }

  /** True once the stream has ended. */
  get ended(): boolean {
    return this.#ended;
  }

  write(bytes: Uint8Array): void {
    this.input.write(bytes);
  }

  /** Waits until `count` frames have arrived in total (or the stream ended). */
  async frames(count: number, timeoutMs = 20_000): Promise<Received[]> {
    const deadline = Date.now() + timeoutMs;
    while (this.received.length < count && !this.#ended) {
      if (Date.now() > deadline)
        throw new Error(`timed out waiting for frame ${count} (have ${this.received.length})`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, 200);
        this.#waiters.push(() => {
          clearTimeout(t);
          resolve();
        });
      });
    }
    return this.received.slice(0, count);
  }
}

export interface WorkerProcess {
  child: ChildProcessWithoutNullStreams;
  peer: Peer;
  exit: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  stderr(): string;
}

export function startWorker(binary: string, args: string[], launcher?: string): WorkerProcess {
  const [cmd, cmdArgs] = launcher ? [launcher, [binary, ...args]] : [binary, args];
  const child = spawn(cmd, cmdArgs, { stdio: ["pipe", "pipe", "pipe"] });
  let err = "";
  child.stderr.on("data", (d: Buffer) => {
    err += d.toString();
  });
  child.stdin.on("error", () => {});
  const exit = new Promise<{ code: number | null; signal: NodeJS.Signals | null }>((resolve) =>
    child.once("close", (code, signal) => resolve({ code, signal })),
  );
  return { child, peer: new Peer(child.stdin, child.stdout), exit, stderr: () => err };
}

/** The hex test vectors of docs/protocol.md, by name. */
export function protocolVectors(): Map<string, Uint8Array> {
  const doc = readFileSync(fileURLToPath(new URL("../../../docs/protocol.md", import.meta.url)), "utf8");
  const out = new Map<string, Uint8Array>();
  const re = /### Vector `([^`]+)`[\s\S]*?```hex\n([\s\S]*?)```/g;
  for (const m of doc.matchAll(re)) {
    const hex = m[2]!.replace(/\s+/g, "");
    out.set(m[1]!, Uint8Array.from(hex.match(/../g)!.map((h) => Number.parseInt(h, 16))));
  }
  return out;
}
