"""``benchmarks/gpu_measured/rounds.py``: systems compiled first, then timed in rotated rounds.

Issue 47: on a shared H200 two identical programs timed a minute apart differed by 30 %, so
the lent GPU's attention section times every system of a model in turns, round after round,
divides by fp32 and MPX within each round, and hashes each compiled program so that identical
programs are seen as identical. These tests check the pieces without a GPU: the hash (real
CPU compiles), the rotation and the deadline (runners that record their calls), the
per-round ratios and the report. The dry run of the lent command itself, at the smoke sizes,
is ``tests/test_gpu_benchmark_smoke.py::test_lent_attention_section_dry_run``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import pytest

from benchmarks.gpu_measured import rounds as R


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def test_same_program_same_hash_whatever_its_names():
    """The same computation under another function name, other argument names and other
    source lines compiles to HLO text that differs (module, parameter and op names, source
    locations) but hashes the same; another computation hashes differently."""

    def loss(weights, inputs):
        return jnp.sum(jnp.tanh(inputs @ weights) ** 2)

    def other_name(w, x):
        y = x @ w
        return jnp.sum(jnp.tanh(y) ** 2)

    x = jnp.ones((4, 8))
    w = jnp.ones((8, 3))
    a, b = _hlo(loss, w, x), _hlo(other_name, w, x)
    assert a != b  # the raw texts differ: names, op_name metadata, source lines
    assert R.program_hash(a) == R.program_hash(b)
    assert R.program_hash(a) == R.program_hash(_hlo(loss, w, x))  # compiled again
    assert len(R.program_hash(a)) == 64
    # a different program: another activation, another dtype, another shape
    assert R.program_hash(_hlo(lambda w, x: jnp.sum(jnp.sin(x @ w) ** 2), w, x)) != R.program_hash(a)
    assert R.program_hash(_hlo(loss, w.astype(jnp.bfloat16), x.astype(jnp.bfloat16))) != R.program_hash(a)
    assert R.program_hash(_hlo(loss, jnp.ones((8, 5)), x)) != R.program_hash(a)


def test_normalised_hlo_keeps_the_wiring():
    """Names are renamed in order of first appearance, not dropped: two programs with the same
    instructions wired differently (which operand feeds which) hash differently. Metadata is
    removed even where a quoted string holds a brace, and so is XLA:GPU's fingerprint of the
    module before scheduling (it differs with the names: on the H100 target, amp's fused
    attention and the same cuDNN call written by hand differ in it alone)."""
    wired = """HloModule jit_f, entry_computation_layout={(f32[2]{0}, f32[2]{0})->f32[2]{0}}, \
frontend_attributes={fingerprint_before_lhs="fc2480bf"}

