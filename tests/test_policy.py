"""Policy tables, user policies, registration of rules (built-in and third-party primitives)."""

import importlib.resources
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compute_op_dtypes, operand_dtypes, walk
from jax.extend.core import Primitive
from jax.interpreters import mlir

import autocast
from autocast import _compat, amp


def _shipped():
    root = importlib.resources.files("autocast.policies")
    return {p.name[:-5]: tomllib.loads(p.read_text()) for p in root.iterdir() if p.name.endswith(".toml")}


# Names the default table lists that exist in only some supported JAX releases (checked on
# 0.9.2 and 0.12 by tests/run_tests.sh). Any other unresolved name is a typo.
_VERSION_SPECIFIC = {
    # JAX 0.9 only
    "ag_start",
    "ag_done",
    "iota_2x32_shape",
    "random_wrap",
    "random_unwrap",
    # JAX 0.10 only
    "ormqr",
    "mulhi",
    "stack",
    "unstack",
    "all_gather_start",
    "all_gather_done",
    "all_gather_reduced_start",
    "all_to_all_start",
    "all_to_all_done",
    "ppermute_start",
    "ppermute_done",
    "psum_start",
    "psum_done",
    "psum_invariant_start",
    "pbroadcast_start",
    "pbroadcast_done",
    "reduce_scatter_start",
    "reduce_scatter_done",
    "unreduced_psum_start",
    "unreduced_reduce_scatter_start",
    "get",
    "swap",
    "stage",
    "call_hi_primitive",
    # renamed in JAX 0.12 (the _p suffix dropped)
    "reduced_vary_cast_p",
    "vary_unreduced_cast_p",
    # JAX 0.11 only
    "program_order",
    # JAX 0.12 only
    "log2",
    "one_minus_square",
    "polynomial",
    "pbroadcast_dynamic",
    "reduced_vary_cast",
    "relayout",
    "unreduced_pmax",
    "unreduced_pmin",
    "vary_unreduced_cast",
}


def test_shipped_tables_load_and_every_name_resolves():
    tables = _shipped()
    assert {"default", "matmul_only"} <= set(tables)
    for name in tables:
        policy = autocast.load_policy(name)
        assert set(policy.unresolved) <= _VERSION_SPECIFIC, (name, sorted(set(policy.unresolved) - _VERSION_SPECIFIC))
        assert policy["amp_stop"] is autocast.use_original_precision


def test_every_jax_primitive_is_classified_once_in_the_default_table():
    """The op-coverage matrix: a primitive JAX adds fails here until the table places it."""
    table = _shipped()["default"]
    named = [n for names in table["primitives"].values() for n in names]
    assert len(named) == len(set(named)), "a primitive is listed in two categories"
    missing = sorted(set(_compat.discover_primitives()) - set(named))
    assert missing == [], f"primitives missing from policies/default.toml: {missing}"


def test_default_policy_categories():
    p = autocast.default_amp_policy
    assert p[jax.lax.dot_general_p] is autocast.use_compute_precision
    assert p[jax.lax.conv_general_dilated_p] is autocast.use_compute_precision
    for prim in (jax.lax.exp_p, jax.lax.log_p, jax.lax.reduce_sum_p, jax.lax.rsqrt_p, jax.lax.cumsum_p, jax.lax.pow_p):
        assert p[prim] is autocast.use_float32_precision, prim
    for prim in (jax.lax.add_p, jax.lax.mul_p, jax.lax.select_n_p, jax.lax.reshape_p):
        assert p[prim] is autocast.use_input_precision, prim
    assert p["amp_default"] is autocast.use_original_precision


def test_linalg_and_fft_run_in_float32():
    def f(a, w):
        h = a @ w
        spd = h @ h.T + 4 * jnp.eye(4)
        return jnp.linalg.cholesky(spd).sum() + jnp.abs(jnp.fft.fft(h)).sum() + jnp.linalg.qr(h)[1].sum()

    out = amp(f)(jnp.eye(4), jnp.eye(4) * 0.5)
    assert np.isfinite(out)
    for eqn, _ in walk(jax.make_jaxpr(amp(f))(jnp.eye(4), jnp.eye(4))):
        if eqn.primitive.name in ("cholesky", "fft", "qr", "householder_product", "geqrf"):
            assert "float16" not in operand_dtypes(eqn), eqn.primitive.name


