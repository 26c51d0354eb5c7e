"""Damaged checkpoints: every file a save writes, with a byte flipped or cut short, makes
restore_train_state raise an error naming the file (never return another value), and the
hashes of the manifest name the leaf whose value changed."""

import hashlib
import json
import re
import shutil
import sys
from pathlib import Path

import jax
import pytest

pytest.importorskip("orbax.checkpoint")

import autocast  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_worker import kill_state, state_bits  # noqa: E402

DAMAGES = {
    "first byte flipped": lambda b: bytes([b[0] ^ 0x01]) + b[1:],
    "middle byte flipped": lambda b: b[: len(b) // 2] + bytes([b[len(b) // 2] ^ 0x10]) + b[len(b) // 2 + 1 :],
    "last byte flipped": lambda b: b[:-1] + bytes([b[-1] ^ 0x80]),
    "cut in half": lambda b: b[: len(b) // 2],
    "emptied": lambda b: b"",
    "deleted": None,
}


def test_every_damaged_file_makes_restore_raise_naming_it(tmp_path):
    state = kill_state(1)
    base = tmp_path / "base"
    autocast.save_train_state(base, state)
    files = sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())
    assert "manifest.json" in files and sum(f.startswith("arrays/") for f in files) >= 5
    assert state_bits(autocast.restore_train_state(base, kill_state(0))) == state_bits(state)
    outcomes = {}
    for n, (rel, (damage, change)) in enumerate((f, d) for f in files for d in DAMAGES.items()):
        copy = tmp_path / f"copy{n}"  # a new path each time: nothing cached from an earlier read
        shutil.copytree(base, copy)
        if change is None:
            (copy / rel).unlink()
        else:
            (copy / rel).write_bytes(change((copy / rel).read_bytes()))
        try:
            restored = autocast.restore_train_state(copy, kill_state(0))
        except ValueError as e:  # CheckpointError
            message = str(e)
            assert f"the checkpoint at '{copy}' is corrupted" in message or "is not a complete" in message, message
            assert rel in message, (rel, damage, message)  # the damaged file is named
            outcomes[rel, damage] = "raised"
        else:  # the contract allows only the saved state itself; this format always raises
            assert state_bits(restored) == state_bits(state), (rel, damage)
            outcomes[rel, damage] = "returned the saved state"
    assert set(outcomes.values()) == {"raised"}, outcomes
    assert len(outcomes) == len(files) * len(DAMAGES)


def _manifest(path):
    raw = (path / "manifest.json").read_bytes()
    document = json.loads(raw)
    body = raw[raw.index(b'"manifest":') + len(b'"manifest":') : -2]
    assert hashlib.sha256(body).hexdigest() == document["sha256"]  # the documented format
    return document["manifest"], raw


def _reseal(path, manifest):
    """Write `manifest` as a valid manifest.json (as save_train_state does, hash included)."""
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    (path / "manifest.json").write_bytes(
        b'{"sha256":"' + hashlib.sha256(body).hexdigest().encode() + b'","manifest":' + body + b"}\n"
    )


def test_a_changed_python_value_names_its_leaf(tmp_path):
    autocast.save_train_state(tmp_path / "c", kill_state(1))  # step 101, lr 1.25
    _, raw = _manifest(tmp_path / "c")
    for old, new, leaf in [(b'"value":101', b'"value":104', "['step']"), (b'"value":1.25', b'"value":1.75', "['lr']")]:
        assert raw.count(old) == 1
        (tmp_path / "c" / "manifest.json").write_bytes(raw.replace(old, new))
        with pytest.raises(ValueError) as info:
            autocast.restore_train_state(tmp_path / "c", kill_state(0))
        message = str(info.value)
        assert "manifest.json' does not match its SHA-256" in message, message
        assert f"leaf `{leaf}` (reads {new.split(b':')[1].decode()}) no longer matches its record's hash" in message


def test_arrays_read_back_are_checked_leaf_by_leaf(tmp_path):
    """A checkpoint whose files all match a consistent manifest but hold other arrays (the
    arrays of another save moved in, the manifest re-hashed): the hash of each array read
    back names the leaf."""
    autocast.save_train_state(tmp_path / "a", kill_state(0))
    autocast.save_train_state(tmp_path / "b", kill_state(1))
    manifest_b, _ = _manifest(tmp_path / "b")
    shutil.rmtree(tmp_path / "a" / "arrays")
    shutil.copytree(tmp_path / "b" / "arrays", tmp_path / "a" / "arrays")
    manifest_a, _ = _manifest(tmp_path / "a")
    _reseal(tmp_path / "a", {**manifest_a, "files": manifest_b["files"]})
    leaves = jax.tree_util.tree_flatten_with_path(kill_state(0))[0]
    first_array = next(jax.tree_util.keystr(p) for p, x in leaves if isinstance(x, jax.Array))
    with pytest.raises(ValueError, match=rf"corrupted: leaf `{re.escape(first_array)}` read from .*arrays"):
        autocast.restore_train_state(tmp_path / "a", kill_state(0))
    _reseal(tmp_path / "a", {**manifest_b})  # b's own manifest: b's state, exactly
    assert state_bits(autocast.restore_train_state(tmp_path / "a", kill_state(0))) == state_bits(kill_state(1))