ENTRY %main.4 (x.1: f32[2], y.2: f32[2]) -> f32[2] {
  %x.1 = f32[2]{0} parameter(0), metadata={op_name="x"}
  %y.2 = f32[2]{0} parameter(1), metadata={op_name="y}{" source_file="a.py" source_line=3}
  %exp.3 = f32[2]{0} exponential(%x.1), metadata={op_name="jit(f)/exp"}
  ROOT %subtract.4 = f32[2]{0} subtract(%exp.3, %y.2)
}
"""
    swapped = wired.replace("exponential(%x.1)", "exponential(%y.2)").replace("(%exp.3, %y.2)", "(%exp.3, %x.1)")
    # XLA:GPU's fingerprint of the text before scheduling differs with the names
    renamed = wired.replace("%x.1", "%a.7").replace("x.1:", "a.7:").replace("jit_f", "jit_g").replace("fc24", "252a")
    norm = R.normalised_hlo(wired)
    assert "metadata" not in norm and "source_file" not in norm and "jit_f" not in norm and "fingerprint" not in norm
    assert "ENTRY %0 (f32[2], f32[2]) -> f32[2] {" in norm and "ROOT %4 = f32[2]{0} subtract(%3, %2)" in norm
    assert R.program_hash(renamed) == R.program_hash(wired)
    assert R.program_hash(swapped) != R.program_hash(wired)


def test_rotation_puts_every_system_first_once_in_as_many_rounds():
    names = ["a", "b", "c", "d"]
    orders = [R.rotation(names, r) for r in range(5)]
    assert orders[:4] == [list("abcd"), list("bcda"), list("cdab"), list("dabc")]
    assert orders[4] == orders[0]
    for i in range(4):  # in four rounds, each system takes each place once
        assert sorted(o[i] for o in orders[:4]) == names


def _recording_runners(names, calls):
    return {n: (lambda n=n: calls.append(n) or jnp.zeros(())) for n in names}


def test_rotated_rounds_calls_each_system_in_its_turn():
    """Warm-up calls first, then per round every system's ``steps`` calls together, in the
    rotated order; one time per system and round."""
    calls: list[str] = []
    out = R.rotated_rounds(_recording_runners(["a", "b", "c"], calls), rounds=3, steps=2, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    assert "".join(calls[3:]) == "aabbcc" + "bbccaa" + "ccaabb"
    assert out["orders"] == [list("abc"), list("bca"), list("cab")] and out["cut"] is False
    assert all(len(ts) == 3 and min(ts) > 0 for ts in out["times"].values())


def test_a_deadline_stops_the_rounds_between_rounds():
    """Past ``stop_at`` no round starts, but the first always runs and every system has the
    same rounds; the result says it was cut."""
    calls: list[str] = []
    out = R.rotated_rounds(_recording_runners(["a", "b"], calls), rounds=5, steps=3, warmup=0, stop_at=time.time() - 1)
    assert "".join(calls) == "aaabbb" and out["orders"] == [["a", "b"]] and out["cut"] is True
    assert {n: len(ts) for n, ts in out["times"].items()} == {"a": 1, "b": 1}


def test_ratios_are_taken_within_each_round():
    """A round that is slow for everyone (round 2 here: the machine, not the system) leaves
    the per-round ratio alone; the ratio of the medians would not be the same number."""
    timing = {
        "orders": [["amp", "fp32", "mpx-bf16"], ["fp32", "mpx-bf16", "amp"], ["mpx-bf16", "amp", "fp32"]],
        "times": {"amp": [1.0, 2.0, 1.5], "fp32": [2.0, 4.0, 2.0], "mpx-bf16": [1.25, 2.5, 1.25]},
    }
    s = R.summarise(timing)
    amp = s["amp"]
    assert amp["step_s"] == {"median": 1.5, "min": 1.0, "max": 2.0, "iqr": 0.5}
    assert amp["vs"]["fp32"] == {"median": 0.5, "min": 0.5, "max": 0.75, "iqr": 0.125}
    assert amp["vs"]["fp32"]["median"] != amp["step_s"]["median"] / s["fp32"]["step_s"]["median"]
    assert amp["vs"]["mpx-bf16"]["median"] == pytest.approx(0.8)
    assert s["fp32"]["vs"]["fp32"]["max"] == 1.0 and amp["positions"] == [0, 2, 1]


def _result(ms: list[float], positions: list[int], digest: str, **extra) -> dict:
    return {
        "step_s": R._spread([t / 1e3 for t in ms]),
        "rounds_s": [t / 1e3 for t in ms],
        "positions": positions,
        "program_hash": digest,
        "compile_s": 40.0,
        "xla_memory": {"temp": 3 * 2**30, "peak": 5 * 2**30},
        "grad_err_vs_fp32": 4e-3,
        "compile_wall_all_s": 90.0,
        "compile_threads": 4,
    } | extra


def test_table_shows_medians_spread_ratios_orders_and_identical_programs():
    res = {
        "autocast-bf16": _result([25.3, 27.6, 26.0], [0, 2, 1], "ab" * 32),
        "autocast-bf16-xla-attention": _result([25.0, 26.0, 27.0], [1, 0, 2], "ab" * 32),
        "fp32": _result([59.3, 59.6, 59.5], [2, 1, 0], "cd" * 32),
    }
    timing = {"orders": [], "times": {n: r["rounds_s"] for n, r in res.items()}}
    for n, s in R.summarise(timing).items():
        res[n]["vs"] = s["vs"]
    md = R.table("gpt2-small, x1, triton GEMMs", "GPT", res, lambda r: "24 / 12")
    row = next(line for line in md.splitlines() if line.startswith("| autocast-bf16 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1:5] == ["26.00 ms", "25.30-27.60 ms (1.15)", "0.44x (0.43-0.46)", "-"]
    assert cells[5:7] == ["3.00 GiB", "5.00 GiB"] and cells[8:] == ["24 / 12", "40 s", f"`{'ab' * 6}`"]
    assert (
        "Round orders: 1: autocast-bf16, autocast-bf16-xla-attention, fp32; "
        "2: autocast-bf16-xla-attention, fp32, autocast-bf16; 3: fp32, autocast-bf16, autocast-bf16-xla-attention."
    ) in md
    assert "Identical programs: autocast-bf16 = autocast-bf16-xla-attention (medians 0.0% apart)." in md
    assert "Compiled in 90 s (4 at a time)." in md
    res["fp32"]["error"] = "XlaRuntimeError: RESOURCE_EXHAUSTED"
    assert "| fp32 | failed: XlaRuntimeError: RESOURCE_EXHAUSTED |" in R.table("t", "d", res, lambda r: "-")


def test_lent_loss_head_section_dry_run(tmp_path):
    """``run_gpu_lent.sh COMMIT loss_head`` (issue 49) at the smoke sizes on CPU: GPT-2 small's
    step with the loss head chunked (amp's default), as written and MPX's in rotated rounds; then
    per amp system one process searching the batch multiples for the largest that fits (none
    fails on a CPU: every multiple measured, the report saying so), the allocator's share of the
    GPU passed on."""
    import json
    import os
    import subprocess
    import sys
    import tarfile
    from pathlib import Path

    from benchmarks.models.train_steps import mpx_available

    root = Path(__file__).resolve().parent.parent
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(out), AUTOCAST_LENT_TMP=str(tmp), AUTOCAST_LENT_SMOKE="1")
    env |= {"AUTOCAST_LENT_DEADLINE_S": "900", "AUTOCAST_LENT_LOSS_HEAD_MULTS": "2 1", "AUTOCAST_LENT_ROUNDS": "2"}
    env |= {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    script = root / "benchmarks" / "gpu_measured" / "run_gpu_lent.sh"
    proc = subprocess.run(
        ["bash", str(script), "dry", "loss_head"], capture_output=True, text=True, env=env, timeout=900
    )
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0 and "== done" in log, proc.stderr[-3000:] + log[-3000:]
    assert log.count("--largest-batch --batch-mults 2 1") == 2 and "--stop-rounds-at" in log
    with tarfile.open(out / "results.tgz") as tar:
        tar.extractall(tmp_path / "results", filter="data")
    res_dir = tmp_path / "results" / "res"
    (js,) = (res_dir / "loss-head-gpt2-small").glob("gpu-cpu-*-smoke.json")
    report = json.loads(js.read_text())
    assert report["args"]["rounds"] == 2 and not report["isolated"]
    res = report["models"]["gpt2-small"]["runs"]["x1-triton"]["results"]
    systems = ["autocast-bf16", "autocast-bf16-xla-loss-head"] + (["mpx-bf16"] if mpx_available() else [])
    assert list(res) == systems
    for name, r in res.items():
        assert "error" not in r and len(r["rounds_s"]) == 2 and r["program_hash"], (name, r)
    # the smoke model's head is too small to chunk: amp's default leaves it as written
    assert res["autocast-bf16"]["program_hash"] == res["autocast-bf16-xla-loss-head"]["program_hash"]
    for system in ("autocast-bf16-xla-loss-head", "autocast-bf16"):
        (js,) = (res_dir / f"loss-head-batch-{system}").glob("gpu-cpu-*-smoke.json")
        report = json.loads(js.read_text())
        assert report["args"]["largest_batch"] and report["args"]["batch_mults"] == [1, 2]
        runs = report["models"]["gpt2-small"]["runs"]
        assert list(runs) == ["x1-triton", "x2-triton"] and all(list(r["results"]) == [system] for r in runs.values())
        assert all("error" not in r["results"][system] for r in runs.values())
        note = f"the largest that ran: {system} x2 (no failure)."
        assert any(note in n for n in report["notes"]) and note in js.with_suffix(".md").read_text()
