import { packageTests } from "../../vitest.shared.ts";

// the arm64 participant runs under qemu-user: minutes, not seconds
export default packageTests("example-phone-worker", { testTimeout: 600_000 });
