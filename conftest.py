"""Executes every code block of the documentation with Sybil (README.md, docs/, docstrings).

Eight simulated CPU devices are requested before JAX is imported, as in tests/conftest.py,
so the multi-device examples run on a laptop. Semantics (docs/contributing.md):

* every ```python block of a page runs, top to bottom, in one namespace per page;
* ``<!-- invisible-code-block: python ... -->`` is hidden setup that runs in that order;
* ``<!-- skip: next -->`` skips the next block, which must begin with a comment line that
  says why (``tests/test_docs.py`` checks that, and how many there are);
* docstrings in ``autocast/``: their ```python blocks (an ``Example:`` section's) run, one
  namespace per module, pre-filled by ``_docstring_namespace`` with a small model
  (``loss_fn(params, batch)``, ``params``, ``batch``, ``model``, ``optim``, ...) and the
  compat modules as ``jmp``, ``mpx`` and ``jaxamp``.

Bash, shell, TOML and ``text`` blocks (output transcripts) are not executed.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # added to other flags
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from sybil import Sybil  # noqa: E402
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser  # noqa: E402


def _docstring_namespace(namespace):
    """The names docstring examples may use without defining them: a two-layer MLP's loss."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import autocast
    import autocast.compat.jaxamp as jaxamp
    import autocast.compat.jmp as jmp
    import autocast.compat.mpx as mpx

    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": 0.5 * jax.random.normal(k1, (4, 16)), "w2": 0.5 * jax.random.normal(k2, (16, 2))}
    x = jax.random.normal(k3, (8, 4))
    y = jnp.stack([jnp.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1)

    def loss_fn(params, batch):
        x, y = batch
        pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
        return jnp.mean((pred - y) ** 2)

    def loss(params):
        return loss_fn(params, (x, y))

    model = eqx.nn.MLP(4, 2, 16, 1, key=k1)
    optim = optax.adam(1e-3)
    namespace.update(
        eqx=eqx,
        jax=jax,
        jnp=jnp,
        np=np,
        optax=optax,
        autocast=autocast,
        jaxamp=jaxamp,
        jmp=jmp,
        mpx=mpx,
        params=params,
        batch=(x, y),
        x=x,
        y=y,
        loss_fn=loss_fn,
        loss=loss,
        model=model,
        optim=optim,
        opt_state=optim.init(params),
    )


_markdown = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/**/*.md", "docs/*.md"],
    excludes=["docs/results/*"],
    name="docs",
)
_docstrings = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["autocast/**/*.py", "autocast/*.py"],
    setup=_docstring_namespace,
    name="docstrings",
)

pytest_collect_file = (_markdown + _docstrings).pytest()