def test_matmul_only_policy():
    def f(w, x):
        return jnp.tanh(x @ w + 1.0).sum()

    eqns = [
        e
        for e, _ in walk(
            jax.make_jaxpr(amp(f, amp_policy=autocast.load_policy("matmul_only")))(jnp.ones((3, 3)), jnp.ones((2, 3)))
        )
    ]
    for e in eqns:
        if e.primitive.name == "dot_general":
            assert operand_dtypes(e) == ("float16", "float16")
        if e.primitive.name in ("add", "tanh"):
            assert set(operand_dtypes(e)) == {"float32"}


def test_load_policy_from_path_and_errors(tmp_path):
    good = tmp_path / "mine.toml"
    good.write_text(
        'schema = 1\nfallback = "input"\n[primitives]\nfloat32 = ["dot_general"]\n[scopes]\n"blk*" = "compute"\n'
    )
    p = autocast.load_policy(good)
    assert p[jax.lax.dot_general_p] is autocast.use_float32_precision
    assert p["blk*"] is autocast.use_compute_precision and p["amp_default"] is autocast.use_input_precision
    assert compute_op_dtypes(amp(lambda w, x: x @ w, amp_policy=p), jnp.ones((3, 3)), jnp.ones((2, 3))) == {
        ("dot_general", "float32", False): 1
    }

    bad_schema = tmp_path / "a.toml"
    bad_schema.write_text("[primitives]\n")
    with pytest.raises(ValueError, match="'schema = 1' is required"):
        autocast.load_policy(bad_schema)
    bad_cat = tmp_path / "b.toml"
    bad_cat.write_text('schema = 1\n[primitives]\nfast = ["add"]\n')
    with pytest.raises(ValueError, match="unknown category 'fast'"):
        autocast.load_policy(bad_cat)
    with pytest.raises(ValueError, match="not a shipped policy; shipped: .*default"):
        autocast.load_policy("nope")
    unknown = tmp_path / "c.toml"
    unknown.write_text('schema = 1\n[primitives]\ninput = ["add", "not_a_primitive"]\n')
    assert autocast.load_policy(unknown).unresolved == ("not_a_primitive",)


def test_extend_policy_without_copying_and_plain_dict_policy():
    def f(w, x):
        return jnp.exp(x @ w).sum()

    ext = autocast.extend_policy({jax.lax.dot_general_p: autocast.use_precision(jnp.bfloat16)})
    assert ext[jax.lax.exp_p] is autocast.use_float32_precision  # inherited
    assert compute_op_dtypes(amp(f, amp_policy=ext), jnp.ones((3, 3)), jnp.ones((2, 3))) == {
        ("dot_general", "bfloat16", False): 1
    }
    merged = {**autocast.default_amp_policy, jax.lax.dot_general_p: autocast.use_float32_precision}
    assert compute_op_dtypes(amp(f, amp_policy=merged), jnp.ones((3, 3)), jnp.ones((2, 3))) == {
        ("dot_general", "float32", False): 1
    }
    # a jaxamp-style replacement policy: only what it names, original precision otherwise
    jaxamp_style = {
        jax.lax.dot_general_p: autocast.use_compute_precision,
        "amp_default": autocast.use_original_precision,
    }
    exps = [
        e
        for e, _ in walk(jax.make_jaxpr(amp(f, amp_policy=jaxamp_style))(jnp.ones((3, 3)), jnp.ones((2, 3))))
        if e.primitive.name == "exp"
    ]
    assert [operand_dtypes(e) for e in exps] == [("float32",)]


def test_register_rule_for_builtin_primitive_is_global_and_removable():
    def f(x, w):
        return (jnp.tanh(x @ w) @ w).sum()  # tanh feeds a matmul: half by default

    def tanh_ops():
        return [
            operand_dtypes(e)
            for e, _ in walk(jax.make_jaxpr(amp(f))(jnp.ones((2, 3)), jnp.ones((3, 3))))
            if e.primitive.name == "tanh"
        ]

    assert tanh_ops() == [("float16",)]
    autocast.register_rule(jax.lax.tanh_p, autocast.use_float32_precision)
    try:
        assert tanh_ops() == [("float32",)]
        # also seen through policies extended earlier (live view) and plain user dicts
        user = {jax.lax.dot_general_p: autocast.use_compute_precision}
        ops = [
            operand_dtypes(e)
            for e, _ in walk(jax.make_jaxpr(amp(f, amp_policy=user))(jnp.ones((2, 3)), jnp.ones((3, 3))))
            if e.primitive.name == "tanh"
        ]
        assert ops == [("float32",)]
    finally:
        autocast.unregister_rule(jax.lax.tanh_p)
    assert tanh_ops() == [("float16",)]


