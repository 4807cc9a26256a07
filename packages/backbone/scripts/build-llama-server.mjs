#!/usr/bin/env node
// Builds llama-server (CPU) from the pinned llama.cpp source in a few minutes instead of ~26: only
// the server's own sources (tools/server, tools/mtmd, cpp-httplib, an asset-less web UI) are
// compiled; libllama, libggml*, libllama-common and the CPU backends are the ones node-llama-cpp@3.21.1
// ships, built from the same commit (its release tag is checked), so the plugin and every test see
// exactly one llama.cpp. Output: .cache/llama-server-<commit>/bin/{llama-server, lib*.so} with run
// path $ORIGIN; nothing else on the machine is touched. Rebuilds only when the commit changes.
//
//   node packages/backbone/scripts/build-llama-server.mjs [--jobs N] [--force] [--json]
import { execFileSync, spawnSync } from "node:child_process";
import {
  copyFileSync,
  existsSync,
  mkdirSync,
  readdirSync,
  readFileSync,
  rmSync,
  writeFileSync,
} from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import { LLAMA_CPP_COMMIT, LLAMA_CPP_TAG, llamaSourceDir } from "../../../tools/llama-source.mjs";

const root = resolve(dirname(fileURLToPath(import.meta.url)), "../../..");
const args = process.argv.slice(2);
const json = args.includes("--json");
const force = args.includes("--force");
const jobsAt = args.indexOf("--jobs");
const jobs = jobsAt >= 0 ? Number(args[jobsAt + 1]) : Number(process.env.MOESWARM_NATIVE_JOBS ?? 2);
if (args.includes("--help")) {
  process.stdout.write(
    "build-llama-server: builds llama-server from the pinned llama.cpp against node-llama-cpp's libraries\n" +
      "  --jobs N   parallel compile jobs (default MOESWARM_NATIVE_JOBS or 2)\n" +
      "  --force    rebuild even if the cache is complete\n" +
      "  --json     print {bin, seconds, cached} on stdout\n",
  );
  process.exit(0);
}

export const cacheDir = join(root, ".cache", `llama-server-${LLAMA_CPP_COMMIT.slice(0, 12)}`);
const binDir = join(cacheDir, "bin");
const log = (line) => process.stderr.write(`build-llama-server: ${line}\n`);

/** node-llama-cpp's prebuilt CPU binaries for this platform (the same ones the addon loads). */
function nodeLlamaBins() {
  const platform = `${process.platform}-${process.arch}`;
  for (const from of ["packages/backbone", "packages/worker-native", "packages/shard"]) {
    const dir = join(
      root,
      from,
      "node_modules",
      "node-llama-cpp",
      "node_modules",
      "@node-llama-cpp",
      platform,
      "bins",
      platform,
    );
    if (existsSync(dir)) return dir;
  }
  const store = join(root, "node_modules", ".pnpm");
  for (const entry of existsSync(store) ? readdirSync(store) : []) {
    if (!entry.startsWith(`@node-llama-cpp+${platform}@3.21.1`)) continue;
    const dir = join(store, entry, "node_modules", "@node-llama-cpp", platform, "bins", platform);
    if (existsSync(dir)) return dir;
  }
  throw new Error(`node-llama-cpp's ${platform} binaries are not installed: run \`pnpm install\` first`);
}

