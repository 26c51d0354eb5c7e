"""The "after" snippets of the migration guides (docs/migration/: jmp, MPX, jaxamp, PyTorch AMP).

Each `_after_*` function's body is the guide's snippet, character for character
(`test_snippets_are_in_the_guides` checks it, up to whitespace; the docs tests also run each page); the function only adds the `batches`
argument and a final `return`. Each snippet must train, keep float32 master weights, and
end close to the same training run in float32 without autocast.
"""

import inspect
import pathlib
import re
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from helpers import compute_op_dtypes, tree_max_rel_err, walk

GUIDES = pathlib.Path(__file__).resolve().parents[1] / "docs" / "migration"


def _batches(n=25, size=64, labels=False):
    key = jax.random.key(7)
    out = []
    for _ in range(n):
        key, sub = jax.random.split(key)
        x = jax.random.normal(sub, (size, 4))
        y = jnp.stack([jnp.sin(2 * x[:, 0]), x[:, 1] * x[:, 2]], axis=1)
        out.append((x, (x[:, 0] * x[:, 1] > 0).astype(jnp.int32) if labels else y))
    return out


def _float32_run(loss_fn, params, optim, batches, has_aux=False):
    """The same training without autocast, scaling or skipping."""
    opt_state = optim.init(eqx.filter(params, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(params, opt_state, x, y):
        grads = eqx.filter_grad(loss_fn, has_aux=has_aux)(params, x, y)
        grads = grads[0] if has_aux else grads
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(params, eqx.is_inexact_array))
        return eqx.apply_updates(params, updates), opt_state

    for x, y in batches:
        params, opt_state = step(params, opt_state, x, y)
    return params


def _check_trained(params, reference, losses, tol):
    arrays = jax.tree.leaves(eqx.filter(params, eqx.is_inexact_array))
    assert arrays and all(a.dtype == jnp.float32 for a in arrays)
    assert np.all(np.isfinite([float(v) for v in losses]))
    assert float(losses[-1]) < 0.6 * float(losses[0])
    err = tree_max_rel_err(eqx.filter(params, eqx.is_inexact_array), eqx.filter(reference, eqx.is_inexact_array))
    assert err < tol, err


# ------------------------------------------------------------------------------------
# The snippets
# ------------------------------------------------------------------------------------


def _after_jmp(batches):
    import jax
    import jax.numpy as jnp
    import optax

    import autocast

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": 0.5 * jax.random.normal(k1, (4, 32)), "w2": 0.2 * jax.random.normal(k2, (32, 2))}
    optim = optax.adam(1e-2)
    opt_state = optim.init(params)

    def loss_fn(params, x, y):  # no casts and no scale: written for float32
        pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
        return jnp.mean((pred - y) ** 2)

    amp_loss = autocast.amp(loss_fn, compute_dtype=jnp.float16)

    @jax.jit
    def train_step(params, opt_state, scaler, x, y):
        scaler, (loss, grads) = autocast.dynamic_scale_value_and_grad(amp_loss)(
            params, x, y, dynamic_scaler_state=scaler
        )
        params, opt_state = autocast.optimizer_update(params, optim, opt_state, grads, scaler.grads_finite)
        return params, opt_state, scaler, loss

    scaler = autocast.DynamicScalerState()  # was jmp.DynamicLossScale(jnp.float32(2**15))
    losses = []
    for x, y in batches:
        params, opt_state, scaler, loss = train_step(params, opt_state, scaler, x, y)
        losses.append(loss)
    return locals()


def _after_mpx(batches):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import autocast.compat.mpx as mpx  # was: import mpx

    model = eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    optimizer_state = optimizer.init(eqx.filter(model, eqx.is_array))

    def loss_fn(model, x, y):
        pred = jax.vmap(model)(x)
        return jnp.mean((pred - y) ** 2), pred

    loss_scaling = mpx.DynamicLossScaling(
        loss_scaling=mpx.FLOAT16_MAX, min_loss_scaling=jnp.ones((), dtype=jnp.float32), period=2000
    )

    @eqx.filter_jit
    def make_step(model, optimizer_state, loss_scaling, x, y):
        (loss_value, _), loss_scaling, grads_finite, grads = mpx.filter_value_and_grad(
            loss_fn, scaling=loss_scaling, has_aux=True
        )(model, x, y)
        model, optimizer_state = mpx.optimizer_update(model, optimizer, optimizer_state, grads, grads_finite)
        return model, optimizer_state, loss_scaling, loss_value

    losses = []
    for x, y in batches:
        model, optimizer_state, loss_scaling, loss_value = make_step(model, optimizer_state, loss_scaling, x, y)
        losses.append(loss_value)
    return locals()


def _after_jaxamp(batches):
    import jax
    import jax.numpy as jnp
    import optax

    import autocast  # was: import jaxamp

    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": 0.5 * jax.random.normal(k1, (4, 32)), "w2": 0.2 * jax.random.normal(k2, (32, 2))}
    optim = optax.adam(1e-2)
    opt_state = optim.init(params)

    def loss_fn(params, x, y):
        pred = jnp.tanh(x @ params["w1"]) @ params["w2"]
        return jnp.mean((pred - y) ** 2), jnp.max(jnp.abs(pred - y))

    amp_loss = autocast.amp(loss_fn)  # float16 by default, as in jaxamp
    value_and_grad_fn = autocast.dynamic_scale_value_and_grad(amp_loss, has_aux=True)

    @jax.jit
    def train_step(params, opt_state, scaler, x, y):
        scaler, ((loss, max_err), grads) = value_and_grad_fn(params, x, y, dynamic_scaler_state=scaler)
        params, opt_state = autocast.optimizer_update(params, optim, opt_state, grads, scaler.grads_finite)
        return params, opt_state, scaler, loss, max_err

    scaler = autocast.DynamicScalerState()  # jaxamp.DynamicScalerState()
    losses = []
    for x, y in batches:
        params, opt_state, scaler, loss, max_err = train_step(params, opt_state, scaler, x, y)
        losses.append(loss)
    return locals()


def _after_torch(batches):
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import autocast

    class Net(eqx.Module):
        body: eqx.nn.MLP
        head: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.body = eqx.nn.MLP(4, 32, 32, 1, key=k1)
            self.head = eqx.nn.Linear(32, 2, key=k2)

    def rms_norm(x):  # was @custom_fwd(cast_inputs=torch.float32)
        with jax.named_scope("rms_norm"):
            return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)

    def loss_fn(model, x, y):
        h = rms_norm(jax.vmap(model.body)(x))
        with autocast.amp_stop():  # was torch.autocast(..., enabled=False)
            logits = jax.vmap(model.head)(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    policy = autocast.extend_policy({"rms_norm": autocast.use_precision(jnp.float32)})
    amp_loss = autocast.amp(loss_fn, compute_dtype=jnp.float16, amp_policy=policy)  # the autocast region

    model = Net(jax.random.key(0))
    optim = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))  # unscale_ + clip_grad_norm_
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    scaler = autocast.DynamicScalerState(scaler=2.0**16, patience=2000)  # GradScaler() defaults

    @eqx.filter_jit
    def train_step(model, opt_state, scaler, x, y):
        scaler, (loss, grads) = autocast.dynamic_scale_value_and_grad(amp_loss)(  # scaler.scale(loss).backward()
            model, x, y, dynamic_scaler_state=scaler
        )
        model, opt_state = autocast.optimizer_update(  # scaler.step(optimizer); scaler.update()
            model, optim, opt_state, grads, scaler.grads_finite
        )
        return model, opt_state, scaler, loss

    losses = []
    for x, y in batches:
        model, opt_state, scaler, loss = train_step(model, opt_state, scaler, x, y)
        losses.append(loss)
    return locals()


