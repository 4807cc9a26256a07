// Regenerates docs/errors.md from the code table in @moeswarm/core (run: pnpm docs:errors).
import { execFileSync } from "node:child_process";
import { writeFileSync } from "node:fs";
import { fileURLToPath } from "node:url";
import { ERROR_CODES } from "../packages/core/src/error-codes.js";

const rows = Object.entries(ERROR_CODES).map(
  ([code, { area, text }]) => `| \`${code}\` | \`${area}\` | ${text} |`,
);
const doc = `# Error codes

Every error moeswarm throws is a \`MoeswarmError\` (from \`@moeswarm/core\`) with a stable \`code\`.
Services answer with the same code (in \`error\` frames and JSON error bodies). Check errors with
\`isMoeswarmError(err, "MOESWARM_...")\` or \`err instanceof GgufError\`: both work across two copies of
the package. A code received from another process (an \`error\` frame, a JSON error body) becomes
an instance of its class with \`errorFromCode(code, message)\`; \`errorToWire(err)\` gives the
\`{ code, msg }\` to send for any thrown value. This table is generated from
\`packages/core/src/error-codes.ts\` by \`pnpm docs:errors\`; a test fails when they differ.

| code | class | meaning |
| --- | --- | --- |
${rows.join("\n")}
`;
const out = fileURLToPath(new URL("../docs/errors.md", import.meta.url));
writeFileSync(out, doc);
// the formatter pads the table; run it here so `pnpm lint` stays clean after regenerating
execFileSync("biome", ["format", "--write", out], { stdio: "inherit" });
