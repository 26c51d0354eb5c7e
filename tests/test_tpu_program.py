"""The TPU program of train steps, checked on a machine without a TPU (issue 48).

libtpu compiles for a one-chip TPU v5e described by its topology API ("deviceless" XLA:TPU,
:mod:`benchmarks.tpu_modeled.tpu`): the optimised TPU program, its buffer assignment and XLA's
cost analysis come back, nothing runs. On the benchmark's 2-block GPT (GPT-2 small's
vocabulary of 50,257, width 768, batch 8 x 1,024 tokens: issue 48's model, whose amp temp was
above MPX's before the loss-head rewrite; a TPU compile's time depends on the program's size,
hardly on the batch), AdamW, parameters and optimizer state donated:

- amp bfloat16's program has no float32 x float32 matmul (XLA:TPU writes matmuls as
  convolutions; :mod:`benchmarks.tpu_modeled.census` finds them by the ``dot_general`` op_name),
  and every matmul reads bfloat16 operands;
- every attention layer of amp's program is a splash attention kernel (Pallas/Mosaic
  ``tpu_custom_call`` s, a forward and a backward per layer, counted by name);
- amp's temp memory is not above MPX's (issue 48's target for every benchmark model; MPX's
  committed figure, which the guard below checks against MPX's step compiled here);
- temp memory and bytes accessed (XLA's cost analysis) at most 2 % above the committed figures
  (``benchmarks/results/tpu_modeled/guard-v5e.json``; the compile is deterministic, so a rise
  is a change in the program; ``AUTOCAST_UPDATE_TPU_GUARD=1`` rewrites the file from this run).

The census itself is checked on HLO text and on small programs compiled for the v5e (a float32
and a bfloat16 matmul, a convolution, a Pallas kernel, a causal splash attention forward and
backward), so that "no float32 matmul" cannot pass by finding no matmul at all, nor "every layer
a kernel" by a name the census does not know. ``docs/tpu.md`` 's deviceless example runs here and
must print what the page shows.

Runs in ``bash tests/run_tpu_program.sh`` (``.venv-tpu``: ``jax[tpu]``, libtpu), which sets
``AUTOCAST_TPU_LANE=1``: there a missing libtpu fails the compiling tests. Elsewhere they skip,
saying so; the HLO-text tests run in every lane.
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import re
from pathlib import Path

from helpers import require_libtpu

from benchmarks.tpu_modeled import census as K

ROOT = Path(__file__).resolve().parent.parent
GUARD_FILE = ROOT / "benchmarks" / "results" / "tpu_modeled" / "guard-v5e.json"
DOCS_PAGE = ROOT / "docs" / "tpu.md"
GUARD_MODEL, TARGET = "gpt2-2blocks", "v5e"
GUARD_LAYERS = 2  # the guard model's attention layers (its blocks)
SLACK = 0.02  # temp and bytes accessed may grow by 2 % before the guard fails
AMP, MPX = "autocast-bf16", "mpx-bf16"


@functools.cache
def _sharding():
    from benchmarks.tpu_modeled import tpu

    return tpu.target_sharding(TARGET)


@functools.cache
def _step(system: str) -> dict:
    """The guard model's step for ``system``, compiled once per process."""
    from benchmarks.tpu_modeled import tpu

    return tpu.compile_system(tpu.make_task(GUARD_MODEL), system, _sharding())


# ----------------------------------------------------------------------------- the census, on HLO text

