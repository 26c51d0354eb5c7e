"""jmp 0.0.4's own test suite, read from the installed jmp wheel, passes against
autocast.compat.jmp (see tests/jmp_suite.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
JMP_TESTS = 97  # policy_test.py (72) + loss_scale_test.py (25) in jmp 0.0.4


def _run_suite(*args: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "jmp_suite.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("real", [False, True], ids=["autocast.compat.jmp", "real-jmp"])
def test_jmp_own_test_suite_passes(real):
    summary = _run_suite(*(["--real"] if real else []))
    assert Path(summary["jmp_test_dir"]).parts[-2:] == ("jmp", "_src")
    expected = ["jmp._src.loss_scale", "jmp._src.policy"] if real else ["autocast.compat.jmp"]
    assert summary["tested"] == expected
    assert summary["collected"] == JMP_TESTS, summary["log"][-4000:]
    assert summary["run"] == JMP_TESTS
    problems = "\n\n".join(summary["problems"])
    assert (summary["failed"], summary["errors"]) == (0, 0), problems
    assert (summary["skipped"], summary["expected_failures"], summary["unexpected_successes"]) == (0, 0, 0)
