// The hub both hub-http test files start (hub-http-serving: models, manifests, expert-shard;
// hub-http-operations: errors, writes, private reads, failures, close, embedding, metrics).
import { afterAll, beforeAll } from "vitest";
import { createHub, type Hub, type HubEvent } from "../src/index.js";
import { copyModel, syntheticModel, type TempDir, tempDir } from "./hub-helpers.js";

export const SECRET = "hub-test-secret-0123456789abcdef";
export const ID = "tiny";

export interface HubFixture {
  tmp: TempDir;
  tinyPath: string;
  hub: Hub;
  base: string;
  events: HubEvent[];
}

/** A hub on a free port serving a copy of the tiny model from a fresh temp dir. */
export async function startHub(): Promise<HubFixture> {
  const events: HubEvent[] = [];
  const tmp = tempDir();
  const tinyPath = copyModel(await syntheticModel("tiny"), tmp.dir, "tiny.gguf");
  const hub = createHub({
    secret: SECRET,
    models: [{ id: ID, path: tinyPath }],
    modelDir: tmp.dir,
    chunkSize: 4096, // many chunks even for the tiny model: exercises the streaming path
    onEvent: (e) => events.push(e),
  });
  const base = (await hub.listen(0)).url;
  return { tmp, tinyPath, hub, base, events };
}

/**
 * The fixture hub of a test file: started before its tests, closed (its temp dir removed) after
 * them. Its fields are set once `beforeAll` has run; `shardUrl` builds an expert-shard URL on it.
 */
export function useHub(): HubFixture & { shardUrl(query: string, id?: string): string } {
  const fx = {} as HubFixture;
  beforeAll(async () => {
    Object.assign(fx, await startHub());
  });
  afterAll(async () => {
    await fx.hub?.close();
    fx.tmp?.remove();
  });
  return Object.assign(fx, {
    shardUrl: (query: string, id = ID) => `${fx.base}/api/models/${id}/expert-shard?${query}`,
  });
}
