"""Benchmarks: each runs its workload and an anchor in the same process and reports the ratio."""
