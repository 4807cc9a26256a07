// The main job (`pnpm demo`). Until the backbone and the workers land, it shows what exists:
// the packages of the workspace and what each one exports.
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";

const root = join(import.meta.dirname, "..", "..", "..");
process.stdout.write("moeswarm workspace\n\n");
for (const dir of readdirSync(join(root, "packages")).sort()) {
  const pkg = JSON.parse(readFileSync(join(root, "packages", dir, "package.json"), "utf8")) as {
    name: string;
    description: string;
  };
  const api: Record<string, unknown> = await import(pkg.name);
  const names = Object.keys(api).filter((k) => k !== "default" && k !== "module.exports");
  process.stdout.write(
    `${pkg.name}\n  ${pkg.description}\n  exports: ${names.length > 0 ? names.join(", ") : "(nothing yet)"}\n\n`,
  );
}
