// Public API of @moeswarm/relay-client.
export { backoffDelay, type ReconnectOptions } from "./backoff.js";
export {
  CLOSE_AUTH,
  CLOSE_DEAD_PEER,
  CLOSE_HOSTILE,
  CLOSE_REPLACED,
  CLOSE_SHUTDOWN,
  CLOSE_SLOW_CONSUMER,
} from "./close-codes.js";
export { connectRelay } from "./connection.js";
export type {
  ConnectRelayOptions,
  DispatchAnswer,
  DispatchAnswerInto,
  DispatchHandler,
  DispatchReply,
  DispatchRequest,
  IncomingDispatch,
  RelayConnection,
  RelayEvent,
  RelayRegistration,
  RelayState,
  RequestOptions,
} from "./connection-types.js";
export {
  certificateFingerprint,
  type DirectServer,
  type DirectServerOptions,
  type DirectServerStats,
  serveDirect,
} from "./direct-server.js";
export {
  type DirectTicketClaims,
  directKeyId,
  directKeyJson,
  parseDirectKey,
  signDirectTicket,
  ticketKeyId,
  type VerifyTicketOptions,
  verifyDirectTicket,
} from "./direct-ticket.js";
export { selfSignedCertificate } from "./direct-tls.js";
export {
  type DirectLinkEvent,
  type DirectRoute,
  DirectTransport,
  type DirectTransportCounters,
  type DirectTransportOptions,
} from "./direct-transport.js";
// The hub's HTTP API client (the worker runtime's and the backbone's).
export {
  discardBody,
  type HubCa,
  HubClient,
  type HubClientOptions,
  type HubOpenOptions,
  type HubRequestOptions,
  type HubResponse,
  type HubStream,
  type HubToken,
  hubAnswerError,
  isTransient,
  networkError,
  tokenValue,
} from "./hub-client.js";
export {
  type DialOptions,
  dialWebSocket,
  type FrameDialer,
  type FrameLink,
  type FrameLinkHandlers,
  type LinkCloseInfo,
} from "./link.js";
export { RelayTransport, type RelayTransportOptions } from "./transport.js";
export { errorFromWire, errorToWire } from "./wire-errors.js";
