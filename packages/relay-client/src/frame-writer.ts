import type { FrameLink } from "./link.js";
import { type EncodableFrame, encodeFrame, FrameEncoder } from "./wire.js";

/**
 * Encoders kept for reuse. A decode step sends one frame on a link and waits for its answer, so
 * one encoder is back before the next frame; each keeps the memory of its largest frame (a
 * prompt's can be megabytes), so keeping more would mostly hold memory. A layer's fan-out over
 * one relay link takes more at once: those beyond two get fresh memory, as every frame did
 * before.
 */
const KEPT_ENCODERS = 2;

/**
 * Encodes the frames a connection sends. A link that says when it is done with a frame's bytes
 * (`callsSent`: the WebSocket links) is handed bytes in memory that is taken back at that moment
 * and reused for a later frame: writing into memory already in use costs about a quarter of
 * writing into fresh memory, most of an activation frame's encoding cost. Any other link gets
 * bytes of its own that it may keep.
 */
export class FrameWriter {
  readonly #options: { maxFrameBytes: number; headroom: number };
  readonly #free: FrameEncoder[] = [];

  /**
   * `headroom`: padding bytes left before a dispatch's or result's main tensor so that a relay
   * forwards the frame in its own memory (`relayHeadroom` of the sender's id; 0 where no relay
   * forwards).
   */
  constructor(maxFrameBytes: number, headroom = 0) {
    this.#options = { maxFrameBytes, headroom };
  }

  /**
   * Encodes `frame` for `link` and calls `use` with its bytes and the `sent` to pass with them to
   * `link.send` (undefined for a link that keeps its bytes). Throws (before calling `use`) when the
   * frame is invalid or over maxFrameBytes.
   *
   * Memory comes back only through `sent`: when `use` throws, or returns without sending, its
   * memory is left to the garbage collector, since the link may hold the bytes all the same.
   */
  encode<T>(
    link: FrameLink,
    frame: EncodableFrame,
    use: (bytes: Uint8Array, sent: (() => void) | undefined) => T,
  ): T {
    if (link.callsSent !== true) {
      return use(encodeFrame(frame, this.#options), undefined);
    }
    const encoder = this.#free.pop() ?? new FrameEncoder(this.#options);
    let back = false;
    const sent = () => {
      if (back) return;
      back = true;
      if (this.#free.length < KEPT_ENCODERS) this.#free.push(encoder);
    };
    return encoder.encode(frame, (bytes) => use(bytes, sent));
  }

  /**
   * Encodes `frame` and queues it on `link`. A result's in-place `y` is filled in the memory that
   * is sent.
   */
  send(link: FrameLink, frame: EncodableFrame): void {
    this.encode(link, frame, (bytes, sent) => link.send(bytes, sent));
  }
}
