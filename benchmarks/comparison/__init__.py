"""How does it compare with MPX, jmp and jaxamp? The ViT training step, system against system."""
