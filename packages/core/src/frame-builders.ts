import { validateFrame } from "./codec.js";
import { InvalidArgumentError } from "./errors.js";
import {
  type DispatchFrame,
  type DrainFrame,
  type ErrorFrame,
  FRAME_FIELDS,
  type Frame,
  type FrameType,
  type HelloFrame,
  type PingFrame,
  type PongFrame,
  PROTOCOL_VERSION,
  type RegisterFrame,
  type ResultFrame,
} from "./frames.js";

/** The fields a caller supplies for a frame: everything but `t` and `v`. */
export type FrameInit<F extends Frame> = F extends unknown ? Omit<F, "t" | "v"> : never;

// Builders take typed arrays and plain values, validate them with the same rules decodeFrame
// enforces (throwing InvalidArgumentError) and return the frame, ready for encodeFrame. Only the
// frame type's own fields are kept, in canonical order.
function build<F extends Frame>(t: FrameType, init: object): F {
  if (typeof init !== "object" || init === null) {
    throw new InvalidArgumentError(`${t}Frame needs an object of fields`);
  }
  const src = init as Record<string, unknown>;
  const frame: Record<string, unknown> = { t, v: PROTOCOL_VERSION };
  for (const { key } of FRAME_FIELDS[t]) {
    if (src[key] !== undefined) frame[key] = src[key];
  }
  validateFrame(frame as unknown as Frame);
  return frame as unknown as F;
}

export const helloFrame = (init: FrameInit<HelloFrame>): HelloFrame => build("hello", init);
export const registerFrame = (init: FrameInit<RegisterFrame>): RegisterFrame => build("register", init);
/** A dispatch: `x` is a Float32Array for dtype f32, the raw bits in a Uint16Array for f16/bf16. */
export const dispatchFrame = (init: FrameInit<DispatchFrame>): DispatchFrame => build("dispatch", init);
export const resultFrame = (init: FrameInit<ResultFrame>): ResultFrame => build("result", init);
export const errorFrame = (init: FrameInit<ErrorFrame>): ErrorFrame => build("error", init);
export const pingFrame = (init: FrameInit<PingFrame>): PingFrame => build("ping", init);
/** The answer to a ping: the same `seq` and `ts`. */
export const pongFrame = (ping: FrameInit<PongFrame>): PongFrame => build("pong", ping);
export const drainFrame = (init: FrameInit<DrainFrame> = {}): DrainFrame => build("drain", init);
