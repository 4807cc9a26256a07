// Checking `createHub`'s options once, up front (InvalidArgumentError), into the settings the
// hub's parts read, and opening the store the options name.
import { resolve } from "node:path";
import { InvalidArgumentError, isMoeswarmError } from "@moeswarm/core";
import { checkTrustProxy, type TrustedProxies } from "./client-address.js";
import { type CheckedLimits, checkLimits } from "./connection-guard.js";
import { checkEnrolmentLimits, type EnrolmentLimits } from "./enrolment.js";
import type { HubModelSource, HubOptions } from "./hub-types.js";
import type { MarketOptions } from "./market.js";
import { defaultModelId } from "./model.js";
import { createMemoryStore, type HubStore, isModelId } from "./store.js";
import { openSqliteStore } from "./store-sqlite.js";
import { checkSecret, type TokenSecret } from "./token.js";

/** The checked options the request handlers and the model registry read. */
export interface Settings {
  secret: TokenSecret;
  publicReads: boolean;
  modelDir: string | undefined;
  manifestDir: string | undefined;
  chunkSize: number;
  sliceCacheSize: number;
  idleTimeoutMs: number;
  maxBodyBytes: number;
  tls: HubOptions["tls"];
  onEvent: HubOptions["onEvent"];
  dashboard: boolean | undefined;
  maxStatsBytes: number;
  maxPollMs: number;
  allowUnboundTokens: boolean;
  requireLeases: boolean;
  trustReports: boolean;
  limits: CheckedLimits;
  /** Tries of enrolment codes per client address. */
  enrolment: Required<EnrolmentLimits>;
  /** Reverse proxies whose X-Forwarded-For names the client (client-address.ts). */
  trustProxy: TrustedProxies | undefined;
}

/** Everything construction needs, checked. */
export interface HubConfig {
  settings: Settings;
  /** The configured models, ids checked and unique, paths absolute. */
  configured: Array<{ id: string; path: string }>;
  clock: () => number;
  marketOptions: Omit<MarketOptions, "newId">;
  statsStaleMs: number;
  persistMs: number;
  forgetMs: number;
  pauseRetentionMs: number;
}

function positiveInt(name: string, value: number | undefined, fallback: number, min = 1): number {
  const v = value ?? fallback;
  if (!Number.isSafeInteger(v) || v < min) {
    throw new InvalidArgumentError(`hub option ${name} must be an integer >= ${min}`);
  }
  return v;
}

/** Checks the options (in the order the hub always checked them, so the first fault is the one named). */
export function readHubOptions(options: HubOptions): HubConfig {
  checkSecret(options.secret);
  const configured = configuredModels(options.models);
  for (const dir of ["modelDir", "manifestDir"] as const) {
    const v = options[dir];
    if (v !== undefined && (typeof v !== "string" || v.length === 0)) {
      throw new InvalidArgumentError(`hub option ${dir} must be a directory path`);
    }
  }
  if (options.tls !== undefined && (!options.tls?.cert || !options.tls?.key)) {
    throw new InvalidArgumentError("hub option tls needs cert and key");
  }
  const settings: Settings = {
    secret: options.secret,
    publicReads: options.publicReads ?? true,
    modelDir: options.modelDir === undefined ? undefined : resolve(options.modelDir),
    manifestDir: options.manifestDir === undefined ? undefined : resolve(options.manifestDir),
    chunkSize: positiveInt("chunkSize", options.chunkSize, 1 << 20),
    sliceCacheSize: positiveInt("sliceCacheSize", options.sliceCacheSize, 32),
    idleTimeoutMs: positiveInt("idleTimeoutMs", options.idleTimeoutMs, 120_000),
    maxBodyBytes: positiveInt("maxBodyBytes", options.maxBodyBytes, 64 * 1024),
    tls: options.tls,
    onEvent: options.onEvent,
    dashboard: options.dashboard,
    maxStatsBytes: positiveInt("maxStatsBytes", options.maxStatsBytes, 4 << 20),
    maxPollMs: positiveInt("maxPollMs", options.maxPollMs, 60_000, 0),
    allowUnboundTokens: options.allowUnboundTokens === true,
    requireLeases: options.requireLeases !== false,
    trustReports: options.trustReports === true,
    limits: checkLimits(options.limits),
    enrolment: checkEnrolmentLimits(options.enrolment),
    trustProxy: checkTrustProxy(options.trustProxy),
  };
  const clock = options.clock ?? Date.now;
  if (typeof clock !== "function") {
    throw new InvalidArgumentError("hub option clock must be a function");
  }
  const { statsStaleMs: staleOption, ...marketOptions } = options.market ?? {};
  const replicas = positiveInt("replicas", options.replicas ?? marketOptions.replicas, 2);
  return {
    settings,
    configured,
    clock,
    marketOptions: { ...marketOptions, replicas },
    statsStaleMs: positiveInt("market.statsStaleMs", staleOption, 30_000),
    persistMs: positiveInt("persistIntervalMs", options.persistIntervalMs, 10_000, 10),
    forgetMs: positiveInt("forgetWorkersAfterMs", options.forgetWorkersAfterMs, 7 * 86_400_000),
    pauseRetentionMs: positiveInt("pauseRetentionMs", options.pauseRetentionMs, 30 * 86_400_000),
  };
}

function configuredModels(option: HubOptions["models"]): Array<{ id: string; path: string }> {
  const models = option ?? [];
  if (!Array.isArray(models)) {
    throw new InvalidArgumentError("hub option models must be an array");
  }
  const configured: Array<{ id: string; path: string }> = [];
  for (const m of models as readonly HubModelSource[]) {
    if (typeof m !== "object" || m === null || typeof m.path !== "string" || m.path.length === 0) {
      throw new InvalidArgumentError("each model needs a path");
    }
    const id = m.id ?? defaultModelId(m.path);
    if (!isModelId(id)) {
      throw new InvalidArgumentError(
        `model id ${JSON.stringify(id)} is not a name of 1..128 characters [A-Za-z0-9._-] starting with a letter or digit`,
      );
    }
    if (configured.some((c) => c.id === id)) {
      throw new InvalidArgumentError(`model id ${id} is given twice`);
    }
    configured.push({ id, path: resolve(m.path) });
  }
  return configured;
}

/** The store the option names; `owned` when the hub opened it (and so closes it). */
export function openHubStore(
  option: HubOptions["store"],
  driver: HubOptions["sqliteDriver"] = "auto",
): { store: HubStore; owned: boolean } {
  if (option === undefined) return { store: createMemoryStore(), owned: true };
  if (typeof option === "string") {
    try {
      return { store: openSqliteStore(option, { driver }), owned: true };
    } catch (error) {
      // ":memory:" asked for no persistence: without SQLite, the memory store is the same
      if (option === ":memory:" && isMoeswarmError(error, "MOESWARM_HUB_NO_SQLITE")) {
        return { store: createMemoryStore(), owned: true };
      }
      throw error;
    }
  }
  if (typeof option === "object" && option !== null) return { store: option, owned: false };
  throw new InvalidArgumentError("hub option store must be a HubStore or a SQLite file path");
}
