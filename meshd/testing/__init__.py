"""What tests and benchmarks share: synthetic models, memory-capped process groups, network test hosts."""
