// Prints the vectors of the "Test vectors" section of docs/protocol.md from test/vectors.ts
// (`pnpm --filter @moeswarm/core protocol-vectors`). After pasting them into the document, run
// `pnpm exec biome format --write docs/protocol.md` (it lays the JSON blocks out on several lines).
import { encodeFrame } from "../src/index.js";
import { frameToJson, VECTORS } from "../test/vectors.js";

function hexLines(bytes: Uint8Array): string {
  const lines: string[] = [];
  for (let i = 0; i < bytes.length; i += 16) {
    lines.push(Array.from(bytes.subarray(i, i + 16), (b) => b.toString(16).padStart(2, "0")).join(" "));
  }
  return lines.join("\n");
}

const parts: string[] = [];
for (const v of VECTORS) {
  const bytes = encodeFrame(v.frame);
  parts.push(
    `### Vector \`${v.name}\`\n\n${v.note} ${bytes.length} bytes.\n\n\`\`\`json\n${JSON.stringify(frameToJson(v.frame))}\n\`\`\`\n\n\`\`\`hex\n${hexLines(bytes)}\n\`\`\`\n`,
  );
}
process.stdout.write(parts.join("\n"));
