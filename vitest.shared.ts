import { defineProject } from "vitest/config";

/** Per-package vitest settings: tests live in test/, long native/network work gets room. */
export function packageTests(name: string, extra: { testTimeout?: number } = {}) {
  return defineProject({
    test: {
      name,
      include: ["test/**/*.test.ts"],
      environment: "node",
      testTimeout: extra.testTimeout ?? 30_000,
      hookTimeout: 120_000,
    },
  });
}