SNIPPETS = [_after_jmp, _after_mpx, _after_jaxamp, _after_torch]


def _snippet_text(fn):
    lines = inspect.getsource(fn).splitlines()
    assert lines[0].startswith("def ") and lines[-1].strip() == "return locals()"
    return textwrap.dedent("\n".join(lines[1:-1])).strip("\n")


# ------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------


def test_snippets_are_in_the_guides():
    # Whitespace is compared loosely: ruff formats the pages (two blank lines around top-level
    # definitions, line breaks at 120 columns) and the indented function bodies here differently.
    squash = lambda text: re.sub(r"\s+", "", text)
    for fn, page in zip(SNIPPETS, ["jmp.md", "mpx.md", "jaxamp.md", "pytorch.md"]):
        assert squash(f"```python\n{_snippet_text(fn)}\n```") in squash((GUIDES / page).read_text()), fn.__name__


def test_after_jmp_trains_like_float32():
    batches = _batches()
    ns = _after_jmp(batches)
    init = {
        "w1": 0.5 * jax.random.normal(jax.random.split(jax.random.key(0))[0], (4, 32)),
        "w2": 0.2 * jax.random.normal(jax.random.split(jax.random.key(0))[1], (32, 2)),
    }
    reference = _float32_run(ns["loss_fn"], init, optax.adam(1e-2), batches)
    _check_trained(ns["params"], reference, ns["losses"], tol=2e-2)
    assert bool(ns["scaler"].grads_finite) and float(ns["scaler"].scaler) == 2.0**15
    x, y = batches[0]
    counts = compute_op_dtypes(lambda p: ns["amp_loss"](p, x, y), ns["params"])
    assert counts[("dot_general", "float16", False)] == 2 and sum(counts.values()) == 2
    jaxpr = jax.make_jaxpr(lambda p: ns["amp_loss"](p, x, y))(ns["params"])
    dtypes = {e.primitive.name: str(e.invars[0].aval.dtype) for e, _ in walk(jaxpr)}
    assert dtypes["tanh"] == "float16" and dtypes["reduce_sum"] == "float32"


