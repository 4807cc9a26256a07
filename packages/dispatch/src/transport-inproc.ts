import type {
  ExpertCallOptions,
  ExpertHandler,
  ExpertRequest,
  ExpertResult,
  ExpertTransport,
} from "@moeswarm/core";
import { abortable, abortReason, InvalidArgumentError, TransportError } from "@moeswarm/core";

/**
 * Workers as functions in this process: `request(owner, ...)` calls the owner's compute. Nothing
 * is copied, so a compute must not modify the request's arrays. Rejects promptly when the signal
 * aborts, even if the compute keeps running.
 */
export class InProcessTransport implements ExpertTransport {
  /** The workers are functions of this process: nothing to verify. */
  readonly trusted = true;
  readonly #workers = new Map<string, ExpertHandler>();

  constructor(workers: Record<string, ExpertHandler> | Iterable<readonly [string, ExpertHandler]> = {}) {
    const entries =
      Symbol.iterator in Object(workers)
        ? (workers as Iterable<readonly [string, ExpertHandler]>)
        : Object.entries(workers as Record<string, ExpertHandler>);
    for (const [id, compute] of entries) this.set(id, compute);
  }

  /** Adds or replaces a worker. */
  set(id: string, compute: ExpertHandler): this {
    if (typeof compute !== "function") {
      throw new InvalidArgumentError(`InProcessTransport: worker ${id} is not a function`);
    }
    this.#workers.set(id, compute);
    return this;
  }

  delete(id: string): boolean {
    return this.#workers.delete(id);
  }

  has(id: string): boolean {
    return this.#workers.has(id);
  }

  request(owner: string, request: ExpertRequest, options: ExpertCallOptions): Promise<ExpertResult> {
    const { signal } = options;
    if (signal.aborted) return Promise.reject(abortReason(signal));
    const compute = this.#workers.get(owner);
    if (!compute) {
      return Promise.reject(
        new TransportError(
          "MOESWARM_TRANSPORT_UNKNOWN_PEER",
          `no in-process worker ${JSON.stringify(owner)}`,
          {
            details: { peer: owner },
          },
        ),
      );
    }
    let pending: Promise<ExpertResult>;
    try {
      pending = Promise.resolve(compute(request, { signal }));
    } catch (error) {
      pending = Promise.reject(error);
    }
    // settles at the abort even if the compute keeps running
    return abortable(pending, signal);
  }
}
