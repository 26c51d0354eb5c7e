"""Killed processes: a run killed after a checkpoint resumes bit for bit (both optimizer
modes), and a save killed at any moment leaves the old or the new checkpoint, never neither.

One worker process (tests/checkpoint_worker.py) runs every job in a forked child that dies
by SIGKILL at a chosen step of the save, or after a delay; this process then restores what
each left and compares it bit for bit with the states saved."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import autocast  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import checkpoint_worker as worker  # noqa: E402

WORKER = Path(__file__).with_name("checkpoint_worker.py")
SAVE_AT, STEPS = 6, 14
OVERWRITE_STEPS = {  # the step of an overwrite the process dies at -> which checkpoint a restore reads
    "started": 0,
    "arrays written": 0,
    "files synced": 0,
    "manifest written": 0,  # the new one is complete but `path` is still the old one
    "old moved aside": 1,  # `path` is missing: the newest complete sibling is read
    "new in place": 1,
    "done": 1,
}
FIRST_SAVE_STEPS = {"started": None, "files synced": None, "manifest written": 1, "new in place": 1}
DELAYS = (0.02, 0.09, 0.17, 0.26, 0.4)  # seconds after the first overwrite began


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kills")
    plan = [
        {"job": "crash", "dir": str(root / "run"), "save_at": SAVE_AT, "steps": STEPS, "ref": str(root / "ref.npz")},
        {"job": "resume", "dir": str(root / "run"), "steps": STEPS, "out": str(root / "resumed.npz")},
    ]
    plan += [
        {"job": "kill_at", "dir": str(root / f"over{i}" / "ckpt"), "step": s} for i, s in enumerate(OVERWRITE_STEPS)
    ]
    plan += [
        {"job": "kill_at", "dir": str(root / f"first{i}" / "ckpt"), "step": s, "first": True}
        for i, s in enumerate(FIRST_SAVE_STEPS)
    ]
    plan += [{"job": "kill_after", "dir": str(root / f"timed{i}" / "ckpt"), "delay": d} for i, d in enumerate(DELAYS)]
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    plan.append(
        {
            "job": "two_processes",
            "processes": 2,
            "port": port,
            "dir": str(root / "mp" / "ckpt"),
            "out": str(root / "mp"),
        }
    )
    (root / "plan.json").write_text(json.dumps(plan))
    proc = subprocess.run(
        [sys.executable, str(WORKER), str(root / "plan.json"), str(root / "results.json")],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(
            os.environ,
            XLA_FLAGS=re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")),
            JAX_PLATFORMS="cpu",
            OPENBLAS_NUM_THREADS="1",
            CHECKPOINT_WORKER_JAX_CACHE=str(root / "jax_cache"),
        ),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((root / "results.json").read_text())
    return root, results, proc.stderr


def _leftovers(path):
    return sorted(p.name for p in Path(path).parent.iterdir() if p.name.startswith(f".{Path(path).name}.autocast-"))


def _state_bits(version):
    return worker.state_bits(worker.kill_state(version))


def test_a_killed_run_resumes_bit_for_bit_in_both_modes(jobs):
    root, results, stderr = jobs
    assert [r["ended"] for r in results[:2]] == ["exit 17", "exit 0"], stderr[-3000:]
    assert sorted(p.name for p in (root / "run").iterdir()) == ["f32", "sr"]
    uninterrupted = dict(np.load(root / "ref.npz"))
    resumed = dict(np.load(root / "resumed.npz"))
    assert resumed.keys() == uninterrupted.keys()
    for name, bits in uninterrupted.items():  # every parameter, moment, count, scale and key
        np.testing.assert_array_equal(resumed[name], bits, err_msg=name)
    names = " ".join(resumed)
    for mode in worker.MODES:
        assert f"{mode}|['scaler'].scaler" in names and f"{mode}|['key']" in names and f"{mode}|['step']" in names
    assert "sr|['opt_state'].inner[0].nu" in names and "f32|['opt_state'][0].nu" in names
    assert "sr|['opt_state'].key" in names  # the stochastic-rounding key
    assert "sr|['model'].layers[0].weight|bfloat16" in names and "f32|['model'].layers[0].weight|float32" in names
    scale = next(v for k, v in resumed.items() if k.startswith("sr|['scaler'].scaler")).view(np.float32)[0]
    assert scale > 2.0**12  # the dynamic scale moved
    for mode in worker.MODES:
        step = next(v for k, v in resumed.items() if k.startswith(f"{mode}|['step']")).view(np.int32)[0]
        assert step == STEPS


def _check_then_replace(path, expected):
    """`path` restores to kill_state(expected) exactly (or to nothing); a later save with
    overwrite=True replaces it and removes what the killed save left."""
    like = worker.kill_state(0)
    if expected is None:
        with pytest.raises(FileNotFoundError, match="no checkpoint at"):
            autocast.restore_train_state(path, like)
        autocast.save_train_state(path, worker.kill_state(2))  # nothing to overwrite: no overwrite=True needed
    else:
        assert worker.state_bits(autocast.restore_train_state(path, like)) == _state_bits(expected)
        with pytest.raises(FileExistsError, match="overwrite=True"):
            autocast.save_train_state(path, worker.kill_state(2))
        autocast.save_train_state(path, worker.kill_state(2), overwrite=True)
    assert _leftovers(path) == []
    assert worker.state_bits(autocast.restore_train_state(path, like)) == _state_bits(2)


def test_a_save_killed_at_each_step_leaves_the_old_or_the_new_checkpoint(jobs):
    root, results, stderr = jobs
    kill_at = [r for r in results if r["job"] == "kill_at"]
    assert len(kill_at) == len(OVERWRITE_STEPS) + len(FIRST_SAVE_STEPS)
    for r in kill_at:
        assert r["ended"] == "signal 9", (r, stderr[-3000:])  # killed at that step, not before, not never
        expected = (FIRST_SAVE_STEPS if r.get("first") else OVERWRITE_STEPS)[r["step"]]
        left = _leftovers(r["dir"])
        if r["step"] in ("started", "done"):
            assert left == ([] if r["step"] == "done" else [n for n in left if ".autocast-new-" in n])
        if r["step"] == "old moved aside":  # between the two renames: `path` itself is gone
            assert not os.path.exists(r["dir"])
            assert [n.split(".autocast-")[1][:3] for n in left] == ["new", "old"]
        _check_then_replace(r["dir"], expected)


def test_saves_killed_at_random_moments_leave_a_complete_checkpoint(jobs):
    root, results, stderr = jobs
    timed = [r for r in results if r["job"] == "kill_after"]
    assert len(timed) == len(DELAYS)
    versions = {0: _state_bits(0), 1: _state_bits(1)}
    for r in timed:
        assert r["ended"] == "signal 9", (r, stderr[-3000:])
        bits = worker.state_bits(autocast.restore_train_state(r["dir"], worker.kill_state(0)))
        assert bits in versions.values(), r
        _check_then_replace(r["dir"], next(v for v, b in versions.items() if b == bits))


def test_a_state_sharded_across_two_processes_is_saved_overwritten_and_restored(jobs):
    """Process 0 does the file operations; each process restores its own shard."""
    root, results, stderr = jobs
    (job,) = [r for r in results if r["job"] == "two_processes"]
    assert job["ended"] == "exit 0, exit 0", stderr[-3000:]
    key = np.asarray(jax.random.key_data(jax.random.key(4)))
    for rank in (0, 1):
        got = dict(np.load(f"{job['out']}.{rank}.npz"))
        np.testing.assert_array_equal(got["w"], 2 * np.arange(4 * rank, 4 * rank + 4, dtype=np.float32))
        np.testing.assert_array_equal(got["r"], np.full(3, 3.5, np.float32))
        np.testing.assert_array_equal(got["key"], key)
        assert int(got["step"]) == 6
    assert sorted(p.name for p in (root / "mp").iterdir()) == ["ckpt"]  # no temporary or old directory left
