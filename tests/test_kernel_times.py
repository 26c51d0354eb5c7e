"""``benchmarks/gpu_measured/kernel_times.py``: measured GPU time per kernel beside the roofline model's.

No GPU here: the trace is a Chrome-format trace as JAX's profiler writes it, cut down by hand;
the HLO the reader's own test snippets (``tests/test_hlo_model.py``). The profiler itself runs
on CPU, where it finds no GPU kernel.
"""

from __future__ import annotations

import gzip
import json

import jax
import jax.numpy as jnp
import pytest
from test_hlo_model import CUBLAS_BF16, TRITON_SPLIT_K

from benchmarks.gpu_measured import gpu
from benchmarks.gpu_measured import kernel_times as KT
from benchmarks.gpu_modeled import hlo_model as H


def _trace(events: list[tuple[int, str, float]]) -> dict:
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
    ]
    return {"traceEvents": meta + [{"ph": "X", "pid": pid, "tid": 1, "name": n, "dur": d} for pid, n, d in events]}


def test_gpu_events_are_summed_by_kernel_name():
    trace = _trace([(7, "loop_fusion_1", 10.0), (7, "loop_fusion_1", 5.0), (1, "loop_fusion_1", 99.0), (7, "k", 2.0)])
    assert KT.gpu_kernel_times(trace) == {"loop_fusion_1": {"us": 15.0, "n": 2}, "k": {"us": 2.0, "n": 1}}
    assert [(e["name"], e["dur"]) for e in KT.gpu_events(trace)] == [
        ("loop_fusion_1", 10.0),
        ("loop_fusion_1", 5.0),
        ("k", 2.0),
    ]


def test_measured_kernels_meet_their_modeled_cost_by_name():
    """A Triton GEMM fusion and its reduction, matched by name (``.`` or ``_``); what no
    fusion name matches (cuBLAS's own kernel names) is library time."""
    costs = {k.name: k.time_s * 1e3 for k in H.kernel_costs(TRITON_SPLIT_K)}
    measured = {"gemm_fusion_dot": {"us": 30.0, "n": 1}, "loop_reduce_fusion": {"us": 8.0, "n": 1}}
    out = KT.compare(TRITON_SPLIT_K, measured)
    (gemm,) = [g for k, g in out["groups"].items() if k.endswith("GEMM")]
    assert gemm == {"measured_ms": 0.03, "modeled_ms": pytest.approx(costs["gemm_fusion_dot"]), "kernels": 1}
    assert out["measured_ms"] == pytest.approx(0.038) and out["modeled_ms"] == pytest.approx(sum(costs.values()))
    # a kernel named after its fusion with a suffix of its own is that fusion's; another
    # fusion's number is not
    suffixed = {"gemm_fusion_dot_impl": {"us": 30.0, "n": 1}, "loop_reduce_fusion_1": {"us": 8.0, "n": 1}}
    out = KT.compare(TRITON_SPLIT_K, suffixed)
    assert out["measured_ms"] == pytest.approx(0.038) and out["unmatched"] == [("loop_reduce_fusion_1", 0.008)]
    out = KT.compare(CUBLAS_BF16, {"sm90_xmma_gemm_bf16bf16_bf16f32": {"us": 12.0, "n": 1}})
    assert out["groups"]["library"]["measured_ms"] == pytest.approx(0.012)
    assert out["groups"]["library"]["modeled_ms"] == pytest.approx(H.kernel_costs(CUBLAS_BF16)[0].time_s * 1e3)
    assert out["unmatched"] == [("sm90_xmma_gemm_bf16bf16_bf16f32", 0.012)]


def test_saved_steps_are_compared_system_by_system(tmp_path, capsys):
    for system, us in (("a", 30.0), ("b", 60.0)):
        (tmp_path / f"s-x1-triton-{system}.hlo.gz").write_bytes(gzip.compress(TRITON_SPLIT_K.encode()))
        (tmp_path / f"s-x1-triton-{system}.kernels.json").write_text(
            json.dumps({"gemm_fusion_dot": {"us": us, "n": 1}})
        )
    md = KT.main([str(tmp_path), "s-x1-triton", "a", "b"])
    assert "| all | 0.030 (" in md and md.count("0.060 (") == 2  # the GEMM group and the total of b
    # modeled at the rates of the GPU measured: an H200's bandwidth makes the model faster
    h200 = KT.main(["--device-kind", "NVIDIA H200", str(tmp_path), "s-x1-triton", "a"])
    assert "H200 SXM's rates" in h200 and "H100 SXM's rates" in md
    modeled = lambda table: float(table.splitlines()[-1].split("|")[2].split("(")[1].rstrip(") "))  # noqa: E731
    assert modeled(h200) < modeled(md)  # system a's whole step
    with pytest.raises(SystemExit, match="no s-x1-triton-c.hlo.gz"):
        KT.main([str(tmp_path), "s-x1-triton", "c"])


def test_profile_runs_the_step_under_the_profiler(tmp_path):
    """On CPU the trace has no GPU process: nothing measured, but the step ran under it."""
    calls = []
    f = jax.jit(lambda x: jnp.sin(x) * 2)

    def run():
        calls.append(1)
        return f(jnp.ones(8))

    events = tmp_path / "step.events.json.gz"
    assert KT.profile(run, jax.block_until_ready, steps=2, events_path=events) == {}
    assert len(calls) == 2
    assert json.loads(gzip.decompress(events.read_bytes())) == []  # the GPU's events: none on a CPU


def test_kernel_times_need_a_folder():
    with pytest.raises(SystemExit):
        gpu._parse(["--kernel-times"])
