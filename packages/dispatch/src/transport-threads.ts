import { parentPort, Worker } from "node:worker_threads";
import type {
  ExpertCallOptions,
  ExpertHandler,
  ExpertRequest,
  ExpertResult,
  ExpertTransport,
} from "@moeswarm/core";
import {
  abortReason,
  DispatchError,
  InvalidArgumentError,
  isMoeswarmError,
  onAbort,
  TransportError,
} from "@moeswarm/core";

// Messages between the transport and its threads. Tensors travel as transferred ArrayBuffers.
type ToThread = { t: "req"; id: number; req: ExpertRequest } | { t: "cancel"; id: number };
type FromThread =
  | { t: "res"; id: number; res: ExpertResult }
  | { t: "err"; id: number; message: string; code?: string };

/** A worker thread: a module that calls {@link serveExpertThread}. */
export interface ThreadWorkerSpec {
  readonly script: string | URL;
  /** Passed as `workerData` (structured clone). */
  readonly workerData?: unknown;
}

/** Transferable whole-buffer copy of a view (a view of part of a buffer is copied first). */
function own<T extends Float32Array | Float64Array | Int32Array | Uint8Array>(a: T): T {
  if (a.byteOffset === 0 && a.byteLength === a.buffer.byteLength && a.buffer instanceof ArrayBuffer) return a;
  // not a Buffer's slice(): it is a view, and transferring its buffer would take the caller's whole buffer
  return (a instanceof Uint8Array ? new Uint8Array(a) : a.slice()) as T;
}

interface Pending {
  resolve(r: ExpertResult): void;
  reject(e: unknown): void;
}

class ThreadPeer {
  readonly worker: Worker;
  readonly pending = new Map<number, Pending>();
  closed: TransportError | undefined;

  constructor(
    readonly id: string,
    spec: ThreadWorkerSpec,
  ) {
    this.worker = new Worker(spec.script, { workerData: spec.workerData });
    this.worker.unref();
    this.worker.on("message", (msg: FromThread) => this.#onMessage(msg));
    this.worker.on("error", (err) => this.#fail(err));
    this.worker.on("exit", (code) => this.#fail(new Error(`worker thread exited with code ${code}`)));
  }

  #onMessage(msg: FromThread): void {
    const p = this.pending.get(msg?.id);
    if (!p) return; // cancelled or already settled: a late reply is dropped
    this.#settled(msg.id);
    if (msg.t === "res") p.resolve(msg.res);
    else {
      p.reject(
        new DispatchError(`worker thread ${this.id}: ${msg.message}`, {
          details: { worker: this.id, remoteCode: msg.code },
        }),
      );
    }
  }

  #settled(id: number): void {
    this.pending.delete(id);
    if (this.pending.size === 0) this.worker.unref();
  }

  #fail(cause: unknown): void {
    if (this.closed) return;
    this.closed = new TransportError("MOESWARM_TRANSPORT_CLOSED", `worker thread ${this.id} is gone`, {
      cause,
      details: { peer: this.id },
    });
    for (const p of this.pending.values()) p.reject(this.closed);
    this.pending.clear();
  }

  send(id: number, request: ExpertRequest, pending: Pending): void {
    const req: ExpertRequest = {
      ...request,
      x: own(request.x),
      ids: own(request.ids),
      ...(request.w ? { w: own(request.w) } : {}),
    };
    const transfer = [req.x.buffer, req.ids.buffer, ...(req.w ? [req.w.buffer] : [])] as ArrayBuffer[];
    this.pending.set(id, pending);
    this.worker.ref();
    this.worker.postMessage({ t: "req", id, req } satisfies ToThread, transfer);
  }

  cancel(id: number): void {
    if (!this.pending.has(id)) return;
    this.#settled(id);
    if (!this.closed) this.worker.postMessage({ t: "cancel", id } satisfies ToThread);
  }

  async close(): Promise<void> {
    this.#fail(new Error("transport closed"));
    await this.worker.terminate();
  }
}

/**
 * Workers in `worker_threads`, one thread per worker id, each running a module that calls
 * {@link serveExpertThread}. Request and result tensors are transferred, not copied (a request
 * array that views part of a larger buffer is copied first). Close it (or `await using`) to
 * terminate the threads.
 */