def _make_scale_primitive():
    """A third-party primitive: y = x * 3, defined with jax.extend.core.Primitive."""
    prim = Primitive("triple_for_test")
    prim.def_impl(lambda x: x * 3)
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(lambda x: x * 3, multiple_results=False))
    return prim


def test_register_rule_for_user_defined_primitive():
    prim = _make_scale_primitive()

    def f(w, x):
        return prim.bind(x @ w).sum()

    args = (jnp.ones((3, 3)), jnp.ones((2, 3)))
    # unknown primitive: the default policy's fallback runs it exactly as traced (float32)
    ops = [operand_dtypes(e) for e, _ in walk(jax.make_jaxpr(amp(f))(*args)) if e.primitive is prim]
    assert ops == [("float32",)]

    seen = []

    @autocast.register_rule(prim)
    def half_rule(compute_dtype, original_dtypes, *invars, **params):
        seen.append((np.dtype(compute_dtype), tuple(original_dtypes)))
        return autocast.use_compute_precision(compute_dtype, original_dtypes, *invars, **params)

    try:
        ops = [operand_dtypes(e) for e, _ in walk(jax.make_jaxpr(amp(f))(*args)) if e.primitive is prim]
        assert ops == [("float16",)]
        assert seen[-1] == (np.dtype("float16"), (np.dtype("float32"),))
        np.testing.assert_allclose(amp(f)(*args), f(*args))
    finally:
        autocast.unregister_rule(prim)


def test_register_rule_errors():
    with pytest.raises(TypeError, match="is not a jax Primitive"):
        autocast.register_rule("exp", autocast.use_float32_precision)
    with pytest.raises(TypeError, match="rule=3 is not callable"):
        autocast.register_rule(jax.lax.exp_p, 3)
    with pytest.raises(ValueError, match="dtype=.*allowed"):
        autocast.use_precision("int8")


def test_seed_rule_protocol_is_callable_directly():
    x = jnp.ones(3)
    (a, b), params = autocast.use_compute_precision(jnp.float16, [jnp.float32, jnp.int32], x, jnp.arange(3), foo=1)
    assert a.dtype == jnp.float16 and b.dtype == jnp.int32 and params == {"foo": 1}
    (a,), _ = autocast.use_original_precision(jnp.float16, [jnp.float32], x.astype(jnp.float16))
    assert a.dtype == jnp.float32
    (a, b), _ = autocast.use_widest_precision(jnp.float16, [jnp.float32] * 2, x.astype(jnp.float16), x)
    assert a.dtype == b.dtype == jnp.float32


def test_library_module_scopes_select_rules():
    """Equinox modules run under a named scope of their class name, Flax Linen modules under
    their module names: both can key a policy."""
    import equinox as eqx
    import flax.linen as nn

    mlp = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
    keep_linear = autocast.extend_policy({"eqx.nn.Linear": autocast.use_original_precision})
    counts = compute_op_dtypes(lambda x: amp(lambda m, x: m(x), amp_policy=keep_linear)(mlp, x), jnp.ones(4))
    assert counts == {("dot_general", "float32", False): 3}

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3, name="head")(nn.Dense(4, name="body")(x))

    net = Net()
    params = net.init(jax.random.key(0), jnp.ones((2, 4)))
    keep_head = autocast.extend_policy({"head": autocast.use_original_precision})
    counts = compute_op_dtypes(amp(net.apply, amp_policy=keep_head), params, jnp.ones((2, 4)))
    assert counts == {("dot_general", "float16", False): 1, ("dot_general", "float32", False): 1}


# --- extends: a policy file that lists only its difference from another -------------------


def _write(path, text):
    path.write_text(text)
    return path


def test_a_file_extending_default_moves_the_primitives_it_names(tmp_path):
    mine = _write(
        tmp_path / "mine.toml",
        'schema = 1\nextends = "default"\n[primitives]\nfloat32 = ["tanh"]\nas_is = ["exp"]\n'
        '[scopes]\n"head" = "float32"\n',
    )
    policy, default = autocast.load_policy(mine), autocast.default_amp_policy
    assert policy[jax.lax.tanh_p] is autocast.use_float32_precision  # input in the default table
    assert policy[jax.lax.exp_p] is autocast.use_as_is  # float32 in the default table
    assert policy["head"] is autocast.use_float32_precision
    assert policy.name == str(mine)  # its own name: the file's path when it has none
    # every other primitive, scope and the fallback: the default policy's rule
    for prims in _compat.discover_primitives().values():
        for prim in prims:
            if prim not in (jax.lax.tanh_p, jax.lax.exp_p):
                assert policy.get(prim) is default.get(prim), prim.name
    assert policy["amp_stop"] is default["amp_stop"] and policy["amp_default"] is default["amp_default"]
    assert policy.unresolved == default.unresolved

    # what amp does with it: tanh's operand in float32 where the default keeps it half
    def f(w, x):
        return (jnp.tanh(x @ w) @ w).sum()

    def tanh_operands(p):
        jaxpr = jax.make_jaxpr(amp(f, amp_policy=p))(jnp.ones((3, 3)), jnp.ones((2, 3)))
        return [operand_dtypes(e) for e, _ in walk(jaxpr) if e.primitive.name == "tanh"]

    assert tanh_operands(default) == [("float16",)] and tanh_operands(policy) == [("float32",)]


