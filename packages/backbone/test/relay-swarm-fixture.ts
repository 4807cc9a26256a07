// The relay swarm a relay test file shares among its tests (relay, wire-caps, direct-links,
// hub-bridge): a temp dir, the synthetic model, a loopback hub with its relay (startRelaySwarm),
// started before the file's tests and closed after them. What each file does on the swarm (which
// workers join, what they answer) stays in the file.
import type { SyntheticPreset } from "@moeswarm/shard";
import { afterAll, beforeAll } from "vitest";
import { type RelaySwarm, startRelaySwarm, syntheticModel, type TempDir, tempDir } from "./helpers.js";

export interface RelaySwarmFixture {
  /** The file's temp dir (slices, sockets, logits files), made at once, removed after the tests. */
  readonly tmp: TempDir;
  /**
   * The swarm, usable from the file's own `beforeAll` on (registered after this one, it runs after
   * it); reading it earlier throws.
   */
  readonly swarm: RelaySwarm;
  /** The swarm's model file, its layers and experts, and where its hub listens (as `swarm` has them). */
  readonly modelPath: string;
  readonly info: RelaySwarm["info"];
  readonly url: string;
  readonly relayUrl: string;
}

/**
 * The swarm of a test file: a hub serving the synthetic `preset` model (qwen3moe) as `model`, over
 * TLS with a loopback CA when `tls`. Call it inside the file's `describe`, before its own hooks:
 * its `afterAll` then runs after theirs, so a file closes what it built on the swarm first.
 */
export function useRelaySwarm(options: {
  prefix: string;
  secret: string;
  model: string;
  preset: SyntheticPreset;
  tls?: boolean;
}): RelaySwarmFixture {
  const tmp = tempDir(options.prefix);
  let started: RelaySwarm | undefined;
  beforeAll(async () => {
    started = await startRelaySwarm({
      secret: options.secret,
      model: options.model,
      modelPath: await syntheticModel(options.preset, "qwen3moe"),
      dir: tmp.dir,
      ...(options.tls ? { tls: true } : {}),
    });
  });
  afterAll(async () => {
    await started?.close();
    tmp.remove();
  });
  const swarm = (): RelaySwarm => {
    if (!started) throw new Error("the relay swarm is started in beforeAll: read it from a hook or a test");
    return started;
  };
  return {
    tmp,
    get swarm() {
      return swarm();
    },
    get modelPath() {
      return swarm().modelPath;
    },
    get info() {
      return swarm().info;
    },
    get url() {
      return swarm().url;
    },
    get relayUrl() {
      return swarm().relayUrl;
    },
  };
}
