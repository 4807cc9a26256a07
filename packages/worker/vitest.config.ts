import { packageTests } from "../../vitest.shared.ts";

export default packageTests("worker");
