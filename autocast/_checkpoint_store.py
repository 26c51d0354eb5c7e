"""The checkpoint directory on disk: a hashed manifest, fsync, and an atomic replace.

Layout of a checkpoint at `path`:

    path/
      manifest.json   written last: every leaf's record, every file's size and SHA-256
      arrays/         Orbax's checkpoint of the array leaves (absent if there are none)

`manifest.json` is `{"sha256":"<hex>","manifest":<body>}\\n`, the hex being the SHA-256 of
the body's exact bytes (compact JSON, sorted keys). The body holds `format`, `version`,
`saved_ns` (when the save began), `leaves` (one record per leaf, each with the SHA-256 of
its other fields, so a damaged manifest names the leaf whose record changed) and `files`
(every file under `arrays/`: relative path -> [size, SHA-256]).

A save writes into the sibling `.NAME.autocast-new-<token>`, fsyncs every file and
directory, writes and fsyncs the manifest, then renames the old checkpoint (if any) to
`.NAME.autocast-old-<token>` and the new one to `path`, fsyncing the parent after each
rename, and deletes the leftovers. Killed at any moment, it leaves `path` holding the old
or the new checkpoint, or, between the two renames, no `path` but a complete new sibling:
`locate` then returns the newest complete sibling (a directory is complete when its
manifest verifies; the manifest is written after everything else). One save at a time per
path; with several processes, process 0 does the file operations on a shared filesystem.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from typing import Any

import jax
import numpy as np

FORMAT, VERSION = "autocast-train-state", 2
MANIFEST, ARRAYS = "manifest.json", "arrays"
_HEAD, _MID, _TAIL = b'{"sha256":"', b'","manifest":', b"}\n"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, is corrupted, or does not match its template.

    The message names the file and, where one is at fault, the leaf (its pytree path).

    Example:
        ```python
        import os, tempfile

        path = os.path.join(tempfile.mkdtemp(), "ckpt")
        autocast.save_train_state(path, {"step": 3, "w": jnp.ones(2)})
        with open(os.path.join(path, "manifest.json"), "r+b") as f:  # damage one byte
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 1]))
        try:
            autocast.restore_train_state(path, {"step": 0, "w": jnp.zeros(2)})
            raise AssertionError("a damaged checkpoint restored")
        except autocast.CheckpointError as e:
            assert "manifest.json" in str(e)
        ```
    """


def reached(step: str) -> None:
    """A step of the save sequence (`tests/checkpoint_worker.py` kills the process at one)."""


def orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:  # an optional dependency
        raise ImportError(
            "save_train_state / restore_train_state need orbax-checkpoint: pip install 'jax-autocast[checkpoint]'."
        ) from e
    return ocp


def canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sealed(entry: dict[str, Any]) -> dict[str, Any]:
    """`entry` with the SHA-256 of its fields added."""
    return {**entry, "sha256": sha(canonical(entry))}


