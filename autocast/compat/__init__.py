"""Drop-in replacements for other JAX mixed-precision libraries, built on autocast.

Nothing is imported here; import the submodule for the library you are migrating from:

- `autocast.compat.jmp`: the API of jmp 0.0.4 (`import autocast.compat.jmp as jmp`).
- `autocast.compat.mpx`: the API of MPX (`import autocast.compat.mpx as mpx`).
- `autocast.compat.jaxamp`: the API of jaxamp 0.0.4 (`import autocast.compat.jaxamp as jaxamp`).

Each keeps its library's names, signatures and defaults, routes the work to autocast's
casting and loss-scaling code, and fixes that library's known bugs; the docs page "Loss scaling" (docs/loss-scaling.md,
"Differences from jaxamp, MPX and jmp") and the migration guides list every difference.
"""
