"""How much memory does it save? Activation residuals, optimizer state, an LSTM under scan."""
