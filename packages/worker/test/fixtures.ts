// The runtime's test fixtures: a loopback hub, plus worker-native's synthetic models and float
// comparisons (the slices a worker serves are those models' slices; written once, over there).
import { createHub, type Hub } from "@moeswarm/hub";

export {
  bitsEqual,
  type Fixture,
  firstBitDiff,
  normals,
  randomIds,
  randomWeights,
  rng,
  writeModel,
  writeSlice,
} from "../../worker-native/test/fixtures.js";

/** A hub serving one model on loopback (no dashboard), for the runtime's tests. */
export async function startTestHub(options: {
  secret: string;
  model: string;
  path: string;
  work: string;
  leaseTtlMs?: number;
}): Promise<{ hub: Hub; url: string; relayUrl: string }> {
  const hub = createHub({
    secret: options.secret,
    models: [{ id: options.model, path: options.path }],
    manifestDir: options.work,
    dashboard: false,
    ...(options.leaseTtlMs !== undefined ? { market: { leaseTtlMs: options.leaseTtlMs } } : {}),
  });
  const { url, relayUrl } = await hub.listen(0);
  return { hub, url, relayUrl };
}
