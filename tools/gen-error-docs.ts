// Regenerates docs/errors.md from the code table in @moeswarm/core (run: pnpm docs:errors).
import { writeFileSync } from "node:fs";
import { ERROR_CODES } from "../packages/core/src/error-codes.js";

const rows = Object.entries(ERROR_CODES).map(
  ([code, { area, text }]) => `| \`${code}\` | \`${area}\` | ${text} |`,
);
const doc = `# Error codes

Every error moeswarm throws is a \`MoeswarmError\` (from \`@moeswarm/core\`) with a stable \`code\`.
Services answer with the same code (in \`error\` frames and JSON error bodies). Check errors with
\`isMoeswarmError(err, "MOESWARM_...")\` or \`err instanceof GgufError\`: both work across two copies of
the package. This table is generated from \`packages/core/src/error-codes.ts\` by \`pnpm docs:errors\`;
a test fails when they differ.

| code | class | meaning |
| --- | --- | --- |
${rows.join("\n")}
`;
writeFileSync(new URL("../docs/errors.md", import.meta.url), doc);
