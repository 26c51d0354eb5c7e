"""Test configuration shared by the whole suite.

Eight simulated CPU devices are requested before JAX is imported anywhere, so the
multi-device tests (data parallel under ``jit`` with ``NamedSharding``, ``shard_map``,
the scaler's ``axis_name``) run on a laptop or CI machine without accelerators.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The real-model corpus (tests/real_models/) needs the `corpus` extra's packages, which only
# its own lane installs (tests/run_corpus.sh sets AUTOCAST_CORPUS=1): the other lanes never
# collect it. Inside that lane a package that fails to import fails its tests (no skips).
collect_ignore = [] if os.environ.get("AUTOCAST_CORPUS") == "1" else ["real_models"]
