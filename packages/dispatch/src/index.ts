// Public API of @moeswarm/dispatch: nothing is exported until its work lands.
export {};