_HLO = """\
HloModule jit_step, is_scheduled=true

%fused_matmul (p0: bf16[64,32], p1: bf16[32,16]) -> f32[64,16] {
  %p0 = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[32,16]{1,0:T(8,128)(2,1)} parameter(1)
  ROOT %convolution.1 = f32[64,16]{1,0:T(8,128)} convolution(%p0, %p1), dim_labels=bf_io->bf, metadata={op_name="jit(step)/jvp(eqx.nn.Linear)/dot_general"}
}

%fused_f32 (q0: f32[64,32], q1: f32[32,16]) -> f32[64,16] {
  %q0 = f32[64,32]{1,0:T(8,128)} parameter(0)
  %q1 = f32[32,16]{1,0:T(8,128)} parameter(1)
  ROOT %convolution.2 = f32[64,16]{1,0:T(8,128)} convolution(%q0, %q1), dim_labels=bf_io->bf, metadata={op_name="jit(step)/amp_stop/dot_general"}
}

ENTRY %main (a: bf16[64,32], b: bf16[32,16], c: f32[64,32], d: f32[32,16], e: f32[8,3,16,16], k: f32[4,3,2,2]) -> f32[64,16] {
  %a = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(0)
  %b = bf16[32,16]{1,0:T(8,128)(2,1)} parameter(1)
  %c = f32[64,32]{1,0:T(8,128)} parameter(2)
  %d = f32[32,16]{1,0:T(8,128)} parameter(3)
  %e = f32[8,3,16,16]{3,2,1,0:T(8,128)} parameter(4)
  %k = f32[4,3,2,2]{3,2,1,0:T(8,128)} parameter(5)
  %fusion.1 = f32[64,16]{1,0:T(8,128)} fusion(%a, %b), kind=kOutput, calls=%fused_matmul
  %fusion.2 = f32[64,16]{1,0:T(8,128)} fusion(%c, %d), kind=kOutput, calls=%fused_f32
  %dot.3 = f32[64,16]{1,0:T(8,128)} dot(%c, %d), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(step)/dot_general"}
  %convolution.4 = f32[8,4,8,8]{3,2,1,0:T(8,128)} convolution(%e, %k), window={size=2x2 stride=2x2}, dim_labels=bf01_oi01->bf01, metadata={op_name="jit(step)/conv_general_dilated"}
  %custom-call.5 = f32[64,16]{1,0:T(8,128)} custom-call(%fusion.1), custom_call_target="tpu_custom_call", backend_config="{}"
  %custom-call.6 = f32[64,16]{1,0:T(8,128)} custom-call(%fusion.1), custom_call_target="ConcatBitcast"
  %while.8 = (s32[]) while(%t), condition=%cond, body=%body, metadata={op_name="jit(step)/jvp()/while"}
  %while.9 = (s32[]) while(%t), condition=%cond, body=%body, metadata={op_name="jit(step)/transpose(jvp())/scatter-add"}
  ROOT %add.7 = f32[64,16]{1,0:T(8,128)} add(%fusion.2, %dot.3)
}
"""


def test_census_reads_tpu_matmuls_written_as_convolutions():
    c = K.census(_HLO)
    assert c["matmuls"] == {"bf16 x bf16": 1, "f32 x f32": 2}
    assert c["matmul_types"] == {"bf16 x bf16 -> f32": 1, "f32 x f32 -> f32": 2}
    assert (c["f32_matmuls"], c["f32_matmuls_in_amp_stop"]) == (1, 1)  # the dot outside, the fusion's inside
    assert c["convolutions"] == {"f32 x f32": 1} and c["f32_convolutions"] == 1
    assert c["mosaic_kernels"] == 1 and c["kernels"] == {"custom-call": 1}
    assert c["custom_calls"] == {"tpu_custom_call": 1, "ConcatBitcast": 1}
    assert c["fusions"] == 2
    assert (c["while_loops"], c["jax_loops"]) == (2, 1)  # a scan's loop, XLA's loop of a scatter


