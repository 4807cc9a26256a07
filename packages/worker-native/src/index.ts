// Public API of @moeswarm/worker-native: nothing is exported until its work lands.
export {};
