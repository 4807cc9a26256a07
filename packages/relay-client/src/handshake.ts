import { abortable, errorFromCode, linkedSignal, TransportError, throwIfAborted } from "@moeswarm/core";
import type { FrameLink, FrameLinkHandlers } from "./link.js";
import type { Settings } from "./options.js";
import { type Frame, PROTOCOL_VERSION } from "./wire.js";

// One connection attempt: dial, say hello, wait for the relay's acceptance, all within
// connectTimeoutMs. Until the relay accepts, frames on the new link go to the pending hello.

/** A hello waiting for the relay's answer. */
export interface PendingHello {
  /** The link the hello went out on, once dialed. */
  link: FrameLink | undefined;
  /** A frame that arrived on that link: the relay's `hello` accepts, a connection `error` refuses. */
  frame(frame: Frame): void;
  /** The link closed before the relay accepted. */
  reject(error: Error): void;
}

/** How the attempt reaches into its connection. */
export interface HelloHooks {
  /** The hello in progress (undefined once the attempt settled). */
  pending(hello: PendingHello | undefined): void;
  /** The link's handlers; `link()` is the link once dialed. */
  handlers(link: () => FrameLink): FrameLinkHandlers;
  /** The link dialed: it is the connection's link from now on... */
  linked(link: FrameLink): void;
  /** ...unless the attempt failed. */
  unlinked(link: FrameLink): void;
  send(link: FrameLink, frame: Frame): void;
}

function helloTimeout(): TransportError {
  return new TransportError("MOESWARM_TRANSPORT_CONNECT", "the relay did not accept hello in time");
}

/** Dials, says hello and resolves when the relay accepted; the link is left linked on success. */
export async function dialAndHello(
  url: string,
  s: Settings,
  token: string,
  life: AbortSignal,
  hooks: HelloHooks,
): Promise<void> {
  throwIfAborted(life);
  let accept!: () => void;
  let refuse!: (error: Error) => void;
  const accepted = new Promise<void>((resolve, reject) => {
    accept = resolve;
    refuse = reject;
  });
  accepted.catch(() => {});
  const hello: PendingHello = {
    link: undefined,
    frame(frame) {
      if (frame.t === "hello") accept();
      else if (frame.t === "error" && frame.id === undefined) refuse(errorFromCode(frame.code, frame.msg));
    },
    reject: refuse,
  };
  hooks.pending(hello);
  const attempt = linkedSignal([life], { ms: s.connectTimeoutMs, reason: helloTimeout });
  let link: FrameLink | undefined;
  try {
    link = await s.dial(url, {
      ca: s.ca,
      maxFrameBytes: s.maxFrameBytes,
      connectTimeoutMs: s.connectTimeoutMs,
      signal: attempt.signal,
      handlers: hooks.handlers(() => link as FrameLink),
    });
    hello.link = link;
    hooks.linked(link);
    hooks.send(link, {
      t: "hello",
      v: PROTOCOL_VERSION,
      role: s.role,
      id: s.id,
      token,
      caps: { maxFrame: s.maxFrameBytes, ...s.caps },
    });
    await abortable(accepted, attempt.signal);
  } catch (error) {
    if (link) {
      hooks.unlinked(link);
      link.destroy();
    }
    if (attempt.signal.aborted && !life.aborted) throw helloTimeout();
    throw error;
  } finally {
    attempt.dispose();
    hooks.pending(undefined);
  }
}