# A splash attention forward and backward as XLA:TPU prints them (cut from a deviceless v5e
# compile of make_splash_mha, JAX 0.12.0.1): a kernel's frontend_attributes hold JSON with
# newlines, so each custom call spans three lines; its name is the pallas_call's
_SPLASH_HLO = """\
HloModule jit_loss, is_scheduled=true

ENTRY %main (q: bf16[2,2,256,64]) -> bf16[2,2,256,64] {
  %q = bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)} parameter(0)
  %splash_mha_fwd_residuals.1 = (bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)}, f32[2,2,256,128]{3,2,1,0:T(8,128)}) custom-call(%q, %q, %q), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{\\"block_q\\": 128, \\"use_fused_bwd_kernel\\": false}"
}}, metadata={op_name="jit(loss)/jvp(vmap(static_sparsity_splash))/jit(_splash_attention)/splash_mha_fwd_residuals/splash_mha_fwd_residuals/pallas_call" stack_frame_id=4}, backend_config={"custom_call_config":{"body":"TUzvUgFNTElSMjQuMC4w"}}
  %o = bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)} get-tuple-element(%splash_mha_fwd_residuals.1), index=0
  %splash_mha_dq_no_residuals.1 = bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)} custom-call(%q, %o), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}, metadata={op_name="jit(loss)/transpose(jvp(vmap(static_sparsity_splash)))/jit(_splash_attention)/splash_mha_dq_no_residuals/splash_mha_dq_no_residuals/pallas_call" stack_frame_id=5}
  %splash_mha_dkv_no_residuals.1 = (bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)}, bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)}) custom-call(%q, %o), custom_call_target="tpu_custom_call", frontend_attributes={kernel_metadata={
"xprof_metadata":"{}"
}}, metadata={op_name="jit(loss)/transpose(jvp(vmap(static_sparsity_splash)))/jit(_splash_attention)/splash_mha_dkv_no_residuals/splash_mha_dkv_no_residuals/pallas_call" stack_frame_id=6}
  %my_kernel.3 = f32[8,128]{1,0:T(8,128)} custom-call(%q), custom_call_target="tpu_custom_call"
  ROOT %dq = bf16[2,2,256,64]{3,2,1,0:T(8,128)(2,1)} copy(%splash_mha_dq_no_residuals.1)
}
"""


def test_census_names_mosaic_kernels_written_over_several_lines():
    c = K.census(_SPLASH_HLO)
    assert c["mosaic_kernels"] == 4
    assert c["kernels"] == {
        "splash_mha_fwd_residuals": 1,
        "splash_mha_dq_no_residuals": 1,
        "splash_mha_dkv_no_residuals": 1,
        "my_kernel": 1,  # no op_name: the instruction's name without its number
    }
    assert K.attention_kernels(c["kernels"]) == {"forward": 1, "backward": 1}
    # a fused backward (one dkv kernel that also makes dq) and flash attention's names
    fused = {"splash_mqa_fwd_segmented_residuals": 2, "splash_mqa_dkv_segmented_no_residuals": 2}
    assert K.attention_kernels(fused) == {"forward": 2, "backward": 2}
    flash = {"_flash_attention_kernel": 1, "_flash_attention_dkv_kernel": 1, "_flash_attention_dq_kernel": 1}
    assert K.attention_kernels(flash) == {"forward": 1, "backward": 1}
    assert K.attention_kernels({"my_kernel": 3}) == {"forward": 0, "backward": 0}


_FUSION_HLO = """\
HloModule jit_train_step, is_scheduled=true

%fused_head (p0: bf16[4,8], p1: f32[4]) -> (bf16[4,8], f32[4,8]) {
  %p0 = bf16[4,8]{1,0} parameter(0)
  %p1 = f32[4]{0} parameter(1)
  %widened = f32[4,8]{1,0} convert(%p0), metadata={op_name="jit(train_step)/jvp()/convert_element_type"}
  %b = f32[4,8]{1,0} broadcast(%p1), dimensions={0}
  %cot = f32[4,8]{1,0} subtract(%widened, %b), metadata={op_name="jit(train_step)/transpose(jvp())/add_any"}
  %narrow = bf16[4,8]{1,0} convert(%cot)
  ROOT %tuple.1 = (bf16[4,8]{1,0}, f32[4,8]{1,0}) tuple(%narrow, %widened)
}

ENTRY %main (a: bf16[4,8], c: f32[4]) -> bf16[4,8] {
  %a = bf16[4,8]{1,0} parameter(0)
  %c = f32[4]{0} parameter(1)
  %fusion.9 = (bf16[4,8]{1,0}, f32[4,8]{1,0}) fusion(%a, %c), kind=kLoop, calls=%fused_head, metadata={op_name="jit(train_step)/transpose(jvp())/add_any"}
  ROOT %out = bf16[4,8]{1,0} get-tuple-element(%fusion.9), index=0
}
"""


