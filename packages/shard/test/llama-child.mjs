// What the llama.cpp child scripts of the tests (llama-text.mjs, llama-decode.mjs, plan-load.mjs)
// share: node-llama-cpp 3.21.1's prebuilt CPU binary, never a build or a download, and small
// single-threaded contexts.
import { getLlama, LlamaLogLevel } from "node-llama-cpp";

export { LlamaLogLevel };

/**
 * The prebuilt CPU llama.cpp, errors only unless `options` says otherwise. One thread: two
 * spinning ggml threads crawl on a loaded 2-core machine (300 ms vs 3 ms a token).
 */
export function prebuiltCpuLlama(options = {}) {
  return getLlama({
    gpu: false,
    build: "never",
    skipDownload: true,
    usePrebuiltBinaries: true,
    progressLogs: false,
    logLevel: LlamaLogLevel.error,
    maxThreads: 1,
    ...options,
  });
}

/** A fresh 256-token, single-threaded context for one run of fn on its sequence; disposed after. */
export async function withSequence(model, fn) {
  const context = await model.createContext({ contextSize: 256, batchSize: 64, threads: 1 });
  try {
    return await fn(context.getSequence());
  } finally {
    await context.dispose();
  }
}
