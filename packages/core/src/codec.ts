// Encoding goes through msgpackr (its no-eval build: no `new Function`, no native addon loaded at
// import, module state of its own), configured so that it emits plain msgpack in the canonical form
// of docs/protocol.md (verified byte for byte by the tests): no records (`useRecords: false`, which
// also makes 0x40-0x7f positive fixints), no float32 (`useFloat32: 0`), the smallest map header
// (`variableMapSize`), no bundled strings or structured clone. msgpackr writes the smallest int
// for values in [-2^31, 2^32) and float64 for any other number, so the other safe integers are
// handed to it as BigInt (int64) and the header of a non-negative one is then turned into uint64.
// Frames with tensors (dispatch, result) do not go through msgpackr: codec-write.ts writes their
// numbers, strings and booleans in that same canonical form straight into the frame's memory, each
// tensor copied once (the tests hold both writers to @msgpack/msgpack's bytes).
//
// Decoding does not use msgpackr: its unpacker also accepts msgpackr's own extensions (a record
// definition changes what later bytes 0x40-0x7f mean; other ext types build Sets, Errors,
// RegExps, typed arrays), materialises every value of the map, unknown keys included, before a
// caller could check it, and returns float64 1.0 and uint 1 alike. The strict reader in
// msgpack-read.ts checks each declared length against the bytes present, skips unknown keys
// without allocating, and keeps msgpack's type families apart.

export { type DecodeOptions, decodeFrame } from "./codec-decode.js";
export {
  canonicalKeys,
  type EncodableFrame,
  type EncodeOptions,
  encodeFrame,
  encodeFrameWithPrefixSpace,
  FrameEncoder,
  type InPlaceTensor,
  type ResultInPlace,
} from "./codec-encode.js";
export { FrameRerouter, type RoutePatch, rerouteFrame } from "./codec-route.js";
export { validateFrame } from "./codec-validate.js";
