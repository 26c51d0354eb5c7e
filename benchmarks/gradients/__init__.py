"""Are the gradients accurate? Bias gradients and custom-derivative activations against float32."""