def test_after_mpx_trains_like_float32():
    batches = _batches()
    ns = _after_mpx(batches)
    model = eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0))
    reference = _float32_run(ns["loss_fn"], model, optax.adam(1e-2), batches, has_aux=True)
    _check_trained(ns["model"], reference, ns["losses"], tol=2e-2)
    assert float(ns["loss_scaling"].loss_scaling) <= 65504.0


def test_after_mpx_automatic_keyword_trains_like_float32():
    import autocast.compat.mpx as mpx

    batches = _batches()
    ns = _after_mpx(batches[:1])
    model = eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0))
    optimizer = optax.adam(1e-2)
    state = optimizer.init(eqx.filter(model, eqx.is_array))
    scaling = mpx.DynamicLossScaling(mpx.FLOAT16_MAX, jnp.ones(()), period=2000)

    @eqx.filter_jit
    def step(model, state, scaling, x, y):
        (loss, _), scaling, finite, grads = mpx.filter_value_and_grad(
            ns["loss_fn"], scaling, has_aux=True, automatic=True
        )(model, x, y)
        model, state = mpx.optimizer_update(model, optimizer, state, grads, finite)
        return model, state, scaling, loss

    losses = []
    for x, y in batches:
        model, state, scaling, loss = step(model, state, scaling, x, y)
        losses.append(loss)
    reference = _float32_run(ns["loss_fn"], eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0)), optimizer, batches, True)
    _check_trained(model, reference, losses, tol=2e-2)


def test_after_jaxamp_trains_like_float32():
    batches = _batches()
    ns = _after_jaxamp(batches)
    k1, k2 = jax.random.split(jax.random.key(0))
    init = {"w1": 0.5 * jax.random.normal(k1, (4, 32)), "w2": 0.2 * jax.random.normal(k2, (32, 2))}
    reference = _float32_run(ns["loss_fn"], init, optax.adam(1e-2), batches, has_aux=True)
    _check_trained(ns["params"], reference, ns["losses"], tol=2e-2)
    assert ns["max_err"].dtype == jnp.float32


def test_after_torch_trains_like_float32_with_the_right_precisions():
    batches = _batches(labels=True)
    ns = _after_torch(batches)
    reference = _float32_run(ns["loss_fn"], ns["Net"](jax.random.key(0)), ns["optim"], batches)
    _check_trained(ns["model"], reference, ns["losses"], tol=3e-2)
    x, y = batches[0]
    model = ns["model"]
    counts = compute_op_dtypes(lambda x: ns["amp_loss"](model, x, y), x)
    assert counts[("dot_general", "float16", False)] == 2  # the body: autocast region
    assert counts[("dot_general", "float32", True)] == 1  # the head: amp_stop
    # rms_norm's rule: its multiply runs in float32 although its input is float16.
    jaxpr = jax.make_jaxpr(lambda x: ns["amp_loss"](model, x, y))(x)
    in_norm = [e for e, scopes in walk(jaxpr) if "rms_norm" in scopes and e.primitive.name == "mul"]
    assert in_norm and all(str(v.aval.dtype) == "float32" for e in in_norm for v in e.invars)
