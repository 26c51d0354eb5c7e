"""Models and training steps shared by several benchmarks (no measurement here)."""