def test_buffers_name_each_output_of_a_multi_output_fusion_by_its_own_op_name():
    # XLA gives a multi-output fusion one op_name (here its first output's); the value at each
    # index is what the fused computation's ROOT tuple puts there (through converts)
    from benchmarks.gpu_modeled import hlo_model as H
    from benchmarks.tpu_modeled import buffers as B

    _, comps = H.parse(_FUSION_HLO)
    instrs = {i.name: i for body in comps.values() for i in body}
    assert B.fusion_output("fusion.9", "{1}", comps, instrs) == "jit(train_step)/jvp()/convert_element_type"
    assert B.fusion_output("fusion.9", "{0}", comps, instrs) == "jit(train_step)/transpose(jvp())/add_any"
    assert B.fusion_output("fusion.9", "{}", comps, instrs) is None  # the tuple itself
    assert B.fusion_output("a", "{0}", comps, instrs) is None  # not a fusion


def test_census_of_a_module_without_matmuls():
    c = K.census("ENTRY %main (a: f32[4]) -> f32[4] {\n  ROOT %a = f32[4]{0} parameter(0)\n}\n")
    assert c["matmuls"] == {} and c["f32_matmuls"] == 0 and c["mosaic_kernels"] == 0
    assert K.cell(c["matmuls"]) == "-"


# ----------------------------------------------------------------------------- the census, on compiled programs


def test_census_of_small_programs_compiled_for_the_v5e():
    require_libtpu()
    import jax
    import jax.numpy as jnp

    sh = _sharding()

    def compiled(f, *shapes):
        args = [jax.ShapeDtypeStruct(s, dt, sharding=sh) for s, dt in shapes]
        return K.census(jax.jit(f).lower(*args).compile().as_text())

    mm = lambda a, b: a @ b  # noqa: E731
    assert compiled(mm, ((256, 512), jnp.float32), ((512, 128), jnp.float32))["matmuls"] == {"f32 x f32": 1}
    bf = compiled(mm, ((256, 512), jnp.bfloat16), ((512, 128), jnp.bfloat16))
    assert bf["matmuls"] == {"bf16 x bf16": 1} and bf["f32_matmuls"] == 0
    conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (2, 2), "VALID")  # noqa: E731
    c = compiled(conv, ((8, 3, 32, 32), jnp.bfloat16), ((16, 3, 4, 4), jnp.bfloat16))
    assert c["convolutions"] == {"bf16 x bf16": 1} and c["matmuls"] == {}
    # XLA:TPU runs a float32 convolution at JAX's default precision on bfloat16 operands (its
    # float32 matmul above keeps float32 ones): the census reads what the program does
    c = compiled(conv, ((8, 3, 32, 32), jnp.float32), ((16, 3, 4, 4), jnp.float32))
    assert c["convolutions"] == {"bf16 x bf16": 1} and c["matmuls"] == {}


def test_census_counts_a_pallas_kernel_compiled_for_the_v5e():
    require_libtpu()
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    def kernel(x_ref, o_ref):
        o_ref[...] = x_ref[...] * 2.0

    f = lambda x: pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)  # noqa: E731
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=_sharding())
    assert K.census(jax.jit(f).lower(x).compile().as_text())["mosaic_kernels"] == 1


def test_the_label_pick_is_a_masked_sum_in_the_v5e_program():
    """amp's cross-entropy step compiled for the v5e picks the label logit with a masked sum
    (`autocast._pick`: no gather, no scatter, the float32 logits not kept for them), where the
    CPU program of the same function still gathers."""
    require_libtpu()
    import jax
    import jax.numpy as jnp
    import optax

    import autocast

    def loss(w, h, y):
        return optax.softmax_cross_entropy_with_integer_labels(h @ w, y).mean()

    sh = _sharding()
    args = [
        jax.ShapeDtypeStruct((256, 4096), jnp.float32, sharding=sh),
        jax.ShapeDtypeStruct((8, 128, 256), jnp.float32, sharding=sh),
        jax.ShapeDtypeStruct((8, 128), jnp.int32, sharding=sh),
    ]
    step = jax.jit(jax.value_and_grad(autocast.amp(loss)))

    def picks(hlo: str) -> list[str]:
        return [line for line in hlo.splitlines() if re.search(r"= \S+ (gather|scatter)\(", line)]

    assert not picks(step.lower(*args).compile().as_text())
    cpu = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    assert picks(step.lower(*cpu).compile().as_text())  # (the default branch: the gather)


