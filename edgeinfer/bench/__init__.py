"""Benchmarks: ours against a peer measured in the same run; medians and ratios."""
