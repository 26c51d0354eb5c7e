"""Save and restore a whole train state: Orbax for the arrays, a hashed manifest for the rest.

A train state is any pytree: the model or parameters (in their dtypes), the optimizer
state (a `HalfOptState` included), a loss-scaler state, PRNG keys, a step counter. Each
leaf gets a record: its pytree path and kind; for arrays the dtype, shape and SHA-256 of
the data; for PRNG keys the implementation (the key data are saved as an array); for
Python numbers and strings the value. `restore_train_state` compares the records with the
template `like` (concrete or shape-only) before reading any array, and checks every hash
(`_checkpoint_store`: the manifest, the atomic replace, the files), so a checkpoint of
another model, mode or dtype raises an error naming the leaf, a damaged one an error
naming the file and the leaf, and nothing is cast silently.

Sharp edges:

- Non-array leaves other than Python numbers and strings (activation functions) and the
  static configuration of modules (a scaler's `patience`) are not saved: they come from
  `like`.
- Switching modes (float32 master <-> bfloat16 + stochastic rounding) is explicit:
  restore with a `like` of the saved mode, then convert with `to_half_params` /
  `to_half_opt_state` or `to_float32_params` / `to_float32_opt_state`.
- Arrays sharded across processes are hashed file by file only (no process holds their
  data); arrays one process holds entirely, or a replica of, are also hashed leaf by leaf.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from . import _checkpoint_store as _store
from ._checkpoint_store import CheckpointError

__all__ = ["restore_train_state", "save_train_state"]

_PYTHON_TYPES = {"bool": bool, "int": int, "float": float, "str": str}
_CONVERT_HINT = (
    "to continue a float32-master checkpoint in bfloat16 (or back), restore it with a `like` "
    "of the saved mode, then convert with autocast.optim.to_half_params / to_half_opt_state "
    "(or to_float32_params / to_float32_opt_state)"
)


# --- records of leaves -------------------------------------------------------------------


def _is_key(x: Any) -> bool:
    return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _key_impl(x: Any) -> Any:
    if isinstance(x, jax.Array):
        return jax.random.key_impl(x)
    found = []  # a shape-only key: its implementation is static, read while tracing
    jax.eval_shape(lambda k: found.append(jax.random.key_impl(k)), jax.ShapeDtypeStruct(x.shape, x.dtype))
    return found[0]


def _describe(path: Any, x: Any) -> dict[str, Any]:
    """The record of one leaf (of a state or a template): its path, kind, dtype and shape."""
    entry: dict[str, Any] = {"path": jax.tree_util.keystr(path)}
    if _is_key(x):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(x.shape, x.dtype))
        entry.update(
            kind="key",
            impl=str(_key_impl(x)),
            shape=list(x.shape),
            data_dtype=np.dtype(data.dtype).name,
            data_shape=list(data.shape),
        )
    elif eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct):
        entry.update(kind="array", dtype=np.dtype(x.dtype).name, shape=list(x.shape))
    elif type(x) in _PYTHON_TYPES.values():
        entry.update(kind="python", type=type(x).__name__)
    else:
        entry.update(kind="static", type=type(x).__name__)
    return entry


def _host_bytes(x: Any) -> bytes | None:
    """The bytes of an array this process holds entirely (or a replica of); else None."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            return None
        x = x.addressable_shards[0].data
    return np.ascontiguousarray(np.asarray(x)).tobytes()


def _records(state: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every leaf's sealed record, and the arrays to save (keyed `leaf_<index>`)."""
    records, arrays = [], {}
    for i, (p, x) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"save_train_state: leaf `{jax.tree_util.keystr(p)}` of `state` is a traced value ({x}); "
                "call save_train_state outside jit/grad/vmap, on concrete arrays."
            )
        if isinstance(x, jax.ShapeDtypeStruct):
            raise TypeError(
                f"save_train_state: leaf `{jax.tree_util.keystr(p)}` of `state` is a shape-only "
                f"{x}; `state` must hold the arrays themselves (shape-only trees are for `like`)."
            )
        entry = _describe(p, x)
        if entry["kind"] in ("array", "key"):
            data = jax.random.key_data(x) if entry["kind"] == "key" else x
            arrays[f"leaf_{i}"] = data
            raw = _host_bytes(data)
            entry["data_sha256"] = None if raw is None else _store.sha(raw)
        elif entry["kind"] == "python":
            entry["value"] = x
        records.append(_store.sealed(entry))
    return records, arrays


