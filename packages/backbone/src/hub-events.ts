import { HubError, isMoeswarmError, type MoeswarmError } from "@moeswarm/core";
import type { RelayState } from "@moeswarm/relay-client";

// What the hub link tells its owner (events, error stamps), shared by its poller and reporter.

/** The hub's answer to a report. */
export interface StatsOutcome {
  seq: number;
  /** false: the hub had this seq already (a retry whose first try arrived); nothing counted twice. */
  accepted: boolean;
  /** Workers credited with their receipts, and receipts for workers the hub does not know. */
  credited: string[];
  ignored: string[];
}

export type HubLinkEvent =
  | { type: "placement"; version: number; workers: string[]; missing: number }
  | ({ type: "stats" } & StatsOutcome)
  /** The relay connection changed state (it reconnects by itself after a drop). */
  | { type: "relay"; state: RelayState; error?: MoeswarmError }
  /** A quarantine this backbone proved was reported to the hub. */
  | { type: "quarantine-report"; worker: string; accepted: boolean }
  /** A direct link to a worker came up, could not be dialed, or was lost (the relay carries its requests meanwhile). */
  | {
      type: "direct";
      worker: string;
      state: "linked" | "dial-failed" | "lost";
      url?: string;
      error?: Error;
      retryInMs?: number;
    }
  /**
   * A poll or a report failed; it is retried after `retryInMs` (a report the hub refused as
   * invalid is dropped). A quarantine report is not retried (the local quarantine holds).
   */
  | {
      type: "error";
      /** "bans": a ban-list refresh failed; the last list read stays in force. */
      source: "poll" | "stats" | "quarantine" | "bans";
      error: MoeswarmError;
      retryInMs?: number;
      dropped?: boolean;
      /** What it means and what to do (the CLI prints it). */
      hint?: string;
    };

export interface HubLinkError {
  code: string;
  message: string;
  /** Epoch ms. */
  at: number;
}

/** Sends an event to the owner's `onEvent`. */
export type Emit = (event: HubLinkEvent) => void;

export function emitter(onEvent: ((event: HubLinkEvent) => void) | undefined): Emit {
  return (event) => {
    try {
      onEvent?.(event);
    } catch {
      // a logger's failure is not the link's
    }
  };
}

/** Any failure as a MoeswarmError (an unexpected one as the hub's internal error). */
export function asError(error: unknown): MoeswarmError {
  if (isMoeswarmError(error)) return error;
  return new HubError("MOESWARM_HUB_INTERNAL", error instanceof Error ? error.message : String(error), {
    cause: error,
  });
}

/** An error as the metrics keep it: code, message, when. */
export function stamp(e: MoeswarmError): HubLinkError {
  return { code: e.code, message: e.message, at: Date.now() };
}
