"""Speed and memory benchmarks (run by hand; never timed in the test suite)."""
