// Shared by the relay-client tests: a WebSocket dialer that records what each send is given (the
// frame-writer and respondInto tests), and the direct-link tests' fallback transport and request.
import type { ExpertRequest, ExpertResult, ExpertTransport } from "@moeswarm/core";
import { dialWebSocket, type FrameDialer } from "../src/index.js";

/**
 * The WebSocket dialer, recording the bytes each send is given; with `callsSent` false the link
 * says nothing of when it is done with them (a link that keeps its bytes).
 */
export function recordingDialer(sent: Uint8Array[], callsSent: boolean): FrameDialer {
  return async (url, options) => {
    const link = await dialWebSocket(url, options);
    return {
      callsSent,
      get bufferedBytes() {
        return link.bufferedBytes;
      },
      send(bytes, done) {
        sent.push(bytes);
        link.send(bytes, callsSent ? done : undefined);
      },
      close: (code, reason) => link.close(code, reason),
      destroy: () => link.destroy(),
    };
  };
}

/** A fallback that answers `fill` in every slot (so a test can tell which path answered) and counts. */
export class Fallback implements ExpertTransport {
  readonly calls: string[] = [];
  constructor(private readonly fill = 0) {}
  async request(owner: string, req: ExpertRequest): Promise<ExpertResult> {
    this.calls.push(owner);
    return {
      mode: req.mode,
      n: req.n,
      k: req.k,
      embd: req.embd,
      y: new Float32Array(req.n * req.k * req.embd).fill(this.fill),
    };
  }
}

/** Two tokens of 4 values, top-2 of experts 0..3 (model "m", layer 1, "each"): x[i] = xOf(i). */
export const smallRequest = (xOf: (i: number) => number): ExpertRequest => ({
  model: "m",
  layer: 1,
  n: 2,
  embd: 4,
  k: 2,
  dtype: "f32",
  x: Float32Array.from({ length: 8 }, (_, i) => xOf(i)),
  ids: Int32Array.from([0, 1, 2, 3]),
  mode: "each",
});
