// Public API of @moeswarm/relay-client: nothing is exported until its work lands.
export {};
