"""Run a benchmark with ``autocast`` imported from another copy of the package: the "before"
side of a before/after comparison, with the benchmark's code as it is now.

    python -m benchmarks.with_autocast_from DIR COMMIT MODULE [ARGS ...]

``DIR`` holds an ``autocast`` package with its policy tables inside it, as the wheel has
them, made from a commit with ``git archive COMMIT autocast policies | tar -x -C DIR &&
cp -r DIR/policies DIR/autocast/``. ``MODULE`` is run as ``python -m MODULE ARGS``; the
results record ``COMMIT`` as the code's commit (``AUTOCAST_GIT_COMMIT``), since the tree's
own commit is not the code that ran. An editable install of the current tree is bypassed
(its import hook would otherwise win over ``DIR``).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(f"usage: python -m benchmarks.with_autocast_from DIR COMMIT MODULE [ARGS ...]; got {argv}")
    where, commit, module, *args = argv
    where = str(Path(where).resolve())
    if not (Path(where) / "autocast" / "policies").is_dir():
        raise SystemExit(f"DIR={where!r} holds no autocast/policies/ (see this module's docstring)")
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    sys.path.insert(0, where)
    for name in [m for m in sys.modules if m == "autocast" or m.startswith("autocast.")]:
        del sys.modules[name]
    import autocast

    if not autocast.__file__.startswith(where):
        raise SystemExit(f"autocast was imported from {autocast.__file__}, not from DIR={where!r}")
    os.environ["AUTOCAST_GIT_COMMIT"] = f"{commit} (autocast from {where})"
    print(f"autocast from {Path(autocast.__file__).parent} (commit {commit})", flush=True)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