# --- save ----------------------------------------------------------------------------------


def _as_path(path: Any, fn: str) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(
            f"{fn}: `path` must be a str or os.PathLike directory path, got {type(path).__name__} {path!r}."
        )
    if not os.fspath(path):
        raise ValueError(f"{fn}: `path` is empty; pass the checkpoint directory.")
    path = os.path.abspath(os.fspath(path))
    if os.path.basename(path) in ("", ".", ".."):
        raise ValueError(f"{fn}: `path` {path!r} names no directory to hold a checkpoint.")
    return path


def save_train_state(path: str | os.PathLike, state: Any, *, overwrite: bool = False) -> None:
    """Save a whole train state (any pytree) to the directory `path`, atomically.

    Array leaves keep their dtypes (bfloat16 parameters stay bfloat16) and are written by
    Orbax; PRNG keys (typed or legacy uint32) are saved as their key data and
    implementation; Python numbers and strings as values. `manifest.json`, written last,
    records every leaf's path, dtype and shape with SHA-256 hashes of every array, every
    Python value and every file, and is itself hashed. The new checkpoint is written to a
    sibling temporary directory, fsynced, and moved to `path` by renames: a process killed
    at any moment leaves the old or the new checkpoint, never neither, and the next save
    removes what it left.

    Args:
        path: The checkpoint directory (created; it must not exist unless `overwrite`).
        state: The train state, e.g. `(model, opt_state, scaler_state, key, step)`.
        overwrite: Replace an existing checkpoint at `path` (a directory that is not a
            checkpoint is never replaced).

    Returns:
        None.

    Raises:
        FileExistsError: A checkpoint exists at `path` and `overwrite` is False, or `path`
            exists and is not a checkpoint (then `overwrite` does not replace it).
        NotADirectoryError: `path` is a file.
        TypeError: `path` is not a `str` or `os.PathLike`, `overwrite` is not a bool, or a
            leaf of `state` is traced (inside `jit`/`grad`/`vmap`) or shape-only.
        ValueError: `path` is empty or names no directory (`"."`, `".."`).
        ImportError: `state` has array leaves and orbax-checkpoint is not installed.

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
    path = _as_path(path, "save_train_state")
    if not isinstance(overwrite, bool):
        raise TypeError(f"save_train_state: `overwrite` must be True or False, got {overwrite!r}.")
    existing = _store.locate(path, "save_train_state")
    if existing == path and not _store.replaceable(path):
        raise FileExistsError(
            f"save_train_state: `path` {path!r} exists and is not a checkpoint (no {_store.MANIFEST}); "
            "overwrite=True replaces only checkpoints: choose another path or remove it yourself."
        )
    if existing is not None and not overwrite:
        where = "" if existing == path else f" (as {existing!r}, left complete by an interrupted save)"
        raise FileExistsError(
            f"save_train_state: a checkpoint exists at `path` {path!r}{where}; pass overwrite=True to replace it."
        )
    records, arrays = _records(state)
    ocp: Any = _store.orbax() if arrays else None
    primary = jax.process_index() == 0
    ns = _store.token()
    tmp = _store.sibling(path, "new", ns)
    try:
        if primary:
            os.makedirs(tmp)
        _store.sync_processes("mkdir")
        _store.reached("started")
        if arrays:
            ocp.Checkpointer(ocp.StandardCheckpointHandler()).save(
                os.path.join(tmp, _store.ARRAYS), args=ocp.args.StandardSave(arrays)
            )
        _store.reached("arrays written")
        if primary:
            files = _store.sync_and_hash(tmp)
            _store.reached("files synced")
            body = {"format": _store.FORMAT, "version": _store.VERSION, "saved_ns": ns, "leaves": records}
            _store.write_manifest(tmp, {**body, "files": files})
            _store.reached("manifest written")
            _store.swap(tmp, path, ns)
        _store.sync_processes("done")
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _store.reached("done")


# --- restore -------------------------------------------------------------------------------


def _what(entry: dict[str, Any]) -> str:
    if entry["kind"] == "key":
        return f"a PRNG key array ({entry['impl']}) of shape {tuple(entry['shape'])}"
    if entry["kind"] == "array":
        return f"{entry['dtype']}{list(entry['shape'])}"
    return f"a Python {entry['type']}"


def _python_into_shape(saved: dict[str, Any], x: Any) -> bool:
    """A Python number saved, and `jax.eval_shape`'s abstract scalar of one in `like`."""
    if saved["kind"] != "python" or not isinstance(x, jax.ShapeDtypeStruct) or x.shape != ():
        return False
    kinds: dict[str, Any] = {"bool": jnp.bool_, "int": jnp.integer, "float": jnp.floating}
    kind = kinds.get(saved["type"])
    weak = getattr(x, "weak_type", False) or saved["type"] == "bool"
    return kind is not None and weak and jnp.issubdtype(x.dtype, kind)


