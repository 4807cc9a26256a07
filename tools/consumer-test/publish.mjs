// The consumer test's publish: `pnpm release` minus its build (changeset version --snapshot and
// changeset publish), in a copy of the repository, to the loopback registry.
import {
  cpSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  statSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { basename, dirname, join } from "node:path";
import { fail, log, PNPM, publishedPackages, root, sh } from "./common.mjs";

/**
 * A copy of what `changeset version` and `changeset publish` read and write: the root manifests and
 * .changeset/, every package without its node_modules and build folders (dist/, prebuilds/ and the
 * staged platform binaries included), the private workspace members' manifests, and links from
 * each package's node_modules/@moeswarm/* to the copies (pnpm reads the workspace versions there
 * when it turns workspace:* into versions). The repository's files stay as they are.
 */
function releaseSandbox(work) {
  const dir = join(work, "release");
  for (const f of [
    "package.json",
    "pnpm-workspace.yaml",
    "pnpm-lock.yaml",
    ".changeset",
    "tools/prepack.mjs",
  ]) {
    cpSync(join(root, f), join(dir, f), { recursive: true });
  }
  symlinkSync(join(root, "node_modules"), join(dir, "node_modules"));
  const skip = new Set(["node_modules", "build", ".turbo", "test", "native", "src"]);
  for (const name of readdirSync(join(root, "packages"))) {
    const from = join(root, "packages", name);
    cpSync(from, join(dir, "packages", name), {
      recursive: true,
      filter: (src) => dirname(src) !== from || !skip.has(basename(src)),
    });
  }
  // every package in the snapshot, whatever changesets the repository holds now (none, right
  // after a release): an unversioned package would publish its plain version instead
  const names = publishedPackages().map(({ pkg }) => `"${pkg.name}": patch`);
  writeFileSync(
    join(dir, ".changeset", "consumer-test-snapshot.md"),
    `---\n${names.join("\n")}\n---\n\nThe consumer test's snapshot of every package.\n`,
  );
  for (const group of ["examples", "bench"]) {
    const manifests =
      group === "bench" ? ["bench"] : readdirSync(join(root, group)).map((n) => join(group, n));
    for (const m of manifests) {
      if (!existsSync(join(root, m, "package.json"))) continue;
      mkdirSync(join(dir, m), { recursive: true });
      cpSync(join(root, m, "package.json"), join(dir, m, "package.json"));
    }
  }
  for (const name of readdirSync(join(dir, "packages"))) {
    const pkg = JSON.parse(readFileSync(join(dir, "packages", name, "package.json"), "utf8"));
    const deps = ["dependencies", "optionalDependencies", "peerDependencies", "devDependencies"]
      .flatMap((f) => Object.keys(pkg[f] ?? {}))
      .filter((d) => d.startsWith("@moeswarm/"));
    for (const dep of new Set(deps)) {
      const link = join(dir, "packages", name, "node_modules", dep);
      mkdirSync(dirname(link), { recursive: true });
      symlinkSync(join("..", "..", "..", dep.slice("@moeswarm/".length)), link);
    }
  }
  return dir;
}

/**
 * Publishes every package as `pnpm release` does, minus its build: in a copy of the repository,
 * `changeset version --snapshot ci` and `changeset publish --tag ci` (tools/release.mjs's own
 * versionAndPublish, so pnpm publish with each package's prepack), to the loopback registry. Then
 * fetches each published tarball back (npm pack) to list it and check its run bits. Returns the
 * snapshot version and the tarballs.
 */
export async function changesetPublish(work, registry, token) {
  const sandbox = releaseSandbox(work);
  const host = new URL(registry).host;
  const npmrc = join(work, "publish.npmrc");
  writeFileSync(npmrc, `//${host}/:_authToken=${token}\nregistry=${registry}\n`);
  writeFileSync(join(sandbox, ".npmrc"), `//${host}/:_authToken=${token}\n`);
  // changesets runs `pnpm publish`: the pinned pnpm (from npx's cache, found before the registry
  // is pointed at verdaccio, which has no pnpm) under that name
  const bin = join(work, "pnpm-bin");
  mkdirSync(bin);
  const pnpm = sh("npm", ["exec", "-y", `--package=${PNPM[1]}`, "-c", "command -v pnpm"]).trim();
  symlinkSync(pnpm, join(bin, "pnpm"));
  const env = {
    ...process.env,
    PATH: `${bin}:${process.env.PATH}`,
    npm_config_registry: registry,
    npm_config_userconfig: npmrc,
    MOESWARM_PREPACK_BUILT: "1",
  };
  const { versionAndPublish } = await import("../release.mjs");
  const t = performance.now();
  versionAndPublish({ cwd: sandbox, env, snapshot: "ci" });
  const pkgs = publishedPackages().map(({ dir }) => ({
    dir,
    pkg: JSON.parse(readFileSync(join(sandbox, "packages", basename(dir), "package.json"), "utf8")),
  }));
  const versions = new Set(pkgs.map(({ pkg }) => pkg.version));
  if (versions.size !== 1 || !/^0\.0\.0-ci-\d+$/.test([...versions][0]))
    fail(
      `changeset version --snapshot ci gave versions ${[...versions].join(", ")}, not one 0.0.0-ci-<datetime>`,
    );
  const version = [...versions][0];
  log(`changeset version --snapshot + publish: ${((performance.now() - t) / 1000).toFixed(0)} s`);
  const tarDir = join(work, "tarballs");
  mkdirSync(tarDir);
  const specs = pkgs.map(({ pkg }) => `${pkg.name}@${version}`);
  sh("npm", ["pack", ...specs, "--pack-destination", tarDir], { env, cwd: work });
  const tarballs = pkgs.map(({ pkg }) => {
    const file = join(tarDir, `${pkg.name.slice(1).replace("/", "-")}-${version}.tgz`);
    if (!existsSync(file)) fail(`npm pack ${pkg.name}@${version} wrote no ${file}`);
    const executables = pkg.publishConfig?.executableFiles ?? [];
    return { name: pkg.name, file, size: statSync(file).size, executables };
  });
  for (const t of tarballs) checkModes(t);
  return { version, tarballs };
}

/** The executables keep their run bit inside the tarball (pnpm drops it unless told). */
function checkModes(t) {
  const listing = sh("tar", ["tvzf", t.file]);
  for (const exe of t.executables) {
    const line = listing.split("\n").find((l) => l.endsWith(`package/${exe}`));
    if (!line) fail(`${t.name}: ${exe} is not in ${basename(t.file)}`);
    if (!line.startsWith("-rwxr-xr-x")) fail(`${t.name}: ${exe} is packed without its run bit: ${line}`);
  }
}
