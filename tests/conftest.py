"""Test configuration shared by the whole suite.

Eight simulated CPU devices are requested before JAX is imported anywhere, so the
multi-device tests (data parallel under ``jit`` with ``NamedSharding``, ``shard_map``,
the scaler's ``axis_name``) run on a laptop or CI machine without accelerators.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
