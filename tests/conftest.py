"""Test configuration shared by the whole suite.

The root ``conftest.py``, which pytest loads first for every test of the repository, gives
eight simulated CPU devices before JAX is imported (the flag added to whatever ``XLA_FLAGS``
holds) and ``JAX_PLATFORMS=cpu``: the multi-device tests (data parallel under ``jit`` with
``NamedSharding``, ``shard_map``, the scaler's ``axis_name``) run on a laptop or CI machine
without accelerators.
"""

import os

# The real-model corpus (tests/real_models/) needs the `corpus` extra's packages, which only
# its own lane installs (tests/run_corpus.sh sets AUTOCAST_CORPUS=1): the other lanes never
# collect it. Inside that lane a package that fails to import fails its tests (no skips).
collect_ignore = [] if os.environ.get("AUTOCAST_CORPUS") == "1" else ["real_models"]


_HALF_TWINS = {"float16": "bfloat16", "f16": "bf16"}


def pytest_collection_modifyitems(config, items):
    """``AUTOCAST_HALF_TWINS=bfloat16`` (the oldest-JAX and nextjax lanes): a test parametrized
    over both half dtypes runs in bfloat16 only. Both dtypes take the same JAX code paths,
    which is what those lanes check; the newest lane runs both."""
    if os.environ.get("AUTOCAST_HALF_TWINS") != "bfloat16":
        return
    ids = {item.nodeid for item in items}
    keep, drop = [], []
    for item in items:
        base, _, params = item.nodeid.partition("[")
        parts = params.rstrip("]").split("-") if params else []
        twins = [base + "[" + "-".join(_HALF_TWINS.get(p, p) for p in parts) + "]"] if parts else []
        (drop if twins and twins[0] != item.nodeid and twins[0] in ids else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