def test_the_chunked_head_keeps_one_logits_value_per_chunk_in_the_v5e_program():
    """amp's chunked loss head compiled for the v5e, on flattened logits (`reshape(-1, V)`, as
    the benchmark's GPT computes its loss) of GPT-2's odd vocabulary: the loop body writes one
    `[tokens, vocabulary]` value a chunk, the logits, and computes their cotangent inside the
    two matmuls that read it (the matmul makes the flat logits, `autocast._loss_head._regroup`;
    no vocabulary padding on a TPU, `_pad`). Before both, the body wrote the cotangent and a
    relayout of it too."""
    require_libtpu()
    import jax
    import jax.numpy as jnp
    import optax

    import autocast
    from benchmarks.gpu_modeled import hlo_model as H

    v, d = 50257, 128  # (the weight gradient, [v, d], smaller than a chunk's logits, [256, v])

    def loss(w, h, y):
        logits = jax.vmap(lambda x: x @ w.T)(h)
        return optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, v), y.reshape(-1)).mean()

    sh = _sharding()
    args = [
        jax.ShapeDtypeStruct((v, d), jnp.float32, sharding=sh),
        jax.ShapeDtypeStruct((8, 128, d), jnp.float32, sharding=sh),
        jax.ShapeDtypeStruct((8, 128), jnp.int32, sharding=sh),
    ]
    step = jax.jit(jax.value_and_grad(autocast.amp(loss, compute_dtype=jnp.bfloat16, loss_head=4), argnums=(0, 1)))
    hlo = step.lower(*args).compile().as_text()
    entry, comps = H.parse(hlo)
    bodies = [c for c, n in H.launch_computations(entry, comps).items() if c != entry]
    skip = {"parameter", "get-tuple-element", "bitcast", "tuple", "copy-start", "copy-done"}
    written = [
        i.name
        for c in bodies
        for i in comps[c]
        if i.op not in skip and any(math.prod(dims) >= 256 * v for _, dims in H.arrays(i.shape))
    ]
    assert len(written) == 1, written
    assert not re.search(r"\[\d*,?50304\]|\[50304,", hlo)  # no padded vocabulary


def test_census_names_a_splash_attention_compiled_for_the_v5e():
    # the names the lane's attention test looks for, read from a real compile (a few seconds):
    # causal splash attention, forward and backward, at the smallest shapes its blocks take
    require_libtpu()
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    heads, tokens = 2, 256
    kernel = sk.make_splash_mha(
        sm.MultiHeadMask([sm.CausalMask((tokens, tokens))] * heads), head_shards=1, q_seq_shards=1
    )
    loss = lambda q, k, v: jax.vmap(kernel)(q, k, v).astype(jnp.float32).sum()  # noqa: E731
    x = jax.ShapeDtypeStruct((2, heads, tokens, 64), jnp.bfloat16, sharding=_sharding())
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(x, x, x).compile().as_text()
    c = K.census(hlo)
    assert c["mosaic_kernels"] == 3 and K.attention_kernels(c["kernels"]) == {"forward": 1, "backward": 1}, c["kernels"]


def test_the_docs_deviceless_example_prints_what_the_page_shows(capsys):
    # docs/tpu.md's example is a bash block (the docs tests do not run it: it needs libtpu);
    # here its script runs as the page gives it, and prints the transcript the page shows
    require_libtpu()
    page = DOCS_PAGE.read_text()
    script = re.search(r"<<'EOF'\n(.*?)^EOF$", page, re.S | re.M)
    shown = re.search(r"It prints[^\n]*\n\n```text\n(.*?)```", page, re.S)
    assert script and shown, "docs/tpu.md: the example's heredoc or its printed transcript is missing"
    exec(compile(script.group(1), str(DOCS_PAGE), "exec"), {"__name__": "docs_tpu"})
    assert capsys.readouterr().out == shown.group(1)


# ----------------------------------------------------------------------------- the train steps


