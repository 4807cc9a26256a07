// Public API of @moeswarm/shard.
export {
  GGML_TYPES,
  GgmlType,
  ggmlRowBytes,
  ggmlTensorBytes,
  ggmlTypeName,
  ggmlTypeTraits,
  isGgmlType,
  type GgmlTypeTraits,
} from "./ggml-type.js";
