// The hub's HTTP API client is relay-client's HubClient (shared with the worker runtime): one
// undici Agent per link (kept-alive long-polls and reports, a self-hosted hub's CA as
// `connect.ca`), typed errors, one rule for what is worth retrying. These names are the link's.
export {
  type HubCa,
  HubClient as HubHttp,
  type HubClientOptions as HubHttpOptions,
  type HubRequestOptions,
  type HubResponse,
  type HubToken,
  isTransient,
  tokenValue,
} from "@moeswarm/relay-client";
