"""The HLO reader of the GPU benchmarks (``benchmarks/gpu_modeled/hlo_model.py``) on small HLO texts.

Pure text: no JAX, no plugin; these run in every lane. The snippets are cut down from what
XLA:GPU prints for the H100 target (``compiled.as_text()``); the bytes and FLOPs are worked
out by hand. ``tests/test_gpu_roofline.py`` checks the same figures on programs compiled for
the target (GPU-program lane).
"""

from __future__ import annotations

import pytest

from benchmarks.gpu_modeled import hlo_model as H

BW, LAUNCH = 3.35e12, 2e-6

CUBLAS_BF16 = """
HloModule jit_f, is_scheduled=true
ENTRY %main.1 (a.1: bf16[512,1024], b.1: bf16[1024,256]) -> bf16[512,256] {
  %b.1 = bf16[1024,256]{1,0} parameter(1), metadata={op_name="b"}
  %a.1 = bf16[512,1024]{1,0} parameter(0), metadata={op_name="a"}
  %custom-call.1 = (bf16[512,256]{1,0}, s8[4194304]{0}) custom-call(%a.1, %b.1), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"beta":0,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  ROOT %get-tuple-element.1 = bf16[512,256]{1,0} get-tuple-element(%custom-call.1), index=0
}
"""

TRITON_SPLIT_K = """
HloModule jit_f, is_scheduled=true
%fused_computation.gemm_fusion_dot_computation (param_0: bf16[512,8,128], param_1: bf16[8,128,256]) -> f32[8,512,256] {
  %param_0 = bf16[512,8,128]{2,1,0} parameter(0)
  %param_1 = bf16[8,128,256]{2,1,0} parameter(1)
  ROOT %dot.1 = f32[8,512,256]{2,1,0} dot(%param_0, %param_1), lhs_batch_dims={1}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}
%add (lhs: f32[], rhs: f32[]) -> f32[] {
  %rhs = f32[] parameter(1)
  %lhs = f32[] parameter(0)
  ROOT %add.1 = f32[] add(%lhs, %rhs)
}
%fused_reduce (param_0.2: f32[8,512,256]) -> bf16[512,256] {
  %param_0.2 = f32[8,512,256]{2,1,0} parameter(0)
  %constant_2 = f32[] constant(0)
  %reduce.2 = f32[512,256]{1,0} reduce(%param_0.2, %constant_2), dimensions={0}, to_apply=%add
  ROOT %convert.2 = bf16[512,256]{1,0} convert(%reduce.2)
}
ENTRY %main.1 (a.1: bf16[512,1024], b.1: bf16[1024,256]) -> bf16[512,256] {
  %b.1 = bf16[1024,256]{1,0} parameter(1)
  %bitcast.1.0 = bf16[8,128,256]{2,1,0} bitcast(%b.1)
  %a.1 = bf16[512,1024]{1,0} parameter(0)
  %bitcast.2 = bf16[512,8,128]{2,1,0} bitcast(%a.1)
  %gemm_fusion_dot = f32[8,512,256]{2,1,0} fusion(%bitcast.2, %bitcast.1.0), kind=kCustom, calls=%fused_computation.gemm_fusion_dot_computation, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  ROOT %loop_reduce_fusion = bf16[512,256]{1,0} fusion(%gemm_fusion_dot), kind=kLoop, calls=%fused_reduce
}
"""

CONV = """
HloModule jit_g, is_scheduled=true
ENTRY %main (x: bf16[64,224,224,3], w: bf16[768,16,16,3]) -> bf16[64,14,14,768] {
  %x = bf16[64,224,224,3]{3,2,1,0} parameter(0)
  %w = bf16[768,16,16,3]{3,2,1,0} parameter(1)
  %cudnn-conv.1 = (bf16[64,14,14,768]{3,2,1,0}, u8[0]{0}) custom-call(%x, %w), window={size=16x16 stride=16x16}, dim_labels=b01f_o01i->b01f, custom_call_target="__cudnn$convForward", backend_config={"cudnn_conv_backend_config":{"conv_result_scale":1}}
  ROOT %gte = bf16[64,14,14,768]{3,2,1,0} get-tuple-element(%cudnn-conv.1), index=0
}
"""

