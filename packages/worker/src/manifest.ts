import type { HubClient } from "@moeswarm/relay-client";
import { parseManifest, type SliceManifest } from "@moeswarm/shard";

/** A model's manifest is large (a sha256 per slab): room for the biggest models'. */
const MANIFEST_LIMIT = 256 * 1024 * 1024;

/** The manifest a lease names (`lease.manifest`), checked. */
export async function manifestOf(hub: HubClient, path: string, signal?: AbortSignal): Promise<SliceManifest> {
  const { json } = await hub.request(path, { signal, maxBodyBytes: MANIFEST_LIMIT });
  return parseManifest(json);
}
