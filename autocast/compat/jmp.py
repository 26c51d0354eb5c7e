"""jmp 0.0.4's API on autocast: `import autocast.compat.jmp as jmp`.

Every name jmp exports (`Policy`, `get_policy`, `cast_to_full`, `cast_to_half`,
`half_dtype`, `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`,
`LossScale`, `all_finite`, `select_tree`) plus the helpers its tests use
(`dtype_to_names`, `name_to_dtype`, `parse_dtype`), with jmp's signatures and
defaults. jmp's own test suite passes against this module (`tests/test_compat_jmp_suite.py`).

Fixed jmp bugs: the loss-scale states are Equinox modules, so `min_loss_scale` survives
`jit`/`tree_map`/checkpoints (jmp's hand-written `tree_flatten` drops it); a float16
initial scale is stored as float32 (jmp's `adjust` crashes on it); `select_tree` keeps
non-array leaves such as an Equinox module's activation function (jmp's raises); float64
leaves are not rounded to half precision when `jax_enable_x64` is on; losses are
scaled in float32, so a float16 loss times a Python scale cannot overflow; integer leaves
are never scaled; unscaled gradients keep their dtype.

Example:
    ```python
    import autocast.compat.jmp as jmp

    policy = jmp.get_policy("p=f32,c=f16,o=f32")
    loss_scale = jmp.DynamicLossScale(jnp.float32(2**15))
    ```
"""

from ._jmp_loss_scale import DynamicLossScale as DynamicLossScale
from ._jmp_loss_scale import LossScale as LossScale
from ._jmp_loss_scale import NoOpLossScale as NoOpLossScale
from ._jmp_loss_scale import StaticLossScale as StaticLossScale
from ._jmp_loss_scale import all_finite as all_finite
from ._jmp_loss_scale import select_tree as select_tree
from ._jmp_policy import Policy as Policy
from ._jmp_policy import cast_to_full as cast_to_full
from ._jmp_policy import cast_to_half as cast_to_half
from ._jmp_policy import dtype_to_names as dtype_to_names
from ._jmp_policy import get_policy as get_policy
from ._jmp_policy import half_dtype as half_dtype
from ._jmp_policy import name_to_dtype as name_to_dtype
from ._jmp_policy import parse_dtype as parse_dtype

__version__ = "0.0.4"  # the jmp release whose API this module reproduces

__all__ = (
    "all_finite",
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "select_tree",
    "StaticLossScale",
    "cast_to_full",
    "cast_to_half",
    "get_policy",
    "half_dtype",
    "Policy",
    "dtype_to_names",
    "name_to_dtype",
    "parse_dtype",
)
