import {
  AuthError,
  InvalidArgumentError,
  isMoeswarmError,
  type MoeswarmError,
  NativeError,
  throwIfAborted,
} from "@moeswarm/core";
import type { ExpertCompute } from "./expert-compute.js";
import { llamaCppBinsDir, requireLlamaCpuAddon } from "./llama-cpu.js";
import { type NativeAddon, type NativeSliceHandle, nativeError, requireNative } from "./native-binding.js";
import { NativeExpertCompute } from "./native-compute.js";

// The worker's native listener (docs/protocol.md section 10.9): a TLS listener on threads of the
// addon that answers backbone plugins' dispatches with no JavaScript on their path. JavaScript
// keeps the decisions: it checks each connection's hello (the ticket) and sets which slice serves
// which (model, layer). Only slices of the addon build the listener runs in can be served (the
// in-process native or llama-cpu compute); layers computed elsewhere stay off the native plane.

/** A slice the native listener can compute on: what {@link nativeSliceOf} returns. */
export interface NativeSlice {
  /** @internal */
  readonly addon: NativeAddon;
  /** @internal */
  readonly handle: NativeSliceHandle;
}

/** One (model, layer) the listener serves, and the slice that computes it. */
export interface NativeRoute {
  model: string;
  layer: number;
  slice: NativeSlice;
}

/** What the listener answered since the last takeServed, per backbone (the ticket's) and model. */
export interface NativeServed {
  backbone: string;
  model: string;
  /** Filled slots (ids != -1) of the dispatches answered. */
  expertTokens: number;
  requests: number;
}

export interface NativeServerOptions {
  /** Address to listen on (default "0.0.0.0"; "::" for IPv6). */
  host?: string;
  /** Port (default 0: any free one; `port` says which). */
  port?: number;
  /** PEM certificate and private key (the worker's `--listen` pair: the same fingerprint). */
  cert: string;
  key: string;
  /** The worker's id: a dispatch's `to`, when present, must be it. */
  id: string;
  /** Largest frame accepted (bytes, default 64 MiB). */
  maxFrameBytes?: number;
  /** A connection's TLS handshake and hello, and the hello's verdict, within this (ms, default 10 s). */
  helloTimeoutMs?: number;
  /** A connection with no frame for this long is closed (ms, default 10 min). */
  idleTimeoutMs?: number;
  /**
   * Which addon build computes (default "native"; "llama-cpu": the in-process llama-cpu addon).
   * Only slices loaded with that build can be routed.
   */
  compute?: "native" | "llama-cpu";
  /** node-llama-cpp's bins directory, for compute "llama-cpu" (default: llamaCppBinsDir()). */
  binsDir?: string;
  /**
   * Checks a connection's hello (section 10.8's rules): resolves to admit it, throws (or rejects
   * with) a MoeswarmError whose code the backbone is refused with. Called on the JS thread.
   */
  admit(backbone: string, ticket: string, remote: string): void | Promise<void>;
  /** Each refused hello, for the worker's log. */
  onRefused?(error: MoeswarmError, remote: string): void;
  signal?: AbortSignal;
}

export interface NativeServer {
  readonly port: number;
  /** SHA-256 of the certificate's DER, "AA:BB:...", as backbones pin it. */
  readonly fingerprint: string;
  /**
   * The table served from now on, replacing the last; an empty one answers every dispatch with
   * MOESWARM_TRANSPORT_DRAINING (pause, drain). Routes on a slice of another addon build are left
   * out: the routes that were taken are returned.
   */
  setRoutes(routes: readonly NativeRoute[]): NativeRoute[];
  /** What was answered since the last call. */
  takeServed(): NativeServed[];
  /** Stops listening, closes every connection, joins the threads. Idempotent. */
  close(): void;
}

/** The addon's class (native/addon/native-server.h). */
interface AddonNativeServer {
  readonly port: number;
  readonly fingerprint: string;
  setRoutes(routes: Array<{ model: string; layer: number; slice: NativeSliceHandle }>): void;
  takeServed(): NativeServed[];
  close(): void;
}