# a loop: the body's kernels run known_trip_count times; nested tuple shapes on the while
LOOP = """
HloModule jit_h, is_scheduled=true
%body (p: (s32[], (f32[1024], f32[1024]))) -> (s32[], (f32[1024], f32[1024])) {
  %p = (s32[], (f32[1024]{0}, f32[1024]{0})) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %xy = (f32[1024]{0}, f32[1024]{0}) get-tuple-element(%p), index=1
  %x = f32[1024]{0} get-tuple-element(%xy), index=0
  %y = f32[1024]{0} get-tuple-element(%xy), index=1
  %next = s32[] fusion(%i), kind=kLoop, calls=%inc
  %z = f32[1024]{0} fusion(%x, %y), kind=kLoop, calls=%mul
  %t = (f32[1024]{0}, f32[1024]{0}) tuple(%z, %y)
  ROOT %out = (s32[], (f32[1024]{0}, f32[1024]{0})) tuple(%next, %t)
}
%cond (p: (s32[], (f32[1024], f32[1024]))) -> pred[] {
  %p = (s32[], (f32[1024]{0}, f32[1024]{0})) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] fusion(%i), kind=kLoop, calls=%less
}
ENTRY %main (a: f32[1024], b: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[1024]{0} parameter(1)
  %zero = s32[] constant(0)
  %ab = (f32[1024]{0}, f32[1024]{0}) tuple(%a, %b)
  %init = (s32[], (f32[1024]{0}, f32[1024]{0})) tuple(%zero, %ab)
  %w = (s32[], (f32[1024]{0}, f32[1024]{0})) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %res = (f32[1024]{0}, f32[1024]{0}) get-tuple-element(%w), index=1
  ROOT %r = f32[1024]{0} get-tuple-element(%res), index=0
}
"""


def test_shapes_and_bytes():
    assert H.nbytes("bf16[512,256]{1,0}") == 512 * 256 * 2
    assert H.nbytes("f32[]") == 4 and H.nbytes("pred[10]{0}") == 10
    assert H.nbytes("f8e4m3fn[16,16]{1,0}") == 256 and H.nbytes("f8e5m2[4]{0}") == 4
    assert H.nbytes("s4[3]{0}") == 2  # sub-byte types packed, rounded up
    assert H.nbytes("(f32[2,3]{1,0}, (s8[5]{0}, bf16[]))") == 24 + 5 + 2
    assert H.arrays("(f32[2]{0}, s32[])") == [("f32", (2,)), ("s32", ())]
    assert H.dtype("(bf16[2]{0}, s8[4]{0})") == "bf16"
    with pytest.raises(ValueError, match="unknown HLO element type"):
        H.nbytes("zz[3]")


def test_parse_nested_tuples_and_operands():
    ins = H.parse_instr(
        "  %w = (s32[], (f32[4]{0}, f32[4]{0})) while(%init), condition=%cond, body=%body, "
        'backend_config={"known_trip_count":{"n":"5"}}'
    )
    assert ins is not None and ins.op == "while" and ins.args == ("init",)
    assert ins.shape == "(s32[], (f32[4]{0}, f32[4]{0}))"
    ins = H.parse_instr("  ROOT %f = bf16[2]{0} fusion(%a.1, %b.2), kind=kLoop, calls=%fused")
    assert (ins.name, ins.op, ins.args) == ("f", "fusion", ("a.1", "b.2"))
    assert H.parse_instr("HloModule jit_f") is None


def test_cublas_gemm_bytes_flops_and_time():
    """A [512,1024] x [1024,256] bf16 cuBLASLt call: the workspace is not traffic."""
    (k,) = H.kernel_costs(CUBLAS_BF16)
    assert k.bytes == 512 * 1024 * 2 + 1024 * 256 * 2 + 512 * 256 * 2
    assert k.flops == 2 * 512 * 256 * 1024
    assert k.time_s == pytest.approx(max(k.bytes / BW, k.flops / 989e12) + LAUNCH, rel=1e-12)
    r = H.roofline(CUBLAS_BF16)
    assert (r["kernels"], r["gemm_kernels"], r["hbm_bytes"], r["gemm_flops"]) == (1, 1, k.bytes, k.flops)
    assert r["other_time_s"] == 0 and r["time_s"] == r["gemm_time_s"] == k.time_s
    assert r["flop_bound_gemm_kernels"] == 0  # 1.8 MB at 3.35 TB/s outlasts 0.27 GFLOP at 989 TFLOP/s