def _update_guard(key: str, figures: dict[str, int]) -> None:
    """Write ``figures`` as ``key`` 's committed ones (locked: two workers write at once)."""
    import fcntl
    import importlib.metadata

    GUARD_FILE.parent.mkdir(parents=True, exist_ok=True)
    with open(GUARD_FILE, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        text = f.read()
        table = json.loads(text) if text.strip() else {"steps": {}}
        table["steps"][key] = figures
        table["about"] = (
            f"tests/test_tpu_program.py's guard: {GUARD_MODEL} (batch 8) compiled for a TPU {TARGET} "
            f"(deviceless, libtpu {importlib.metadata.version('libtpu')}), written "
            f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d} by AUTOCAST_UPDATE_TPU_GUARD=1 bash tests/run_tpu_program.sh"
        )
        f.seek(0)
        f.truncate()
        f.write(json.dumps(table, indent=1, sort_keys=True) + "\n")


def _check_guard(system: str) -> None:
    """``system`` 's temp and bytes accessed at most 2 % above the committed (or rewritten)."""
    require_libtpu()
    info = _step(system)
    now = {"temp_bytes": info["memory"]["temp"], "bytes_accessed": int(info["cost"]["bytes_accessed"])}
    key = f"{GUARD_MODEL}-{system}"
    if os.environ.get("AUTOCAST_UPDATE_TPU_GUARD") == "1":
        _update_guard(key, now)
        return
    committed = json.loads(GUARD_FILE.read_text())["steps"]
    assert key in committed, f"no committed figures for {key}: run with AUTOCAST_UPDATE_TPU_GUARD=1"
    for field, value in now.items():
        limit = committed[key][field] * (1 + SLACK)
        assert value <= limit, (
            f"{key}: {field} {value:,} above the committed {committed[key][field]:,} by more than 2 %"
        )


# One class per compiled step: the lane runs with ``--dist loadscope``, which sends a class's
# tests to one worker, so that each step compiles once (``_step`` caches it per process).
# (``--dist loadgroup`` with ``xdist_group`` marks did not group them under pytest 9.2 and
# xdist 3.8: the amp step compiled on both workers.)


class TestAmpStep:
    """amp bfloat16's step of the guard model."""

    def test_no_float32_matmul_on_the_v5e(self):
        require_libtpu()
        c = _step(AMP)["census"]
        assert sum(c["matmuls"].values()) >= 2 * 6 * 3, c["matmuls"]  # every block's matmuls, forward and backward
        assert c["f32_matmuls"] == 0 and c["f32_matmuls_in_amp_stop"] == 0, c["matmul_types"]
        assert set(c["matmuls"]) == {"bf16 x bf16"}, c["matmul_types"]

    def test_every_attention_layer_is_a_kernel_on_the_v5e(self):
        # issue 48: amp's v5e program runs each attention layer as a splash kernel, a forward and a
        # backward (the dK/dV one; splash makes dQ in it or in a kernel of its own) per layer. The
        # forward may run twice (recomputed in the backward pass); attention written out has none.
        # (A strict xfail until the TPU attention branch landed, 6de1310; it passes since.)
        require_libtpu()
        kernels = _step(AMP)["census"]["kernels"]
        att = K.attention_kernels(kernels)
        assert att["forward"] >= GUARD_LAYERS and att["backward"] == GUARD_LAYERS, (
            f"{GUARD_LAYERS} attention layers; splash kernels {att}; Mosaic kernels by name {kernels}"
        )

    def test_temp_not_above_mpx_on_the_v5e(self):
        # MPX's temp as committed (TestMpxStep checks it against MPX's step compiled on the other
        # worker: MPX's program does not depend on amp's code, and one compile of it is enough)
        require_libtpu()
        amp = _step(AMP)["memory"]["temp"]
        mpx = json.loads(GUARD_FILE.read_text())["steps"][f"{GUARD_MODEL}-mpx-bf16"]["temp_bytes"]
        assert amp <= mpx, f"amp bf16 temp {amp / 2**20:,.0f} MiB above MPX's {mpx / 2**20:,.0f} MiB"

    def test_temp_and_bytes_accessed_within_2_percent_of_the_committed(self):
        _check_guard(AMP)


class TestMpxStep:
    """MPX bfloat16's step of the guard model."""

    def test_temp_and_bytes_accessed_within_2_percent_of_the_committed(self):
        _check_guard(MPX)
