"""Benchmarks behind `make bench`: each prints figures measured side by side in one run."""