def test_peak_by_operand_type():
    f32 = CUBLAS_BF16.replace("bf16[", "f32[")
    f8 = CUBLAS_BF16.replace("bf16[", "f8e4m3fn[")
    (k32,), (k8,) = H.kernel_costs(f32), H.kernel_costs(f8)
    assert k32.gemm_s == pytest.approx(2 * 512 * 256 * 1024 / 495e12)
    assert k8.gemm_s == pytest.approx(2 * 512 * 256 * 1024 / 1979e12)
    assert H.H100_SXM.peak("f8e5m2", "f8e4m3fn") == 1979e12
    assert H.H100_SXM.peak("bf16", "f16") == 989e12 and H.H100_SXM.peak("bf16", "f32") == 495e12


def test_triton_split_k_gemm_and_its_reduction():
    """XLA's default split-K Triton GEMM: float32 partial sums [8, 512, 256] out of the GEMM
    fusion, summed and converted by a second kernel."""
    gemm, red = H.kernel_costs(TRITON_SPLIT_K)
    partial = 8 * 512 * 256 * 4
    assert (gemm.op, gemm.bytes, gemm.flops) == (
        "fusion",
        512 * 1024 * 2 + 1024 * 256 * 2 + partial,
        2 * 512 * 256 * 1024,
    )
    assert (red.bytes, red.flops, red.gemm_s) == (partial + 512 * 256 * 2, 0, 0.0)
    assert red.time_s == pytest.approx(red.bytes / BW + LAUNCH)
    r = H.roofline(TRITON_SPLIT_K)
    assert (r["kernels"], r["gemm_kernels"]) == (2, 1)
    assert r["gemm_bytes"] == gemm.bytes and r["other_bytes"] == red.bytes
    assert r["time_s"] == pytest.approx(gemm.time_s + red.time_s)
    assert r["other_time_s"] == pytest.approx(red.time_s)
    c = H.census(TRITON_SPLIT_K)
    assert c["kernels"] == 2 and c["gemm_kernels"] == 1 and c["gemm_types"] == {"bf16 x bf16 -> f32": 1}


def test_convolution_flops():
    """The ViT-Base patch embedding: each output element is a 16 x 16 x 3 window."""
    (k,) = H.kernel_costs(CONV)
    out = 64 * 14 * 14 * 768
    assert k.flops == 2 * out * 16 * 16 * 3
    assert k.bytes == (64 * 224 * 224 * 3 + 768 * 16 * 16 * 3 + out) * 2  # scratch u8[0] left out
    assert H.census(CONV)["convolutions"] == {"bf16 x bf16": 1}


def test_loop_body_counts_its_trips():
    runs = H.launch_computations(*H.parse(LOOP))
    assert runs == {"main": 1, "cond": 5, "body": 5}
    ks = H.kernel_costs(LOOP)
    assert sorted((k.name, k.runs) for k in ks) == [("lt", 5), ("next", 5), ("z", 5)]
    z = next(k for k in ks if k.name == "z")
    assert z.bytes == 3 * 1024 * 4
    r = H.roofline(LOOP)
    assert r["kernels"] == 15 and r["hbm_bytes"] == 5 * (3 * 4096 + 4 + 4 + 4 + 1)
    assert H.census(LOOP)["kernels"] == 3  # the census counts a body once


def test_the_device_names_the_chip_whose_rates_model_it():
    """A measured run models its step at its own device's rates: an H200's bandwidth is the
    H100's x 4.8 / 3.35 and its GEMM peaks the H100's, so a memory-bound kernel is faster and
    a GEMM-bound one is not."""
    assert H.chip_for("NVIDIA H200") is H.H200_SXM and H.chip_for("NVIDIA H100 80GB HBM3") is H.H100_SXM
    (h100,) = H.kernel_costs(CUBLAS_BF16, H.H100_SXM)
    (h200,) = H.kernel_costs(CUBLAS_BF16, H.H200_SXM)
    assert h200.bytes == h100.bytes and h200.gemm_s == h100.gemm_s
    assert h200.time_s == pytest.approx(max(h100.bytes / 4.8e12, h100.gemm_s) + LAUNCH)