def _seal_intact(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    return entry.get("sha256") == sha(canonical({k: v for k, v in entry.items() if k != "sha256"}))


# --- writing --------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a platform without directory handles (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sync_and_hash(root: str) -> dict[str, list[Any]]:
    """fsync every file and directory under `root`; each file's [size, SHA-256] by relative path."""
    files = {}
    for top, _, names in os.walk(root, topdown=False):
        for name in names:
            full = os.path.join(top, name)
            with open(full, "rb") as f:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                os.fsync(f.fileno())
                files[os.path.relpath(full, root).replace(os.sep, "/")] = [os.fstat(f.fileno()).st_size, digest]
        _fsync_dir(top)
    return files


def write_manifest(root: str, body: dict[str, Any]) -> None:
    data = canonical(body)
    with open(os.path.join(root, MANIFEST), "wb") as f:
        f.write(_HEAD + sha(data).encode() + _MID + data + _TAIL)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(root)


def sync_processes(name: str) -> None:
    if jax.process_count() > 1:
        orbax().multihost.sync_global_processes(f"autocast_save_train_state_{name}")


def token() -> int:
    """The save's time in ns: the same in every process (it names the temporary directory)."""
    ns = time.time_ns()
    if jax.process_count() > 1:
        halves = np.array([ns >> 32, ns & 0xFFFFFFFF], np.uint32)
        hi, lo = np.asarray(orbax().multihost.broadcast_one_to_all(halves)).tolist()
        ns = (int(hi) << 32) | int(lo)
    return ns


def sibling(path: str, role: str, ns: int) -> str:
    return os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.autocast-{role}-{ns:x}")


def _siblings(path: str) -> list[str]:
    """The temporary and moved-aside directories of saves to `path` (complete or not)."""
    parent, name = os.path.split(path)
    try:
        names = os.listdir(parent)
    except FileNotFoundError:
        return []
    return sorted(os.path.join(parent, n) for n in names if n.startswith(f".{name}.autocast-"))


def swap(tmp: str, path: str, ns: int) -> None:
    """Put the complete checkpoint `tmp` at `path`, keeping the old one until it is there."""
    parent = os.path.dirname(path)
    old = None
    if os.path.isdir(path):
        old = sibling(path, "old", ns)
        os.rename(path, old)
        _fsync_dir(parent)
        reached("old moved aside")
    try:
        os.rename(tmp, path)
    except BaseException:
        if old is not None:
            os.rename(old, path)
        raise
    _fsync_dir(parent)
    reached("new in place")
    for leftover in _siblings(path):  # the old checkpoint, and what killed saves left
        try:  # the manifest first: a partly deleted directory is never taken for a checkpoint
            os.remove(os.path.join(leftover, MANIFEST))
        except OSError:
            pass
        shutil.rmtree(leftover, ignore_errors=True)


def replaceable(path: str) -> bool:
    """Whether `overwrite` may replace the directory `path`: a checkpoint, or empty."""
    names = os.listdir(path)
    return not names or MANIFEST in names or "_CHECKPOINT_METADATA" in names


# --- reading --------------------------------------------------------------------------------


def read_manifest(root: str, path: str) -> dict[str, Any]:
    """The verified manifest body of the checkpoint directory `root` (reported as `path`)."""
    where = os.path.join(root, MANIFEST)
    try:
        with open(where, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"restore_train_state: {path!r} is not a complete save_train_state checkpoint: {where!r} is missing."
        ) from None
    n = len(_HEAD) + 64
    if not (raw.startswith(_HEAD) and raw[n : n + len(_MID)] == _MID and raw.endswith(_TAIL)):
        raise CheckpointError(
            f"restore_train_state: the checkpoint at {path!r} is corrupted: {where!r} is truncated or "
            f"not a manifest ({len(raw)} bytes)."
        )
    data = raw[n + len(_MID) : -len(_TAIL)]
    try:
        body = json.loads(data)
    except ValueError:
        body = None
    if raw[len(_HEAD) : n].decode("latin-1") != sha(data) or not isinstance(body, dict):
        raise CheckpointError(
            f"restore_train_state: the checkpoint at {path!r} is corrupted: {where!r} does not match its "
            f"SHA-256{_blame_records(body)}."
        )
    if body.get("format") != FORMAT or body.get("version") != VERSION:
        raise CheckpointError(
            f"restore_train_state: {path!r} has format {body.get('format')!r} version {body.get('version')!r}; "
            f"this autocast reads {FORMAT!r} version {VERSION}."
        )
    return body


def _blame_records(body: Any) -> str:
    """Which leaves' records a damaged manifest changed (their own hashes no longer match)."""
    if not isinstance(body, dict) or not isinstance(body.get("leaves"), list):
        return " (it no longer parses)"
    bad = [e for e in body["leaves"] if not _seal_intact(e)]
    if not bad:
        return " (every leaf's record still matches its own hash: the damage is in the file list or header)"
    shown = ", ".join(
        f"leaf `{e.get('path')}`" + (f" (reads {e['value']!r})" if "value" in e else "")
        for e in bad[:4]
        if isinstance(e, dict)
    )
    return f": {shown or 'a leaf record'} no longer matches its record's hash"


def locate(path: str, fn: str) -> str | None:
    """The directory holding the checkpoint `path`: itself, or, when a save was killed between
    its two renames, the newest complete sibling; None if there is no checkpoint."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise NotADirectoryError(f"{fn}: `path` {path!r} is a file, not a checkpoint directory.")
    best, best_ns = None, -1
    for candidate in _siblings(path):
        try:
            saved_ns = read_manifest(candidate, candidate).get("saved_ns")
        except (CheckpointError, OSError):
            continue  # a save that did not finish
        if isinstance(saved_ns, int) and saved_ns > best_ns:
            best, best_ns = candidate, saved_ns
    return best


def verify_files(root: str, files: dict[str, Any], path: str, holds: str) -> None:
    """Every file of `files` is there with its size and SHA-256, or an error names it (and
    `holds`, what the file holds)."""
    for rel, (size, digest) in files.items():
        full = os.path.normpath(os.path.join(root, rel))
        if not full.startswith(os.path.join(root, "")):
            raise CheckpointError(f"restore_train_state: the manifest of {path!r} lists a file outside it: {rel!r}.")
        try:
            with open(full, "rb") as f:
                actual = os.fstat(f.fileno()).st_size
                problem = (
                    f"has {actual} bytes where {size} were saved (truncated or extended)"
                    if actual != size
                    else "does not match its SHA-256 in manifest.json"
                    if hashlib.file_digest(f, "sha256").hexdigest() != digest
                    else None
                )
        except FileNotFoundError:
            problem = "is missing"
        if problem is not None:
            raise CheckpointError(
                f"restore_train_state: the checkpoint at {path!r} is corrupted: file {rel!r} {problem}; {holds}."
            )