type AddonNativeServerClass = new (o: {
  host: string;
  port: number;
  cert: string;
  key: string;
  id: string;
  maxFrame: number;
  helloMs?: number;
  idleMs?: number;
  onHello(
    backbone: string,
    ticket: string,
    remote: string,
    done: (ok: true | string, msg?: string) => void,
  ): void;
}) => AddonNativeServer;

/** The slice of a compute the native listener can serve, or undefined (a child process, TypeScript). */
export function nativeSliceOf(compute: ExpertCompute): NativeSlice | undefined {
  return compute instanceof NativeExpertCompute ? compute.nativeSlice() : undefined;
}

/** Where the verdict of a hello goes: admitted, or the refusal's code and message. */
function settle(
  o: NativeServerOptions,
  remote: string,
  done: (ok: true | string, msg?: string) => void,
  error: unknown,
): void {
  const e = isMoeswarmError(error)
    ? error
    : new AuthError("MOESWARM_AUTH_TICKET_INVALID", `direct-link ticket refused: ${String(error)}`);
  o.onRefused?.(e, remote);
  done(e.code, e.message);
}

/**
 * Starts the native listener. Throws NativeError MOESWARM_NATIVE_TLS_UNAVAILABLE where OpenSSL 3
 * cannot be found (the worker then carries on without it), MOESWARM_NATIVE_LISTEN when the
 * address cannot be listened on.
 */
export async function serveNative(o: NativeServerOptions): Promise<NativeServer> {
  throwIfAborted(o.signal);
  if (typeof o?.admit !== "function") throw new InvalidArgumentError("serveNative needs admit()");
  const port = o.port ?? 0;
  if (!Number.isInteger(port) || port < 0 || port > 65_535) {
    throw new InvalidArgumentError(`port must be an integer in 0..65535, got ${String(o.port)}`);
  }
  const addon =
    o.compute === "llama-cpu"
      ? requireLlamaCpuAddon(llamaCppBinsDir(o.binsDir !== undefined ? { dir: o.binsDir } : {}))
      : await requireNative(o.signal ? { signal: o.signal } : {});
  const Server = (addon as unknown as { NativeServer?: AddonNativeServerClass }).NativeServer;
  if (typeof Server !== "function") {
    throw new NativeError(
      "MOESWARM_NATIVE_LOAD",
      "this build of the addon has no native listener: install the matching @moeswarm/worker-native",
    );
  }
  let native: AddonNativeServer;
  try {
    native = new Server({
      host: o.host ?? "0.0.0.0",
      port,
      cert: o.cert,
      key: o.key,
      id: o.id,
      maxFrame: o.maxFrameBytes ?? 64 * 1024 * 1024,
      ...(o.helloTimeoutMs !== undefined ? { helloMs: o.helloTimeoutMs } : {}),
      ...(o.idleTimeoutMs !== undefined ? { idleMs: o.idleTimeoutMs } : {}),
      onHello: (backbone, ticket, remote, done) => {
        try {
          const r = o.admit(backbone, ticket, remote);
          if (r instanceof Promise)
            r.then(
              () => done(true),
              (error) => settle(o, remote, done, error),
            );
          else done(true);
        } catch (error) {
          settle(o, remote, done, error);
        }
      },
    });
  } catch (cause) {
    throw nativeError(cause);
  }
  let closed = false;
  const close = () => {
    if (closed) return;
    closed = true;
    native.close();
    o.signal?.removeEventListener("abort", close);
  };
  o.signal?.addEventListener("abort", close, { once: true });
  return {
    port: native.port,
    fingerprint: native.fingerprint,
    setRoutes(routes) {
      const taken = routes.filter((r) => r.slice.addon === addon);
      try {
        native.setRoutes(taken.map((r) => ({ model: r.model, layer: r.layer, slice: r.slice.handle })));
      } catch (cause) {
        throw nativeError(cause);
      }
      return taken;
    },
    takeServed: () => native.takeServed(),
    close,
  };
}