export class WorkerThreadTransport implements ExpertTransport, AsyncDisposable {
  /** The threads run scripts of this process: nothing to verify. */
  readonly trusted = true;
  readonly #peers = new Map<string, ThreadPeer>();
  #nextId = 1;
  #closed = false;

  constructor(workers: Record<string, string | URL | ThreadWorkerSpec>) {
    if (typeof workers !== "object" || workers === null) {
      throw new InvalidArgumentError("WorkerThreadTransport: workers must be an object");
    }
    for (const [id, spec] of Object.entries(workers)) {
      const s: ThreadWorkerSpec = typeof spec === "string" || spec instanceof URL ? { script: spec } : spec;
      this.#peers.set(id, new ThreadPeer(id, s));
    }
  }

  request(owner: string, request: ExpertRequest, options: ExpertCallOptions): Promise<ExpertResult> {
    const { signal } = options;
    if (signal.aborted) return Promise.reject(abortReason(signal));
    const peer = this.#peers.get(owner);
    if (this.#closed)
      return Promise.reject(new TransportError("MOESWARM_TRANSPORT_CLOSED", "transport is closed"));
    if (!peer) {
      return Promise.reject(
        new TransportError("MOESWARM_TRANSPORT_UNKNOWN_PEER", `no worker thread ${JSON.stringify(owner)}`, {
          details: { peer: owner },
        }),
      );
    }
    if (peer.closed) return Promise.reject(peer.closed);
    const id = this.#nextId;
    this.#nextId = (this.#nextId % 0xffff_fffe) + 1;
    return new Promise<ExpertResult>((resolve, reject) => {
      const aborted = onAbort(signal, (reason) => {
        peer.cancel(id);
        reject(reason);
      });
      const cleanup = () => aborted[Symbol.dispose]();
      try {
        peer.send(id, request, {
          resolve: (r) => {
            cleanup();
            resolve(r);
          },
          reject: (e) => {
            cleanup();
            reject(e);
          },
        });
      } catch (error) {
        cleanup();
        peer.cancel(id);
        reject(error);
      }
    });
  }

  /** Terminates every thread; outstanding requests reject with MOESWARM_TRANSPORT_CLOSED. */
  async close(): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    await Promise.all([...this.#peers.values()].map((p) => p.close()));
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await this.close();
  }
}

/**
 * Runs inside a worker thread started by {@link WorkerThreadTransport}: answers each request
 * with `compute`, transferring the result tensor back. Throws when not in a worker thread.
 */
export function serveExpertThread(compute: ExpertHandler): void {
  const port = parentPort;
  if (!port) {
    throw new InvalidArgumentError("serveExpertThread must run inside a worker thread");
  }
  const running = new Map<number, AbortController>();
  port.on("message", (msg: ToThread) => {
    if (msg?.t === "cancel") {
      running.get(msg.id)?.abort();
      running.delete(msg.id);
      return;
    }
    if (msg?.t !== "req") return;
    const controller = new AbortController();
    running.set(msg.id, controller);
    let pending: Promise<ExpertResult>;
    try {
      pending = Promise.resolve(compute(msg.req, { signal: controller.signal }));
    } catch (error) {
      pending = Promise.reject(error);
    }
    pending.then(
      (res) => {
        if (!running.delete(msg.id)) return;
        // a malformed result travels as is (structured clone) for the dispatcher to reject
        const y = res?.y instanceof Float32Array || res?.y instanceof Float64Array ? own(res.y) : undefined;
        try {
          port.postMessage(
            { t: "res", id: msg.id, res: y ? { ...res, y } : res } satisfies FromThread,
            y ? [y.buffer as ArrayBuffer] : [],
          );
        } catch (error) {
          port.postMessage({
            t: "err",
            id: msg.id,
            message: `result not transferable: ${String(error)}`,
          } satisfies FromThread);
        }
      },
      (error: unknown) => {
        if (!running.delete(msg.id)) return;
        port.postMessage({
          t: "err",
          id: msg.id,
          message: error instanceof Error ? error.message : String(error),
          ...(isMoeswarmError(error) ? { code: error.code } : {}),
        } satisfies FromThread);
      },
    );
  });
}
