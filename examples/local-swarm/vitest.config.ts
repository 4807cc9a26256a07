import { packageTests } from "../../vitest.shared.ts";

export default packageTests("example-local-swarm", { testTimeout: 240_000 });
