"""Benchmarks that run the real training script end to end (`python -m benchmarks.goodput`: `make goodput`)."""
