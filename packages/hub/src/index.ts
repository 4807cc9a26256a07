// Public API of @moeswarm/hub: nothing is exported until its work lands.
export {};
