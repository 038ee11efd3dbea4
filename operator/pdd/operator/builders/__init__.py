"""Pure builders: spec in, Kubernetes object dict out. No I/O, no clock, no randomness."""
