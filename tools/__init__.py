"""Tools around the broker that are not the daemon: the live demo, the trace replay, and the
launcher that starts a broker and waits for it (used by them, the benchmarks and the tests)."""
