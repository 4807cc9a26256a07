// The demo's lying worker (`pnpm demo -- --liar`): the real `moeswarm-worker` command, whose compute
// scales every output by 1.05 — a plausible answer that the slices' sha256 checks and the frame
// validation cannot catch. Only the backbone's verification can (docs/trust.md).
import { runCliProcess } from "@moeswarm/core";
import { runWorkerCli } from "@moeswarm/worker";

const SCALE = 1.05;

runCliProcess(
  (argv, io, signal) =>
    runWorkerCli(argv, io, signal, {
      wrapCompute: (honest) => ({
        info: honest.info,
        run: async (request, options) =>
          (await honest.run(request, options)).map((v) => Math.fround(v * SCALE)),
        close: () => honest.close(),
        [Symbol.asyncDispose]: () => honest.close(),
      }),
    }),
  { name: "demo-liar", signalReason: true },
);
