"""`amp_stop`: a region in which every operation keeps its traced precision."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

import jax

from ._policy import AMP_STOP

F = TypeVar("F", bound=Callable[..., Any])


@overload
def amp_stop(fn: None = None) -> contextlib.AbstractContextManager[None]: ...
@overload
def amp_stop(fn: F) -> F: ...
def amp_stop(fn: Callable[..., Any] | None = None) -> Any:
    """Switch mixed precision off for a region: a context manager or a decorator.

    Every operation traced inside (including inside nested `jit`, `scan`, `cond`
    and `checkpoint` bodies) runs in the dtypes it was traced with, whatever the policy.
    It is the named scope `"amp_stop"`, so it costs nothing outside `autocast.amp`.

    Args:
        fn: A function to run with mixed precision off; without it, `amp_stop()` is a
            context manager.

    Returns:
        `fn` wrapped, or (without `fn`) a context manager.

    Raises:
        TypeError: `fn` is given but not callable.

    Example:
        ```python
        @autocast.amp_stop
        def precise_matmul(x, w):
            return x @ w

        def f(params, x):
            with autocast.amp_stop():
                h = x @ params["w1"]  # float32
            return precise_matmul(jnp.tanh(h), params["w2"])  # float32 too

        assert autocast.amp(f)(params, x).dtype == jnp.float32
        ```
    """
    if fn is None:
        return jax.named_scope(AMP_STOP)
    if not callable(fn):
        raise TypeError(f"amp_stop(fn={fn!r}): fn must be callable (or omitted, for a context manager).")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with jax.named_scope(AMP_STOP):
            return fn(*args, **kwargs)

    return wrapper
