"""meshd: run a language model across machines, each daemon serving a contiguous range of layers."""
