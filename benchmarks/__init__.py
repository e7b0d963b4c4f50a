"""XLA-profiled benchmarks, each run side by side with the PyTorch reference."""