def test_extends_a_relative_path_chain_and_overrides(tmp_path):
    (tmp_path / "base").mkdir()
    _write(
        tmp_path / "base" / "half.toml",
        'schema = 1\nextends = "matmul_only"\nname = "half"\ndescription = "base"\n'
        '[primitives]\ninput = ["add", "tanh"]\n[scopes]\n"blk" = "float32"\n',
    )
    top = _write(
        tmp_path / "top.toml",
        'schema = 1\nextends = "base/half.toml"\nfallback = "input"\nname = "top"\n'
        '[primitives]\nfloat32 = ["add"]\n[scopes]\n"blk" = "compute"\n"out" = "original"\n',
    )
    policy = autocast.load_policy(top)
    assert policy.name == "top"
    assert policy[jax.lax.add_p] is autocast.use_float32_precision  # moved out of the base's input
    assert policy[jax.lax.tanh_p] is autocast.use_input_precision  # from half.toml
    assert policy[jax.lax.dot_general_p] is autocast.use_compute_precision  # from matmul_only
    assert jax.lax.exp_p not in policy  # matmul_only does not name it
    assert policy["amp_default"] is autocast.use_input_precision  # fallback overridden
    assert policy["blk"] is autocast.use_compute_precision and policy["out"] is autocast.use_original_precision
    assert policy["amp_stop"] is autocast.use_original_precision  # matmul_only's scope, kept
    assert autocast.load_policy(tmp_path / "base" / "half.toml")["amp_default"] is autocast.use_original_precision


def test_extends_errors_are_clear(tmp_path):
    a = _write(tmp_path / "a.toml", 'schema = 1\nextends = "b.toml"\n')
    _write(tmp_path / "b.toml", 'schema = 1\nextends = "a.toml"\n')
    with pytest.raises(ValueError, match=r"'extends' makes a cycle: .*a\.toml -> .*b\.toml -> .*a\.toml"):
        autocast.load_policy(a)
    itself = _write(tmp_path / "self.toml", 'schema = 1\nextends = "self.toml"\n')
    with pytest.raises(ValueError, match="'extends' makes a cycle"):
        autocast.load_policy(itself)
    typo = _write(tmp_path / "typo.toml", 'schema = 1\nextends = "defualt"\n')
    with pytest.raises(ValueError, match=r"extends = 'defualt' is not a shipped policy; .*\['default', 'fp8'"):
        autocast.load_policy(typo)
    missing = _write(tmp_path / "missing.toml", 'schema = 1\nextends = "nowhere/base.toml"\n')
    with pytest.raises(ValueError, match=r"extends = 'nowhere/base.toml': no such file .*nowhere/base\.toml"):
        autocast.load_policy(missing)
    not_str = _write(tmp_path / "n.toml", "schema = 1\nextends = 3\n")
    with pytest.raises(ValueError, match="extends = 3 is not a name or a path"):
        autocast.load_policy(not_str)
    misspelt_key = _write(tmp_path / "k.toml", 'schema = 1\nextend = "default"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['extend'\]; allowed: .*'extends'"):
        autocast.load_policy(misspelt_key)
    twice = _write(
        tmp_path / "t.toml", 'schema = 1\nextends = "default"\n[primitives]\ninput = ["exp"]\nas_is = ["exp"]\n'
    )
    with pytest.raises(ValueError, match=r"'exp' is listed in both \[primitives\]\.input and \.as_is"):
        autocast.load_policy(twice)
    _write(tmp_path / "bad_base.toml", 'schema = 1\n[primitives]\nfast = ["add"]\n')
    on_bad = _write(tmp_path / "on_bad.toml", 'schema = 1\nextends = "bad_base.toml"\n')
    with pytest.raises(ValueError, match=r"bad_base\.toml: unknown category 'fast'"):
        autocast.load_policy(on_bad)
