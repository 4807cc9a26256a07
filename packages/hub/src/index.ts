// Public API of @moeswarm/hub (the relay and its tokens; the HTTP service comes with the slicer).
export { type ListenRelayOptions, listenRelay, type RelayListener } from "./listen.js";
export {
  type BackboneInfo,
  createRelay,
  type Relay,
  type RelayOptions,
  type RelayServerEvent,
  type RelayStats,
  type SliceInfo,
  type WorkerInfo,
} from "./relay.js";
export {
  checkSecret,
  type MintTokenOptions,
  mintToken,
  type TokenClaims,
  type TokenRole,
  type TokenSecret,
  type VerifyTokenOptions,
  verifyToken,
} from "./token.js";
