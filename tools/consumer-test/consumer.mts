// Type-checked (never run) by tools/consumer-test.mjs under module node16, nodenext and bundler
// against the installed packages' declarations.
import { type ExpertHandler, relL2 } from "@moeswarm/core";
import { dispatchExperts, InProcessTransport, Placement, type Routing, route } from "@moeswarm/dispatch";
import { type ExpertCompute, loadExpertCompute } from "@moeswarm/worker-native";

function handlerOf(compute: ExpertCompute): ExpertHandler {
  return async (request, { signal }) => {
    if (!(request.x instanceof Float32Array)) throw new Error("f32 only");
    const y = await compute.run(
      { layer: request.layer, x: request.x, ids: request.ids, k: request.k, mode: request.mode },
      { signal },
    );
    return { mode: request.mode, n: request.n, k: request.k, embd: request.embd, y, ms: 0 };
  };
}

export async function layer(model: string, hidden: Float32Array, logits: Float32Array): Promise<number> {
  const compute = await loadExpertCompute(model, { backend: "auto" });
  const routing: Routing = route(logits, { nExpert: 8, nExpertUsed: 2, gating: "softmax", normalize: true });
  const placement = Placement.fromRegistrations([
    { id: "w0", model: "m", layers: [0], experts: [0, 1, 2, 3, 4, 5, 6, 7] },
  ]);
  const transport = new InProcessTransport([["w0", handlerOf(compute)]]);
  const y: Float32Array = await dispatchExperts(hidden, routing, { layer: 0, placement, transport });
  await compute.close();
  return relL2(y, y);
}
