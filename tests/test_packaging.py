"""What users install: the built wheel ships the policy tables, and amp runs from it."""

import os
import pathlib
import subprocess
import sys
import sysconfig
import zipfile

import importlib.resources

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_policies_found_from_this_install():
    files = {p.name for p in importlib.resources.files("autocast.policies").iterdir()}
    assert {"default.toml", "matmul_only.toml", "README.md"} <= files


def test_wheel_ships_policies_and_runs_in_a_fresh_virtualenv(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist")],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("jax_autocast-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"autocast/policies/default.toml", "autocast/policies/matmul_only.toml", "autocast/policies/README.md", "autocast/py.typed"} <= names
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
        "assert 'site-packages' in autocast.__file__ and str(pathlib.Path(autocast.__file__)).startswith(%r), autocast.__file__;"
        "assert autocast.default_amp_policy[jax.lax.exp_p] is autocast.use_float32_precision;"
        "assert autocast.load_policy('matmul_only').name == 'matmul_only';"
        "f = autocast.amp(lambda w, x: x @ w);"
        "print(jax.make_jaxpr(f)(jnp.ones((3, 3)), jnp.ones((2, 3))))"
    ) % str(venv)
    out = subprocess.run([str(py), "-c", script], check=True, capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "f16[2,3] = dot_general" in out.stdout
