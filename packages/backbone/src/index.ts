// Public API of @moeswarm/backbone: nothing is exported until its work lands.
export {};
