"""Save and restore a whole train state with Orbax, checked leaf by leaf against a template.

A train state is any pytree: the model or parameters (in their dtypes), the optimizer
state (a `HalfOptState` included), a loss-scaler state, PRNG keys, a step counter. The
checkpoint is an Orbax composite of two items: `arrays` (every array leaf, PRNG keys as
their key data) and `meta` (JSON: each leaf's path, kind, dtype, shape and CRC-32, and the
values of Python-number leaves). `restore_train_state(path, like)` compares that record
with `like` before reading any array, and the CRC-32s after, so a checkpoint of another
model, mode or dtype raises an error naming the leaf, and a damaged one an error naming
the checkpoint; nothing is cast silently.

Sharp edges:

- Non-array leaves that are not Python numbers (activation functions, strings) and the
  static configuration of modules (a scaler's `patience`) are not saved: they come from
  `like`.
- Switching modes (float32 master <-> bfloat16 + stochastic rounding) is explicit:
  restore with a `like` of the saved mode, then convert with `to_half_params` /
  `to_half_opt_state` or `to_float32_params` / `to_float32_opt_state`.
- Checksums are computed for arrays that this process holds entirely (not for arrays
  sharded across processes).
"""

from __future__ import annotations

import os
import zlib
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["restore_train_state", "save_train_state"]

