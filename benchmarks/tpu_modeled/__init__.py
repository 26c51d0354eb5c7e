"""What would a TPU run, without one? Train steps compiled for a TPU v5e/v6e (libtpu, deviceless), not measured."""
