// `pnpm --filter @moeswarm/example-offload-plan start [ctx]`: writes a Qwen3.5-122B-A10B-shaped
// Q4_K_M header (sparse: a few KB on disk), plans it for a 64 GB GPU with 128 GiB of RAM at an
// 8192-token context (or the one given), then at the model's full 262144-token context beside
// the reference deployment's figures. The same plan from the command line:
//   moeswarm-shard plan <file|url> --vram 64GiB --ram 128GiB --ctx 8192
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { formatOffloadPlan } from "@moeswarm/shard";
import { compareWithReference, formatComparison, planModel } from "./compare.js";
import { QWEN35_122B_A10B, writeQwen35Header } from "./qwen35-122b.js";

const ctx = Number(process.argv[2] ?? 8192);
const dir = mkdtempSync(join(tmpdir(), "offload-plan-"));
try {
  const path = join(dir, "Qwen3.5-122B-A10B-Q4_K_M.shape.gguf");
  const size = await writeQwen35Header(path);
  process.stdout.write(`wrote ${path}: ${size} bytes (sparse, header only)\n\n`);

  const plan = await planModel(path, { ctx });
  process.stdout.write(formatOffloadPlan(plan, { model: "Qwen3.5-122B-A10B-Q4_K_M.gguf" }));

  const full = await planModel(path, { ctx: QWEN35_122B_A10B.maxPositionEmbeddings });
  process.stdout.write(
    `\nAt the model's full ${QWEN35_122B_A10B.maxPositionEmbeddings}-token context, beside the reference deployment:\n` +
      `RAM layers ${full.ramLayers.join(",")}, -ot ${full.overrideTensor}\n\n`,
  );
  process.stdout.write(formatComparison(compareWithReference(full)));
} finally {
  rmSync(dir, { recursive: true, force: true });
}
