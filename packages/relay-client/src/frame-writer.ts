import type { FrameLink } from "./link.js";
import { type EncodableFrame, encodeFrame, FrameEncoder } from "./wire.js";

/**
 * Encodes the frames a connection sends. A link that is done with a frame's bytes when `send`
 * returns (`copiesOnSend`: the WebSocket client masks them into a buffer of its own) is handed
 * bytes in memory reused frame after frame, which saves most of an activation frame's encoding
 * cost (writing into fresh memory); any other link gets bytes of its own that it may keep.
 */
export class FrameWriter {
  readonly #maxFrameBytes: number;
  readonly #reused: FrameEncoder;

  constructor(maxFrameBytes: number) {
    this.#maxFrameBytes = maxFrameBytes;
    this.#reused = new FrameEncoder({ maxFrameBytes });
  }

  /**
   * Encodes `frame` for `link` and calls `use` with its bytes, which `use` must hand to
   * `link.send` before it returns and keep no reference to. Throws (before calling `use`) when
   * the frame is invalid or over maxFrameBytes.
   */
  encode<T>(link: FrameLink, frame: EncodableFrame, use: (bytes: Uint8Array) => T): T {
    if (link.copiesOnSend === true) return this.#reused.encode(frame, use);
    return use(encodeFrame(frame, { maxFrameBytes: this.#maxFrameBytes }));
  }

  /**
   * Encodes `frame` and queues it on `link`. A result's in-place `y` is filled in the memory that
   * is sent: reused memory for a link that copies on send, else memory of the frame's own.
   */
  send(link: FrameLink, frame: EncodableFrame): void {
    this.encode(link, frame, (bytes) => link.send(bytes));
  }
}
