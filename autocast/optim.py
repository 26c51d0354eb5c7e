"""Half-precision optimizer memory: bfloat16 parameters and optimizer state with stochastic rounding.

These names live here only (`import autocast` makes `autocast.optim` available; their
old top-level paths, `autocast.half_state` and so on, still work with a DeprecationWarning):

- `stochastic_round(tree, dtype, key)`: unbiased rounding of float32 leaves to bfloat16/float16.
- `half_state(optax.adamw(...))`: an optax wrapper that stores the moments in bfloat16.
- `to_half_params(model)` / `to_float32_params(model)`: the per-model switch between
  float32 master weights and bfloat16 + stochastic rounding (and back).
- `to_half_opt_state` / `to_float32_opt_state`: the same for an optimizer state.
- `HalfOptState`: the state of `half_state`.

Parameters stored in bfloat16 are updated with `autocast.optimizer_update(..., key=)`.
See docs/memory.md.

Example:
    ```python
    params16 = autocast.optim.to_half_params(params)
    opt = autocast.optim.half_state(optax.adamw(1e-3))
    assert isinstance(opt.init(params16), autocast.optim.HalfOptState)
    ```
"""

from ._half_optim import HalfOptState as HalfOptState
from ._half_optim import half_state as half_state
from ._half_optim import to_float32_opt_state as to_float32_opt_state
from ._half_optim import to_float32_params as to_float32_params
from ._half_optim import to_half_opt_state as to_half_opt_state
from ._half_optim import to_half_params as to_half_params
from ._stochastic import stochastic_round as stochastic_round

__all__ = [
    "HalfOptState",
    "half_state",
    "stochastic_round",
    "to_float32_opt_state",
    "to_float32_params",
    "to_half_opt_state",
    "to_half_params",
]