_FORMAT = "autocast-train-state"
_VERSION = 1
_CONVERT_HINT = (
    "to continue a float32-master checkpoint in bfloat16 (or back), restore it with a `like` "
    "of the saved mode, then convert with autocast.to_half_params / to_half_opt_state "
    "(or to_float32_params / to_float32_opt_state)"
)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not match the template it is restored into."""


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # an optional dependency
        raise ImportError(
            "save_train_state / restore_train_state need orbax-checkpoint: pip install 'jax-autocast[checkpoint]'."
        ) from e
    return ocp


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _describe(path: Any, x: Any) -> dict[str, Any]:
    """The record of one leaf: its path, kind and, for arrays, dtype and shape."""
    entry: dict[str, Any] = {"path": jax.tree_util.keystr(path)}
    if _is_key(x):
        entry.update(kind="key", impl=str(jax.random.key_impl(x)), shape=list(x.shape))
    elif eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        entry.update(kind="array", dtype=np.dtype(x.dtype).name, shape=list(x.shape))
    elif isinstance(x, bool | int | float):
        entry.update(kind="python", type=type(x).__name__)
    else:
        entry.update(kind="static", type=type(x).__name__)
    return entry


def _what(entry: dict[str, Any]) -> str:
    if entry["kind"] == "key":
        return f"a PRNG key array ({entry['impl']}) of shape {tuple(entry['shape'])}"
    if entry["kind"] == "array":
        return f"{entry['dtype']}{list(entry['shape'])}"
    return f"a Python {entry['type']}"


def _crc(x: Any) -> int | None:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    return zlib.crc32(np.ascontiguousarray(np.asarray(x)).tobytes())


def save_train_state(path: str | os.PathLike, state: Any, *, overwrite: bool = False) -> None:
    """Save a whole train state (any pytree) to the directory `path` with Orbax.

    Array leaves keep their dtypes (bfloat16 parameters stay bfloat16), PRNG keys are
    saved as their key data and implementation, Python numbers as values, and every leaf's
    path, dtype, shape and CRC-32 are recorded for `restore_train_state` to check. The save
    is atomic: Orbax writes to a temporary directory and renames it when complete.

    **Arguments:**

    - `path`: the checkpoint directory (created; it must not exist unless `overwrite`).
    - `state`: the train state, e.g. `(model, opt_state, scaler_state, key, step)`.
    - `overwrite`: replace an existing checkpoint at `path`.

    **Returns:** None.

    Example:

    ```python
    import tempfile

    state = {"params": params, "opt_state": opt_state, "scaler": autocast.DynamicScalerState(), "key": jax.random.key(0)}
    path = tempfile.mkdtemp() + "/step_100"
    autocast.save_train_state(path, state)
    restored = autocast.restore_train_state(path, like=state)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), restored["params"], state["params"]))
    ```
    """
    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"save_train_state: `path` {path!r} exists; pass overwrite=True to replace it.")
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    arrays: dict[str, Any] = {}
    records = []
    for i, (p, x) in enumerate(leaves):
        entry = _describe(p, x)
        if entry["kind"] in ("array", "key"):
            data = jax.random.key_data(x) if entry["kind"] == "key" else jnp.asarray(x)
            arrays[f"leaf_{i}"] = data
            entry["crc32"] = _crc(data)
        elif entry["kind"] == "python":
            entry["value"] = x
        records.append(entry)
    meta = {"format": _FORMAT, "version": _VERSION, "leaves": records}
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    checkpointer.save(
        path,
        args=ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)),
        force=overwrite,
    )


def _read_meta(ocp: Any, path: str) -> dict[str, Any]:
    try:
        meta = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
        )["meta"]
    except Exception as e:  # Orbax and tensorstore raise many kinds
        raise CheckpointError(
            f"restore_train_state: cannot read the checkpoint record at {path!r} "
            f"(not a save_train_state checkpoint, or truncated/corrupted): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("leaves"), list):
        raise CheckpointError(
            f"restore_train_state: {path!r} is not a save_train_state checkpoint (its record is {str(meta)[:200]!r})."
        )
    if meta.get("version") != _VERSION:
        raise CheckpointError(
            f"restore_train_state: {path!r} has format version {meta.get('version')!r}; this autocast reads {_VERSION}."
        )
    return meta


def _check_against(saved: list[dict[str, Any]], wanted: list[dict[str, Any]], path: str) -> None:
    saved_paths = [e["path"] for e in saved]
    wanted_paths = [e["path"] for e in wanted]
    if saved_paths != wanted_paths:
        missing = [p for p in wanted_paths if p not in set(saved_paths)]
        extra = [p for p in saved_paths if p not in set(wanted_paths)]
        detail = []
        if missing:
            detail.append(f"in `like` but not in the checkpoint: {', '.join(missing[:8])}")
        if extra:
            detail.append(f"in the checkpoint but not in `like`: {', '.join(extra[:8])}")
        if not detail:
            detail.append("the same leaves in another order")
        raise CheckpointError(
            f"restore_train_state: the checkpoint at {path!r} has another structure than `like` "
            f"({len(saved_paths)} leaves saved, {len(wanted_paths)} in `like`; {'; '.join(detail)}); {_CONVERT_HINT}."
        )
    for s, w in zip(saved, wanted):
        same = s["kind"] == w["kind"] and all(
            s.get(k) == w.get(k) for k in ("dtype", "shape", "impl", "type") if w["kind"] != "static"
        )
        if not same:
            hint = f"; {_CONVERT_HINT}" if s.get("dtype") != w.get("dtype") else ""
            raise CheckpointError(
                f"restore_train_state: leaf `{w['path']}` is {_what(s)} in the checkpoint at {path!r} "
                f"but {_what(w)} in `like`; nothing is cast on restore{hint}."
            )


def restore_train_state(path: str | os.PathLike, like: Any) -> Any:
    """Restore a train state saved by `save_train_state`, checked against the template `like`.

    Every leaf's path, dtype and shape must match `like`'s (a clear error names the first
    leaf that differs: nothing is cast); the arrays' CRC-32s must match the recorded ones
    (a truncated or corrupted checkpoint raises). Arrays are placed with the sharding of
    `like`'s arrays. Non-array leaves and static configuration come from `like`.

    **Arguments:**

    - `path`: the checkpoint directory.
    - `like`: a train state of the same structure, dtypes and shapes (e.g. a freshly
      initialised one, or `jax.eval_shape` of its constructor).

    **Returns:** the restored train state, with `like`'s tree structure.

    **Raises:** `FileNotFoundError` if there is no checkpoint at `path`; a `ValueError`
    (`CheckpointError`) naming the leaf that differs from `like`, or the checkpoint that
    cannot be read.

    Example:

    ```python
    import tempfile

    path = tempfile.mkdtemp() + "/ckpt"
    autocast.save_train_state(path, {"params": params, "step": 3})
    try:  # a bfloat16 template for a float32 checkpoint: an error, no silent cast
        autocast.restore_train_state(path, {"params": autocast.to_half_params(params), "step": 0})
    except ValueError as e:
        assert "leaf `['params']['w1']` is float32[4, 16] in the checkpoint" in str(e)
    assert autocast.restore_train_state(path, {"params": params, "step": 0})["step"] == 3
    ```
    """
    ocp = _orbax()
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"restore_train_state: no checkpoint at {path!r} (a save that did not finish leaves only a temporary directory)."
        )
    meta = _read_meta(ocp, path)
    like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    wanted = [_describe(p, x) for p, x in like_leaves]
    _check_against(meta["leaves"], wanted, path)

    abstract = {}
    for i, ((_, x), entry) in enumerate(zip(like_leaves, wanted)):
        if entry["kind"] in ("array", "key"):
            sharding = getattr(x, "sharding", None)
            shape_dtype = jax.eval_shape(jax.random.key_data, x) if entry["kind"] == "key" else x
            abstract[f"leaf_{i}"] = jax.ShapeDtypeStruct(shape_dtype.shape, shape_dtype.dtype, sharding=sharding)
    try:
        arrays = ocp.Checkpointer(ocp.CompositeCheckpointHandler()).restore(
            path, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(abstract))
        )["arrays"]
    except Exception as e:
        raise CheckpointError(
            f"restore_train_state: cannot read the arrays of the checkpoint at {path!r} "
            f"(truncated or corrupted?): {type(e).__name__}: {e}"
        ) from e

    out = []
    for i, ((_, x), saved) in enumerate(zip(like_leaves, meta["leaves"])):
        kind = saved["kind"]
        if kind in ("array", "key"):
            data = arrays.get(f"leaf_{i}")
            if data is None:
                raise CheckpointError(f"restore_train_state: leaf `{saved['path']}` is missing from {path!r}.")
            crc = saved.get("crc32")
            if crc is not None and _crc(data) != crc:
                raise CheckpointError(
                    f"restore_train_state: leaf `{saved['path']}` in {path!r} does not match its recorded "
                    "checksum (the checkpoint is corrupted)."
                )
            out.append(jax.random.wrap_key_data(data, impl=jax.random.key_impl(x)) if kind == "key" else data)
        elif kind == "python":
            out.append(type(x)(saved["value"]))
        else:
            out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
