// Run by tools/consumer-test.mjs inside a project that installed @moeswarm/worker-native but no GPU
// build: each GPU loader this release exports (vulkanBinsDir; cudaBinsDir where present) must
// throw a MOESWARM_NATIVE_* error naming the exact line that installs node-llama-cpp's build.
const { vulkanBinsDir, cudaBinsDir } = await import("@moeswarm/worker-native");

if (typeof vulkanBinsDir !== "function") {
  console.error("@moeswarm/worker-native exports no vulkanBinsDir");
  process.exit(1);
}
const builds = [["vulkanBinsDir", vulkanBinsDir, "vulkan"]];
if (typeof cudaBinsDir === "function") builds.push(["cudaBinsDir", cudaBinsDir, "cuda"]);
for (const [f, load, gpu] of builds) {
  const line = `npm install @node-llama-cpp/linux-x64-${gpu}@3.21.1`;
  try {
    load();
    console.error(`${f}() found a build where none is installed`);
    process.exit(1);
  } catch (e) {
    if (!e.code?.startsWith("MOESWARM_NATIVE_") || !e.message.includes(line)) {
      console.error(`${f}() did not name ${line}:`, e);
      process.exit(1);
    }
  }
  console.log(`${f}: ${line}`);
}
