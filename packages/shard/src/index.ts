// Public API of @moeswarm/shard.
export {
  GGML_TYPES,
  GgmlType,
  type GgmlTypeTraits,
  ggmlRowBytes,
  ggmlTensorBytes,
  ggmlTypeName,
  ggmlTypeTraits,
  isGgmlType,
} from "./ggml-type.js";
