"""What would a GPU run, without one? Steps compiled for an H100 target and their roofline model."""
