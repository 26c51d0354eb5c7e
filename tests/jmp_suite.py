"""Run jmp 0.0.4's own test files (shipped in its wheel) against autocast.compat.jmp.

``python tests/jmp_suite.py`` loads ``jmp/_src/policy_test.py`` and
``jmp/_src/loss_scale_test.py`` from the installed jmp package, with ``jmp``,
``jmp._src``, ``jmp._src.policy`` and ``jmp._src.loss_scale`` all pointing at
``autocast.compat.jmp``, runs them with unittest and prints a JSON summary.
``--real`` runs them against the real jmp instead. Nothing of jmp is copied into this
repository: the test files are read from the installed package.

Run it in a fresh process (``tests/test_compat_jmp_suite.py`` does): the module aliases
stay in ``sys.modules``.
"""

from __future__ import annotations

import importlib.util
import io
import json
import sys
import types
import unittest
from pathlib import Path

TEST_FILES = ("policy_test.py", "loss_scale_test.py")
ALIASES = ("jmp", "jmp._src", "jmp._src.policy", "jmp._src.loss_scale")


def jmp_test_dir() -> Path:
    """The ``_src`` folder of the installed jmp (found without importing jmp)."""
    spec = importlib.util.find_spec("jmp")
    if spec is None or spec.origin is None:
        raise RuntimeError("jmp is not installed: pip install -e '.[test]' (it pins jmp==0.0.4).")
    return Path(spec.origin).parent / "_src"


def alias_jmp_to_autocast() -> types.ModuleType:
    """Point jmp and the ``jmp._src`` modules its tests import at autocast.compat.jmp."""
    import autocast.compat.jmp as compat

    for name in ALIASES:
        if name in sys.modules:
            raise RuntimeError(f"{name} was imported before the aliases were set up.")
    # `from jmp._src import policy` reads the attribute of the package `jmp._src`.
    src = types.ModuleType("jmp._src")
    src.policy = src.loss_scale = compat
    sys.modules.update({"jmp": compat, "jmp._src": src, "jmp._src.policy": compat, "jmp._src.loss_scale": compat})
    return compat


def run(real: bool = False) -> dict:
    """Load and run jmp's test files; return the counts and the module they tested."""
    from absl import flags

    flags.FLAGS.mark_as_parsed()  # absltest.TestCase reads flags; unittest does not parse them
    test_dir = jmp_test_dir()  # before the aliases: find_spec would then see autocast's module
    target = None if real else alias_jmp_to_autocast()
    suite = unittest.TestSuite()
    tested = set()
    for filename in TEST_FILES:
        path = test_dir / filename
        spec = importlib.util.spec_from_file_location(f"_jmp_suite_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        tested.add(module.jmp.__name__)
        suite.addTests(unittest.defaultTestLoader.loadTestsFromModule(module))
    stream = io.StringIO()
    result = unittest.TextTestRunner(stream=stream, verbosity=2).run(suite)
    if target is not None and tested != {target.__name__}:
        raise RuntimeError(f"the jmp tests imported {tested}, not {target.__name__}.")
    return {
        "tested": sorted(tested),
        "jmp_test_dir": str(test_dir),
        "collected": suite.countTestCases(),
        "run": result.testsRun,
        "failed": len(result.failures),
        "errors": len(result.errors),
        "skipped": len(result.skipped),
        "expected_failures": len(result.expectedFailures),
        "unexpected_successes": len(result.unexpectedSuccesses),
        "problems": [f"{test.id()}\n{trace}" for test, trace in result.failures + result.errors],
        "log": stream.getvalue(),
    }


if __name__ == "__main__":
    summary = run(real="--real" in sys.argv[1:])
    print(json.dumps(summary))
