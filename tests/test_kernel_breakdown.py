"""``benchmarks/gpu_modeled/kernel_breakdown.py``: a compiled step's kernels grouped by part of the model.

On a hand-written HLO text (no compile): each kernel lands in the group its op name says,
with the roofline model's time and bytes of that kernel; the GPU-target compile itself is the
benchmark's (run in docs/gpu-benchmark.md, not here)."""

from __future__ import annotations

import gzip
import json

import pytest

from autocast import _compat
from benchmarks import _common as C
from benchmarks.gpu_modeled import hlo_model as H
from benchmarks.gpu_modeled import kernel_breakdown as K

HLO = """
HloModule jit_step, is_scheduled=true
%fused_norm (p0: f32[64,768]) -> bf16[64,768] {
  %p0 = f32[64,768]{1,0} parameter(0)
  ROOT %c = bf16[64,768]{1,0} convert(%p0), metadata={op_name="jit(step)/transpose(jvp(jvp()))/checkpoint/rematted_computation/vmap(eqx.nn.LayerNorm)/convert_element_type"}
}
ENTRY %main.1 (a.1: bf16[512,1024], b.1: bf16[1024,256], x.1: f32[64,768]) -> (bf16[512,256], bf16[64,768]) {
  %b.1 = bf16[1024,256]{1,0} parameter(1), metadata={op_name="b"}
  %a.1 = bf16[512,1024]{1,0} parameter(0), metadata={op_name="a"}
  %x.1 = f32[64,768]{1,0} parameter(2), metadata={op_name="x"}
  %custom-call.1 = (bf16[512,256]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}, metadata={op_name="jit(step)/transpose(jvp(vmap(eqx.nn.MultiheadAttention)))/vmap(sd,Sd->sS)/dot_general"}
  %gte.1 = bf16[512,256]{1,0} get-tuple-element(%custom-call.1), index=0
  %fusion.1 = bf16[64,768]{1,0} fusion(%x.1), kind=kLoop, calls=%fused_norm, metadata={op_name="jit(step)/transpose(jvp(jvp()))/checkpoint/rematted_computation/vmap(eqx.nn.LayerNorm)/convert_element_type"}
  ROOT %tuple.1 = (bf16[512,256]{1,0}, bf16[64,768]{1,0}) tuple(%gte.1, %fusion.1)
}
"""


def test_kernels_land_in_the_group_their_op_name_says():
    gemm, norm = H.kernel_costs(HLO)
    rows = K.breakdown(HLO)
    assert set(rows) == {"backward: attention, GEMM", "backward: layer norm, recomputed"}
    assert rows["backward: attention, GEMM"]["ms"] == pytest.approx(gemm.time_s * 1e3)
    assert rows["backward: attention, GEMM"]["MiB"] == pytest.approx(gemm.bytes / 2**20)
    assert rows["backward: layer norm, recomputed"]["MiB"] == pytest.approx((64 * 768 * 6) / 2**20)
    assert rows["backward: layer norm, recomputed"]["kernels"] == 1


@pytest.mark.parametrize(
    "op, part",
    [
        ("jit(step)/jvp(vmap(eqx.nn.MultiheadAttention))/vmap()/reduce_sum", "attention"),
        ("jit(step)/jvp(vmap(vmap(eqx.nn.LayerNorm)))/reduce_sum", "layer norm"),
        ("jit(step)/transpose(jvp(vmap(vmap(eqx.nn.Linear))))/dot_general", "linear"),
        ("jit(<lambda>)/select_n", "optimizer"),
        ("jit(<lambda>)/jvp(vmap())/add", "other"),
    ],
)
def test_part_of_an_op_name(op, part):
    assert K.part(op) == part


def test_benchmark_metadata_names_the_jax_flags_that_change_the_program():
    """A result compiled under ``jax_softmax_custom_jvp`` (or another upgrade flag) says so:
    the flag changes the program, so its figures are not comparable with a run without it."""
    flag = _compat.hijax_flags()["softmax_custom_jvp"]
    with flag(False):
        assert "jax_softmax_custom_jvp" not in C.jax_flags()
    with flag(True):
        meta = C.metadata()
        assert meta["jax_flags"].get("jax_softmax_custom_jvp") is True
        assert "- JAX flags on: jax_softmax_custom_jvp" in C.metadata_markdown(meta)


def test_saved_steps_are_read_instead_of_compiled(tmp_path):
    """``--hlo-dir``: the steps ``benchmarks.gpu_measured.gpu --save-hlo`` wrote (``<step>-<system>.hlo.gz``
    and its ``.json``) are broken down as they are, their peaks and commit carried over."""
    for system, peak in (("autocast-bf16", 3 * 2**20), ("mpx-bf16", 5 * 2**20)):
        with gzip.open(tmp_path / f"m-x1-cublas-{system}.hlo.gz", "wt") as f:
            f.write(HLO)
        (tmp_path / f"m-x1-cublas-{system}.json").write_text(
            json.dumps({"memory": {"peak": peak}, "git_commit": "abc"})
        )
    out = tmp_path / "out"
    report = K.main(["--hlo-dir", str(tmp_path), "--step", "m-x1-cublas", "--out-dir", str(out), "--label", "t"])
    want = sum(c.time_s for c in H.kernel_costs(HLO)) * 1e3
    for system, peak_mib in (("autocast-bf16", 3), ("mpx-bf16", 5)):
        assert report["systems"][system]["ms"] == pytest.approx(want)
        assert report["systems"][system]["peak_MiB"] == peak_mib
    assert report["mode"] == "cublas" and "commit abc" in report["description"]
    assert len(list(out.glob("kernel-breakdown-t-*.md"))) == 1
    with pytest.raises(SystemExit, match="no m-x4-cublas-autocast-bf16.hlo.gz"):
        K.main(["--hlo-dir", str(tmp_path), "--step", "m-x4-cublas", "--out-dir", str(out)])
