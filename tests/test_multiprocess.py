"""``amp`` and the dynamic scaler across processes: 2 processes x 2 CPU devices, joined
with ``jax.distributed.initialize`` on localhost (gloo), against one process with 4 devices.

The worker (``tests/multiprocess_worker.py``) trains a small MLP in float16 for 6 Adam
steps, data parallel over the 4 devices, under ``jit`` with ``NamedSharding`` and with
``shard_map`` + ``axis_name``; one step's batch has an infinity in a row that only the
second process holds. Checked: both processes end with identical results, both skip that
step (and halve the scale), and the parameters equal the one-process run within float32
noise: the weight gradients are all-reduced in float32, so only the order of float32 sums
differs (issue 16 reported 3.8e-3 after 6 steps when they were all-reduced in float16).
Every process runs under a subprocess timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 120
# float32 noise: per-step gradients differ in the order of float32 sums (gloo vs in-process
# all-reduce), amplified a little by Adam's normalisation. Measured: 1.0e-7.
PARAM_RTOL = 2e-6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"  # not the suite's 8
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multiprocess")
    port = _free_port()
    procs = {
        "reference": subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp / "reference.json")],
            env=_env(4),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    }
    for i in range(2):
        procs[f"process{i}"] = subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp / f"process{i}.json"), str(port), str(i), "2"],
            env=_env(2),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
    logs = {}
    try:
        for name, p in procs.items():
            logs[name], _ = p.communicate(timeout=TIMEOUT_S)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, p in procs.items():
        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{logs.get(name, '')[-3000:]}"
    return {name: json.loads((tmp / f"{name}.json").read_text()) for name in procs}


def test_two_processes_of_two_devices(runs):
    for i in range(2):
        r = runs[f"process{i}"]
        assert (r["process_index"], r["process_count"], r["devices"], r["local_devices"]) == (i, 2, 4, 2)
    assert (runs["reference"]["process_count"], runs["reference"]["devices"]) == (1, 4)


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_processes_agree_bit_for_bit(runs, mode):
    assert runs["process0"][mode] == runs["process1"][mode]


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_a_non_finite_gradient_on_one_process_skips_the_step_on_all(runs, mode):
    for name in ("process0", "process1", "reference"):
        r = runs[name][mode]
        assert r["finite"] == [True, True, False, True, True, True], (name, r["finite"])
        assert r["scale"] == [1024.0, 1024.0, 512.0, 512.0, 512.0, 512.0], (name, r["scale"])


@pytest.mark.parametrize("mode", ["jit", "shard_map"])
def test_matches_the_one_process_run_within_float32_noise(runs, mode):
    got, ref = runs["process0"][mode]["params"], runs["reference"][mode]["params"]
    for k in ref:
        a, b = np.asarray(got[k]), np.asarray(ref[k])
        assert np.all(np.isfinite(a)), k
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < PARAM_RTOL, f"{mode}/{k}: max rel. difference {err:.2e}"
    # the runs trained (parameters moved): the comparison is not between initial values
    w1_init = np.random.default_rng(0).standard_normal((16, 64), np.float32) / np.float32(4.0)  # worker.init()
    assert np.abs(np.asarray(ref["w1"]) - w1_init).max() > 1e-3
