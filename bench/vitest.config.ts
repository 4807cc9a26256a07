import { packageTests } from "../vitest.shared.ts";

export default packageTests("bench", { testTimeout: 420_000 });
