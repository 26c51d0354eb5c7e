"""The corpus lane's setup, before any test module imports its library.

Codegen-only XLA options for every compilation (the models' own ``init`` included): XLA's
HLO passes (fusion, algebraic simplification, layout) still run, only LLVM's backend
optimisation is lowered, as tests/test_models_equinox.py does for its training steps.
Compile time dominates for these tiny models: Gemma's ``init`` compiles in 12 s instead
of 3.5 min on a loaded 2-core machine. Keras uses its JAX backend.
"""

import os

FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()
os.environ.setdefault("KERAS_BACKEND", "jax")
