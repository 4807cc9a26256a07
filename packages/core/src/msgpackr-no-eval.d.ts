// msgpackr's "index-no-eval" entry (a self-contained CJS bundle, no types of its own): the same
// Packr without `new Function`, without loading the native msgpackr-extract addon at import, and
// with module state (its working buffer) separate from any other msgpackr in the process.
declare module "msgpackr/index-no-eval" {
  export { Packr, RESERVE_START_SPACE } from "msgpackr";
}
