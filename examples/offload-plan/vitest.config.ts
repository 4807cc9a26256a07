import { packageTests } from "../../vitest.shared.ts";

export default packageTests("example-offload-plan");
