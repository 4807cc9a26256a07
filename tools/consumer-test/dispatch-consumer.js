// A third party's use of dispatchExperts with the native addon, run from an installed copy of the
// packages (tools/consumer-test.mjs writes it out twice: as an ES module and as CommonJS; the
// IMPORTS line is replaced). It exits non-zero unless the native path was taken, the swarm's output
// matches the TypeScript path's, and the prebuilt executable runs (its exec bit survived packing).
/* IMPORTS */

const nExpert = 8;
const nEmbd = 64;

function handlerOf(compute) {
  return async (request, { signal }) => {
    const y = await compute.run(
      {
        layer: request.layer,
        x: request.x,
        ids: request.ids,
        k: request.k,
        ...(request.w ? { w: request.w } : {}),
        mode: request.mode,
      },
      { signal },
    );
    return { mode: request.mode, n: request.n, k: request.k, embd: request.embd, y, ms: 0 };
  };
}

async function swarmOutput(compute, hidden, routing) {
  const registrations = [
    { id: "w0", model: "m", layers: [0], experts: [0, 1, 2, 3] },
    { id: "w1", model: "m", layers: [0], experts: [4, 5, 6, 7] },
  ];
  const placement = Placement.fromRegistrations(registrations);
  placement.validate({ layers: [0], nExpert });
  const transport = new InProcessTransport(registrations.map((r) => [r.id, handlerOf(compute)]));
  return dispatchExperts(hidden, routing, { layer: 0, placement, transport });
}

async function main() {
  const dir = mkdtempSync(join(tmpdir(), "moeswarm-consumer-"));
  try {
    const model = join(dir, "tiny.gguf");
    await synthesizeMoeModel(
      {
        arch: "qwen3moe",
        seed: 7,
        nLayer: 1,
        nEmbd,
        nHead: 4,
        nHeadKv: 2,
        headDim: 16,
        nFfExp: 32,
        nExpert,
        nExpertUsed: 2,
        vocab: 300,
      },
      model,
    );
    const rand = mulberry32(1);
    const n = 5;
    const hidden = Float32Array.from({ length: n * nEmbd }, () => rand() - 0.5);
    const logits = Float32Array.from({ length: n * nExpert }, () => 4 * (rand() - 0.5));
    const routing = route(logits, { nExpert, nExpertUsed: 2, gating: "softmax", normalize: true });

    const native = await loadExpertCompute(model, { backend: "native", threads: 1 });
    const ts = await loadExpertCompute(model, { backend: "ts" });
    const worker = await spawnExpertWorker(expertWorkerPath(), model, { threads: 1 });
    try {
      if (native.info.backend !== "native")
        throw new Error(`expected the native addon, got ${native.info.backend}`);
      const a = await swarmOutput(native, hidden, routing);
      const b = await swarmOutput(ts, hidden, routing);
      const c = await swarmOutput(worker, hidden, routing);
      const ab = relL2(a, b);
      const ac = relL2(a, c);
      // ggml quantises activations for quantised weights, the TypeScript path does not; the
      // executable runs the same ggml code as the addon
      if (!(ab < 0.02)) throw new Error(`native vs TypeScript: relL2 ${ab}`);
      if (!(ac < 1e-6)) throw new Error(`addon vs executable: relL2 ${ac}`);
      console.log(
        `dispatchExperts ok (${native.info.backend}, relL2 vs ts ${ab.toExponential(2)}, vs executable ${ac.toExponential(2)})`,
      );
    } finally {
      await native.close();
      await ts.close();
      await worker.close();
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
