"""What users install: the built wheel ships the policy tables, and amp runs from it."""

import importlib.resources
import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_policies_found_from_this_install():
    files = {p.name for p in importlib.resources.files("autocast.policies").iterdir()}
    assert {"default.toml", "matmul_only.toml", "fp8.toml", "README.md"} <= files


def test_wheel_ships_policies_and_runs_in_a_fresh_virtualenv(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(ROOT),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "dist"),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("jax_autocast-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {
        "autocast/policies/default.toml",
        "autocast/policies/matmul_only.toml",
        "autocast/policies/fp8.toml",
        "autocast/policies/README.md",
        "autocast/py.typed",
    } <= names
    assert not any(n.startswith(("policies/", "tests/", "benchmarks/")) for n in names)

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # Dependencies (jax, equinox, optax) come from this environment's site-packages; the
    # editable install of the working tree is a .pth hook there, which PYTHONPATH does not run.
    env = dict(os.environ, PYTHONPATH=sysconfig.get_paths()["purelib"], JAX_PLATFORMS="cpu")
    script = (
        "import autocast, jax, jax.numpy as jnp, pathlib;"
        "assert 'site-packages' in autocast.__file__ and str(pathlib.Path(autocast.__file__)).startswith("
        + repr(str(venv))
        + "), autocast.__file__;"
        "assert autocast.default_amp_policy[jax.lax.exp_p] is autocast.use_float32_precision;"
        "assert autocast.load_policy('matmul_only').name == 'matmul_only';"
        # fp8.toml extends default.toml: resolved inside the installed package
        "fp8 = autocast.load_policy('fp8');"
        "assert fp8.name == 'fp8' and fp8[jax.lax.exp_p] is autocast.use_float32_precision;"
        "assert fp8[jax.lax.dot_general_p] is not autocast.use_compute_precision;"
        "assert autocast.optim.half_state is not None;"
        "f = autocast.amp(lambda w, x: x @ w);"
        "print(jax.make_jaxpr(f)(jnp.ones((3, 3)), jnp.ones((2, 3))))"
    )
    out = subprocess.run([str(py), "-c", script], check=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "f16[2,3] = dot_general" in out.stdout


def _newest_on_index(python: str, package: str) -> str:
    out = subprocess.run(
        [python, "-m", "pip", "index", "versions", package], check=True, capture_output=True, text=True
    )
    # first line: "jax (0.12.0.1)"
    return out.stdout.splitlines()[0].split("(")[1].rstrip(")")


def test_pip_install_resolves_the_newest_jax_this_python_can_run(tmp_path):
    """`pip install .` never downgrades JAX: it resolves to the newest release the package
    index offers for this Python (0.12.x on Python 3.13, 0.10.2 on 3.11)."""
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            str(report),
            str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )
    import json

    resolved = {
        item["metadata"]["name"].lower(): item["metadata"]["version"]
        for item in json.loads(report.read_text())["install"]
    }
    assert "jax-autocast" in resolved
    assert resolved["jax"] == _newest_on_index(sys.executable, "jax"), resolved
