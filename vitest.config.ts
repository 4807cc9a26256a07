import { defineConfig } from "vitest/config";

// One vitest workspace over every package and example; each has its own vitest.config.ts.
export default defineConfig({
  test: {
    projects: ["packages/*", "examples/*", "bench"],
  },
});