function cmakeLists(src, bins) {
  const s = (p) => join(src, p).replaceAll("\\", "/");
  const mtmdSources = readFileSync(join(src, "tools/mtmd/CMakeLists.txt"), "utf8")
    .match(/add_library\(mtmd\s+([\s\S]*?)\)/)[1]
    .split(/\s+/)
    .filter((f) => f.endsWith(".cpp"))
    .map((f) => s(`tools/mtmd/${f}`));
  const server = [
    "server-chat",
    "server-task",
    "server-queue",
    "server-common",
    "server-context",
    "server-stream",
    "server-tools",
    "server-mcp",
    "server-schema",
    "server",
    "server-http",
    "server-models",
    "main",
  ].map((f) => s(`tools/server/${f}.cpp`));
  return `cmake_minimum_required(VERSION 3.18)
project(moeswarm-llama-server CXX C)
set(CMAKE_CXX_STANDARD 17)
set(CMAKE_POSITION_INDEPENDENT_CODE ON)
find_package(Threads REQUIRED)
# node-llama-cpp's libraries, imported by file; the executable finds them beside itself ($ORIGIN)
foreach(lib llama:libllama.v0.4.0.so ggml:libggml.v0.4.0.so ggml-base:libggml-base.so llama-common:libllama-common.so)
  string(REPLACE ":" ";" pair "\${lib}")
  list(GET pair 0 name)
  list(GET pair 1 file)
  add_library(\${name} SHARED IMPORTED)
  set_target_properties(\${name} PROPERTIES IMPORTED_LOCATION "${bins}/\${file}" IMPORTED_NO_SONAME OFF)
endforeach()
set(INC "${s("include")}" "${s("ggml/include")}" "${s("common")}" "${s("vendor")}" "${s("tools/mtmd")}" "${s("tools/server")}" "${s(".")}")
# the same public definitions libllama-common was built with (LLAMA_SUBPROCESS changes a struct)
set(DEFS LLAMA_SUBPROCESS LLAMA_SHARED GGML_SHARED)

add_executable(llama-ui-embed "${s("tools/ui/embed.cpp")}")
add_custom_command(OUTPUT \${CMAKE_BINARY_DIR}/ui/ui.cpp \${CMAKE_BINARY_DIR}/ui/ui.h
  COMMAND \${CMAKE_COMMAND} -DUI_SOURCE_DIR=${s("tools/ui")}-absent -DUI_BINARY_DIR=\${CMAKE_BINARY_DIR}/ui
    -DLLAMA_SOURCE_DIR=${s(".")} -DHF_ENABLED=OFF -DBUILD_UI=OFF -DLLAMA_UI_EMBED=$<TARGET_FILE:llama-ui-embed>
    -DLLAMA_UI_GZIP=ON -P "${s("scripts/ui-assets.cmake")}"
  DEPENDS llama-ui-embed)

# vendor/hash (mtmd's file hashes): sha1 is compiled as C++ (it lives in a namespace)
add_library(vendor-hash STATIC "${s("vendor/hash/hash.cpp")}" "${s("vendor/hash/xxhash/xxhash.c")}"
  "${s("vendor/hash/sha1/sha1.c")}" "${s("vendor/hash/sha256/sha256.c")}")
set_source_files_properties("${s("vendor/hash/sha1/sha1.c")}" PROPERTIES LANGUAGE CXX)
target_include_directories(vendor-hash PRIVATE "${s("vendor/hash")}" "${s("vendor")}")
target_compile_options(vendor-hash PRIVATE -w)

add_library(mtmd STATIC ${mtmdSources.join(" ")})
target_include_directories(mtmd PRIVATE \${INC})
target_compile_definitions(mtmd PRIVATE \${DEFS} MTMD_VIDEO)
target_compile_options(mtmd PRIVATE -w)

add_executable(llama-server ${server.join(" ")} "${s("vendor/cpp-httplib/httplib.cpp")}" \${CMAKE_BINARY_DIR}/ui/ui.cpp)
target_include_directories(llama-server PRIVATE \${INC} \${CMAKE_BINARY_DIR}/ui)
target_compile_definitions(llama-server PRIVATE \${DEFS} CPPHTTPLIB_FORM_URL_ENCODED_PAYLOAD_MAX_LENGTH=1048576
  CPPHTTPLIB_LISTEN_BACKLOG=512 CPPHTTPLIB_REQUEST_URI_MAX_LENGTH=32768 CPPHTTPLIB_TCP_NODELAY=1)
target_compile_options(llama-server PRIVATE -w)
target_link_libraries(llama-server PRIVATE mtmd vendor-hash llama-common llama ggml ggml-base Threads::Threads)
set_target_properties(llama-server PROPERTIES BUILD_RPATH "\\$ORIGIN" INSTALL_RPATH "\\$ORIGIN" BUILD_WITH_INSTALL_RPATH ON)
`;
}

function checkRelease(bins) {
  const meta = JSON.parse(readFileSync(join(bins, "_nlcBuildMetadata.json"), "utf8"));
  const release = meta.buildOptions?.llamaCpp?.release;
  if (release !== LLAMA_CPP_TAG) {
    throw new Error(
      `node-llama-cpp's binaries are llama.cpp ${release}, the pinned source is ${LLAMA_CPP_TAG}: reinstall node-llama-cpp@3.21.1`,
    );
  }
}

export function buildLlamaServer() {
  const started = Date.now();
  const exe = join(binDir, "llama-server");
  if (!force && existsSync(join(cacheDir, ".complete"))) return { bin: exe, seconds: 0, cached: true };
  const src = llamaSourceDir();
  const bins = nodeLlamaBins();
  checkRelease(bins);
  const work = join(cacheDir, "build");
  mkdirSync(work, { recursive: true });
  rmSync(join(cacheDir, ".complete"), { force: true });
  writeFileSync(join(work, "CMakeLists.txt"), cmakeLists(src, bins));
  const run = (cmd, argv) => {
    log(`${cmd} ${argv.join(" ")}`);
    const r = spawnSync("nice", [cmd, ...argv], { stdio: ["ignore", process.stderr, process.stderr] });
    if (r.status !== 0) throw new Error(`${cmd} failed (exit ${r.status}); the output above says why`);
  };
  const generator = spawnSync("ninja", ["--version"]).status === 0 ? ["-G", "Ninja"] : [];
  run("cmake", ["-S", work, "-B", join(work, "out"), ...generator, "-DCMAKE_BUILD_TYPE=Release", "-Wno-dev"]);
  run("cmake", ["--build", join(work, "out"), "--target", "llama-server", "-j", String(jobs)]);
  mkdirSync(binDir, { recursive: true });
  for (const f of readdirSync(bins)) if (f.endsWith(".so")) copyFileSync(join(bins, f), join(binDir, f));
  copyFileSync(join(work, "out", "llama-server"), exe);
  execFileSync("chmod", ["+x", exe]);
  writeFileSync(join(cacheDir, ".complete"), `${LLAMA_CPP_COMMIT}\n`);
  return { bin: exe, seconds: Math.round((Date.now() - started) / 1000), cached: false };
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  try {
    const result = buildLlamaServer();
    if (json) process.stdout.write(`${JSON.stringify(result)}\n`);
    else log(result.cached ? `cached: ${result.bin}` : `built ${result.bin} in ${result.seconds} s`);
  } catch (error) {
    log(error instanceof Error ? error.message : String(error));
    process.exit(1);
  }
}
