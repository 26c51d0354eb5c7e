"""Many devices: bytes on the wire and weight-gradient error against the device count."""
