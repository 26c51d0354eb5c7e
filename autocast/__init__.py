"""jax-autocast: automatic mixed precision for JAX.

`amp(fn)` re-evaluates `fn`'s jaxpr with per-primitive casting rules (matmuls and
convolutions in float16/bfloat16, numerically sensitive operations in float32); the loss
scalers and scaled-gradient wrappers make float16 training safe. `autocast.compat`
holds drop-in versions of the jmp, MPX and jaxamp APIs; `autocast.optim` the
half-precision optimizer state (bfloat16 parameters and moments, stochastic rounding).
"""

import warnings as _warnings
from typing import Any as _Any

# The features first: they register their policy categories and rewrites (`_rules.register_category`,
# `_rewrites.register_rewrite`) before `_policy` (imported by the modules below) loads the default table.
from . import _attention, _fp8, _loss_head  # noqa: F401

# isort: split
from . import _higher_order, _hijax  # noqa: F401  (register the higher-order handlers)
from . import optim as optim
from ._amp import amp as amp
from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import restore_train_state as restore_train_state
from ._checkpoint import save_train_state as save_train_state
from ._explain import Explanation as Explanation
from ._explain import explain as explain
from ._fp8 import use_float8 as use_float8
from ._loss_scale import DynamicScalerState as DynamicScalerState
from ._loss_scale import NoOpScalerState as NoOpScalerState
from ._loss_scale import StaticScalerState as StaticScalerState
from ._loss_scale import all_finite as all_finite
from ._loss_scale import select_tree as select_tree
from ._optim import optimizer_update as optimizer_update
from ._overflow import Finding as Finding
from ._overflow import find_overflow as find_overflow
from ._policy import AmpPolicy as AmpPolicy
from ._policy import default_amp_policy as default_amp_policy
from ._policy import extend_policy as extend_policy
from ._policy import load_policy as load_policy
from ._policy import register_rule as register_rule
from ._policy import unregister_rule as unregister_rule
from ._rule_context import RuleContext as RuleContext
from ._rules import Rule as Rule
from ._rules import use_as_is as use_as_is
from ._rules import use_compute_precision as use_compute_precision
from ._rules import use_float32_precision as use_float32_precision
from ._rules import use_input_precision as use_input_precision
from ._rules import use_original_precision as use_original_precision
from ._rules import use_precision as use_precision
from ._rules import use_widest_precision as use_widest_precision
from ._scaled_grad import dynamic_scale_grad as dynamic_scale_grad
from ._scaled_grad import dynamic_scale_value_and_grad as dynamic_scale_value_and_grad
from ._scope import amp_stop as amp_stop

__version__ = "0.1.0"

__all__ = [
    "AmpPolicy",
    "CheckpointError",
    "DynamicScalerState",
    "Explanation",
    "Finding",
    "NoOpScalerState",
    "Rule",
    "RuleContext",
    "StaticScalerState",
    "all_finite",
    "amp",
    "amp_stop",
    "default_amp_policy",
    "dynamic_scale_grad",
    "dynamic_scale_value_and_grad",
    "explain",
    "extend_policy",
    "find_overflow",
    "load_policy",
    "optimizer_update",
    "register_rule",
    "restore_train_state",
    "save_train_state",
    "select_tree",
    "unregister_rule",
    "use_as_is",
    "use_compute_precision",
    "use_float8",
    "use_float32_precision",
    "use_input_precision",
    "use_original_precision",
    "use_precision",
    "use_widest_precision",
    "__version__",
]


# Names that moved to ``autocast.optim``: still reachable here, with a DeprecationWarning,
# until they are removed (not in ``__all__``, not documented).
_MOVED_TO_OPTIM = frozenset(optim.__all__)


def __getattr__(name: str) -> _Any:
    if name in _MOVED_TO_OPTIM:
        _warnings.warn(
            f"autocast.{name} is deprecated and will be removed; use autocast.optim.{name}.",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(optim, name)
    raise AttributeError(f"module 'autocast' has no attribute {name!r}")