def _check_against(saved: list[dict[str, Any]], like_leaves: list[Any], path: str) -> None:
    wanted = [_describe(p, x) for p, x in like_leaves]
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
    for s, w, (_, x) in zip(saved, wanted, like_leaves):
        same = s["kind"] == w["kind"] and all(
            s.get(k) == w.get(k) for k in ("dtype", "shape", "impl", "type") if w["kind"] != "static"
        )
        if not same and not _python_into_shape(s, x):
            floats = all(jnp.issubdtype(np.dtype(e.get("dtype", "bool")), jnp.floating) for e in (s, w))
            hint = f"; {_CONVERT_HINT}" if s["kind"] == w["kind"] == "array" and floats else ""
            raise CheckpointError(
                f"restore_train_state: leaf `{w['path']}` is {_what(s)} in the checkpoint at {path!r} "
                f"but {_what(w)} in `like`; nothing is cast on restore{hint}."
            )


def _read_arrays(root: str, saved: list[dict[str, Any]], like_leaves: list[Any]) -> dict[str, Any]:
    abstract = {}
    for i, (entry, (_, x)) in enumerate(zip(saved, like_leaves)):
        if entry["kind"] in ("array", "key"):
            dtype, shape = (
                (entry["data_dtype"], entry["data_shape"])
                if entry["kind"] == "key"
                else (entry["dtype"], entry["shape"])
            )
            sharding = getattr(x, "sharding", None)
            abstract[f"leaf_{i}"] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
    if not abstract:
        return {}
    ocp = _store.orbax()
    return ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(
        os.path.join(root, _store.ARRAYS), args=ocp.args.StandardRestore(abstract)
    )


def _changed_leaves(saved: list[dict[str, Any]], arrays: dict[str, Any]) -> list[str]:
    bad = []
    for i, entry in enumerate(saved):
        if entry["kind"] in ("array", "key") and entry.get("data_sha256") is not None:
            data = arrays.get(f"leaf_{i}")
            raw = None if data is None else _host_bytes(data)
            if data is None or (raw is not None and _store.sha(raw) != entry["data_sha256"]):
                bad.append(entry["path"])
    return bad


def _holds(saved: list[dict[str, Any]]) -> str:
    """What a file of Orbax's array store holds: its OCDBT files keep the arrays together
    (a file does not name its leaves), so every array leaf is suspect."""
    leaves = [f"`{e['path']}`" for e in saved if e["kind"] in ("array", "key")]
    shown = ", ".join(leaves[:6]) + (f" and {len(leaves) - 6} more" if len(leaves) > 6 else "")
    return f"it is part of Orbax's array store, which holds the array leaves together ({shown}): none is restored"


