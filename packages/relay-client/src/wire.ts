// The frame vocabulary this package speaks: wire protocol v1 from @moeswarm/core, under the short
// names the connection code uses.
export {
  type ActivationDtype as WireDtype,
  DEFAULT_MAX_FRAME_BYTES,
  type DispatchFrame,
  type DispatchMode,
  decodeFrame,
  type EncodableFrame,
  type ErrorFrame,
  encodeFrame,
  type Frame,
  FrameEncoder,
  type HelloCaps as Caps,
  type PeerRole as Role,
  PROTOCOL_VERSION,
  type RegisterFrame,
  type ResultFrame,
  type ResultInPlace,
  relayHeadroom,
} from "@moeswarm/core";
