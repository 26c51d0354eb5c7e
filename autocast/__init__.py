"""jax-autocast: automatic mixed precision for JAX."""

__version__ = "0.1.0"

__all__ = ["__version__"]