def restore_train_state(path: str | os.PathLike, like: Any) -> Any:
    """Restore a train state saved by `save_train_state`, checked against the template `like`.

    Every leaf's path, dtype and shape must match `like`'s (a clear error names the first
    leaf that differs: nothing is cast). Everything returned is checked against the SHA-256
    hashes of the manifest: the manifest itself, every file, every array, every Python
    value; a damaged, truncated or missing file raises a `CheckpointError` naming the file
    and, where it can tell, the leaf. Arrays are placed with the sharding of `like`'s
    arrays. Non-array leaves other than Python numbers and strings, and static
    configuration, come from `like`. If a save to `path` was killed between its two
    renames, the newest complete copy it left is read.

    Args:
        path: The checkpoint directory.
        like: A train state of the same structure, dtypes and shapes: a freshly
            initialised one, or a shape-only one (`jax.eval_shape` or `eqx.filter_eval_shape`
            of its constructor, `jax.ShapeDtypeStruct` leaves; typed PRNG keys included). A
            Python number that `jax.eval_shape` turned into a weakly typed scalar is restored
            as the saved Python number.

    Returns:
        The restored train state, with `like`'s tree structure.

    Raises:
        FileNotFoundError: There is no checkpoint at `path`.
        NotADirectoryError: `path` is a file.
        CheckpointError: A leaf differs from `like` (the error names it), or a file, an
            array or the manifest fails its hash or cannot be read (the error names the
            file and, where it can tell, the leaf). A subclass of `ValueError`.
        TypeError: `path` is not a `str` or `os.PathLike`.
        ValueError: `path` is empty or names no directory (`"."`, `".."`).

    Example:
        ```python
        import tempfile

        path = tempfile.mkdtemp() + "/ckpt"
        autocast.save_train_state(path, {"params": params, "key": jax.random.key(1), "step": 3})
        try:  # a bfloat16 template for a float32 checkpoint: an error, no silent cast
            half = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
            autocast.restore_train_state(path, {"params": half, "key": jax.random.key(0), "step": 0})
        except ValueError as e:
            error = str(e)
        assert "leaf `['params']['w1']` is float32[4, 16] in the checkpoint" in error
        like = jax.eval_shape(lambda: {"params": params, "key": jax.random.key(0), "step": 0})  # shapes only
        assert autocast.restore_train_state(path, like)["step"] == 3
        ```
    """
    path = _as_path(path, "restore_train_state")
    root = _store.locate(path, "restore_train_state")
    if root is None:
        raise FileNotFoundError(
            f"restore_train_state: no checkpoint at {path!r} (a save that did not finish leaves only a temporary directory)."
        )
    manifest = _store.read_manifest(root, path)
    saved = manifest["leaves"]
    like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    _check_against(saved, like_leaves, path)
    _store.verify_files(root, manifest["files"], path, _holds(saved))
    try:
        arrays = _read_arrays(root, saved, like_leaves)
    except Exception as e:  # Orbax and tensorstore raise many kinds
        raise CheckpointError(
            f"restore_train_state: cannot read the arrays of the checkpoint at {path!r}: {type(e).__name__}: {e}"
        ) from e
    bad = _changed_leaves(saved, arrays)
    if bad:
        raise CheckpointError(
            f"restore_train_state: the checkpoint at {path!r} is corrupted: leaf `{bad[0]}` read from "
            f"{os.path.join(root, _store.ARRAYS)!r} does not match its SHA-256 in manifest.json."
        )
    out = []
    for i, (entry, (_, x)) in enumerate(zip(saved, like_leaves)):
        if entry["kind"] == "key":
            out.append(jax.random.wrap_key_data(arrays[f"leaf_{i}"], impl=_key_impl(x)))
        elif entry["kind"] == "array":
            out.append(arrays[f"leaf_{i}"])
        elif entry["kind"] == "python":
            out.append(_PYTHON_TYPES[entry["type"]](entry["value"]))
        else:
            out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)
