"""``benchmarks/gpu_measured/run_gpu.sh --smoke``: the accelerator benchmark's code, tiny sizes, on CPU.

Runs the script itself (as a user would, with ``PYTHONPATH=.`` set by it) once, writing to a
temporary folder, and checks what it wrote: two models, every system, step times, gradient
errors against fp32 that are small but not zero, float8 dots in the fp8 step's StableHLO and
in no other, and ``n/a`` for the device memory a CPU does not report.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu_measured import gpu

ROOT = Path(__file__).resolve().parent.parent
# the smoke run's models: a ViT (convolution, attention) and the GPT (embedding, causal mask);
# the desktop ViT is the same code with other sizes
MODELS = ("vit-base", "gpt2-small")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "benchmarks" / "gpu_measured" / "run_gpu.sh"),
            "--smoke",
            "--out-dir",
            str(out),
            "--models",
            *MODELS,
        ]
        + ["--save-hlo", str(out / "hlo"), "--kernel-times"],
        capture_output=True,
        text=True,
        env=env,
        cwd=out,  # the script finds the repository itself
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (js,) = out.glob("gpu-*-smoke.json")
    (md,) = out.glob("gpu-*-smoke.md")
    assert not list(out.glob("*.npz"))
    return json.loads(js.read_text()), md.read_text(), js.name, out / "hlo"


def test_every_model_and_system(smoke):
    data, md, name, hlo = smoke
    assert name.startswith("gpu-cpu-") and data["smoke"] is True
    assert data["meta"]["backend"] == "cpu" and data["meta"]["versions"]["jax"]
    assert "--smoke" in data["command"]
    systems = list(gpu.SYSTEMS) if gpu.mpx_available() else [s for s in gpu.SYSTEMS if s != "mpx-bf16"]
    assert list(data["models"]) == list(MODELS)
    for model, entry in data["models"].items():
        assert list(entry["runs"]) == ["x1-triton"]  # off a GPU: XLA's default GEMM mode, the batch as given
        res = entry["runs"]["x1-triton"]["results"]
        assert list(res) == systems, (model, res)
        for system, r in res.items():
            assert "error" not in r, (model, system, r)
            assert r["median_step_s"] > 0 and r["pipelined_step_s"] > 0 and r["compile_s"] > 0
            assert r["peak_bytes"] is None if "peak_bytes" in r else True
        assert res["fp32"]["grad_err_vs_fp32"] == 0.0
        for system in ("autocast-bf16", "autocast-bf16-xla-attention", "autocast-fp8", "autocast-bf16-sr"):
            assert 1e-4 < res[system]["grad_err_vs_fp32"] < 0.5, (model, system, res[system]["grad_err_vs_fp32"])
        # no cuDNN on a CPU: amp's attention stays as written, the same program as attention="xla"
        assert all(r["fused_attention"] == {"forward": 0, "backward": 0} for r in res.values())
        xla = res["autocast-bf16-xla-attention"]
        assert (
            xla["grad_err_vs_fp32"] == res["autocast-bf16"]["grad_err_vs_fp32"]
            and xla["loss0"] == res["autocast-bf16"]["loss0"]
        )
        # float8 is coarser than bfloat16: the fp8 step really ran in float8
        assert res["autocast-fp8"]["grad_err_vs_fp32"] > res["autocast-bf16"]["grad_err_vs_fp32"]
        assert res["autocast-fp8"]["fp8"]["stablehlo_f8_dots"] > 0
        assert all(r["fp8"]["stablehlo_f8_dots"] == 0 for s, r in res.items() if s != "autocast-fp8")
        assert all(r["fp8"]["cublas_f8_gemms"] == 0 for r in res.values())  # CPU: no cuBLAS
        assert all("roofline" not in r for r in res.values())  # the H100 model reads GPU programs only
        assert f"### {model}, x1, triton GEMMs" in md
        for system, r in res.items():  # each step's HLO and its kernel times (none measured on a CPU)
            assert (hlo / f"{model}-x1-triton-{system}.hlo.gz").stat().st_size > 0
            assert json.loads((hlo / f"{model}-x1-triton-{system}.kernels.json").read_text()) == {}
            assert (hlo / f"{model}-x1-triton-{system}.events.json.gz").exists()
            assert r["profiled_gpu_ms"] == 0
    assert "| autocast-fp8 |" in md and "n/a" in md
    if not gpu.mpx_available():
        assert "mpx-bf16: skipped" in md


def test_bf16_sr_system_stores_half_parameters_and_moments():
    """``autocast-bf16-sr``: the step takes and returns bfloat16 parameters and a half_state
    whose moments are bfloat16 (the float32 master copy is gone)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import autocast

    task = gpu.SMOKE_MODELS["gpt2-small"]()
    params, static = eqx.partition(task.model, eqx.is_array)
    opt = optax.adamw(1e-2)
    system = gpu.build_system("autocast-bf16-sr", task, static, opt)
    stored, opt_state = system.init(params, opt)
    assert isinstance(opt_state, autocast.optim.HalfOptState)
    floats = lambda t: [x for x in jax.tree_util.tree_leaves(t) if jnp.issubdtype(x.dtype, jnp.floating)]  # noqa: E731
    assert {x.dtype for x in floats(stored)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in floats(opt_state.inner) if x.ndim} == {jnp.dtype(jnp.bfloat16)}
    # the step's output types, traced only (the smoke run above runs it and checks its gradient)
    new, opt_state2, _, loss, _ = jax.eval_shape(system.step, stored, opt_state, system.scaler, task.batch)
    assert {x.dtype for x in floats(new)} == {jnp.dtype(jnp.bfloat16)} and loss.dtype == jnp.float32
    assert {x.dtype for x in floats(opt_state2.inner) if x.ndim} == {jnp.dtype(jnp.bfloat16)}


def test_default_models():
    assert gpu._parse([]).models == list(gpu.DEFAULT_MODELS)
    assert gpu._parse(["--target", "h100"]).models == list(gpu.TARGET_MODELS)


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        gpu._parse(["--repeats", "0"])
    # rotated rounds: at least one, one compile at a time or more, all systems in one process
    for bad in (["--rounds", "0"], ["--rounds", "2", "--compile-threads", "0"], ["--rounds", "2", "--isolate", "yes"]):
        with pytest.raises(SystemExit):
            gpu._parse(bad)
    with pytest.raises(ValueError, match="system 'nope' unknown"):
        gpu.build_system("nope", None, None, None)


def _measured(ms: float, modeled_ms: float | None, piped_ms: float | None = None) -> dict:
    r = {"median_step_s": ms / 1e3, "peak_bytes": 2**30, "fp8": {"cublas_f8_gemms": 0, "stablehlo_f8_dots": 0}}
    r |= {"pipelined_step_s": piped_ms / 1e3} if piped_ms else {}
    return r | ({"roofline": {"time_s": modeled_ms / 1e3, "chip": "H200 SXM"}} if modeled_ms else {})


def test_table_puts_measured_and_modeled_ratios_side_by_side():
    """A GPU section: each system's measured step (waited for, and back to back), its
    modeled one, their quotient, and its ratio to fp32 and to MPX measured (both ways) with
    the modeled ratio in brackets."""
    res = {
        "fp32": _measured(64.0, 40.0, 50.0),
        "autocast-bf16": _measured(44.0, 24.0, 33.0),
        "mpx-bf16": _measured(40.0, 22.0, 30.0),
    }
    md = gpu.table("gpt2-small, x1, triton GEMMs", "desc", res, "gpu")
    row = next(line for line in md.splitlines() if line.startswith("| autocast-bf16 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1:7] == ["44.00 ms", "33.00 ms", "24.00 ms", "1.83x", "0.69x / 0.66x (0.60x)", "1.10x / 1.10x (1.09x)"]
    assert "GPU time" not in md  # no kernels profiled: no column for them
    # with --kernel-times on a GPU, a step's GPU time (its profiled kernels) closes the row
    res["autocast-bf16"]["profiled_gpu_ms"] = 31.5
    md = gpu.table("gpt2-small, x1, triton GEMMs", "desc", res, "gpu")
    lines = md.splitlines()
    assert next(line for line in lines if line.startswith("| system |")).endswith("| GPU time (profiled kernels) |")
    by_system = {line.split("|")[1].strip(): line for line in lines if line.startswith("| ")}
    assert by_system["autocast-bf16"].endswith("| 31.50 ms |") and by_system["mpx-bf16"].endswith("| n/a |")
    # off a GPU there is no model: the measured ratios alone (a report without back-to-back times)
    res = {"fp32": _measured(2.0, None), "autocast-bf16": _measured(3.0, None)}
    row = gpu.table("t", "d", res, "cpu").splitlines()[-1]
    assert [c.strip() for c in row.split("|")[1:-1]][1:7] == ["3.00 ms", "n/a", "n/a", "n/a", "1.50x", "-"]


def test_back_to_back_steps_wait_only_for_the_last():
    """``pipelined_medians`` dispatches ``steps`` calls, then blocks once: a runner whose
    call returns before its work is done is timed by the work, per step."""
    from benchmarks import _common as C

    calls = []

    def run():
        calls.append(1)
        return np.ones(4)

    out = C.pipelined_medians({"a": run, "b": run}, steps=5, rounds=3)
    assert len(calls) == 2 * 5 * 3
    assert set(out) == {"a", "b"} and all(r["rounds"] == 3 and 0 < r["min"] <= r["median"] for r in out.values())


def test_batch_multiples_repeat_the_batch():
    x, y = np.arange(6.0).reshape(2, 3), np.array([0, 1])
    tx, ty = gpu._tiled((x, y), 3)
    assert tx.shape == (6, 3) and ty.tolist() == [0, 1, 0, 1, 0, 1] and (tx[4:] == x).all()
    assert gpu._tiled((x, y), 1)[0] is x


def test_reanalyse_models_a_measured_report_again_from_its_hlo(tmp_path):
    """``reanalyse``: the modeled figures of a measured report recomputed from the saved HLO
    at another device's rates; the measured figures untouched."""
    import gzip

    from test_hlo_model import CUBLAS_BF16

    from benchmarks.gpu_modeled import hlo_model

    hlo_dir = tmp_path / "hlo"
    hlo_dir.mkdir()
    (hlo_dir / "m-x1-triton-fp32.hlo.gz").write_bytes(gzip.compress(CUBLAS_BF16.encode()))
    report = {
        "command": "python -m benchmarks.gpu_measured.gpu",
        "meta": {"backend": "gpu", "device": "NVIDIA H200 x1", "date": "d", "machine": "m", "os": "o", "python": "3"}
        | {"versions": {}},
        "args": {"warmup": 3, "repeats": 20},
        "models": {"m": {"runs": {"x1-triton": {"description": "tiny", "results": {"fp32": _measured(1.0, 9.0)}}}}},
        "wall_time_s": 1.0,
        "notes": ["- a note"],
        "isolated": True,
    }
    path = tmp_path / "gpu-h200.json"
    path.write_text(json.dumps(report))
    gpu.reanalyse(path, hlo_dir)
    out = json.loads(path.read_text())["models"]["m"]["runs"]["x1-triton"]["results"]["fp32"]
    assert out["median_step_s"] == 1e-3
    assert out["roofline"] == hlo_model.roofline(CUBLAS_BF16, hlo_model.H200_SXM)
    md = path.with_suffix(".md").read_text()
    assert (
        "H200 SXM's datasheet rates" in md
        and "- a note" in md
        and "each system in its own process" in md
        and "| fp32 | 1.00 ms |" in md
    )


def test_isolated_systems_say_where_their_process_time_goes(tmp_path, monkeypatch):
    """``--isolate yes`` (the default on a GPU): each system in a child process, which saves
    its HLO and kernel times where asked and reports the phases of its wall time; the
    children share a compilation cache; the report is written after each system."""
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "cache"))
    writes = []
    real_write = gpu._write
    monkeypatch.setattr(
        gpu, "_write", lambda stem, report, sections: writes.append(sections[-1]) or real_write(stem, report, sections)
    )
    report = gpu.main(
        ["--smoke", "--isolate", "yes", "--models", "gpt2-small", "--systems", "autocast-bf16", "--out-dir"]
        + [str(tmp_path), "--save-hlo", str(tmp_path / "hlo"), "--kernel-times"]
    )
    assert any((tmp_path / "cache").iterdir())  # the children's compiles, cached for the next
    # after the system, a section marked as partial; then the final one
    assert "(so far)" in writes[0] and "| autocast-bf16 |" in writes[0]
    assert "(so far)" not in writes[-1] and len(writes) == 2
    r = report["models"]["gpt2-small"]["runs"]["x1-triton"]["results"]["autocast-bf16"]
    assert "partial" not in report["models"]["gpt2-small"]["runs"]["x1-triton"]
    assert "error" not in r and r["median_step_s"] > 0
    phases = r["phases_s"]
    assert all(phases[k] > 0 for k in ("start", "task", "measure", "process"))
    assert phases["start"] + phases["task"] + phases["measure"] <= phases["process"] * 1.01
    assert (tmp_path / "hlo" / "gpt2-small-x1-triton-autocast-bf16.kernels.json").exists()


def test_attention_micro_benchmark(tmp_path):
    """``python -m benchmarks.gpu_measured.attention --smoke``: the six variants of causal
    attention, forward + backward, on CPU. float32 is the reference's own code (error 0 at
    XLA:CPU's float32 matmuls); the bfloat16 variants are off by bfloat16's rounding, amp's
    unfused one no further than MPX's; without cuDNN amp's "fused" variant is its unfused
    program (no fmha call, the same numbers, the same program hash) and the cuDNN calls fail,
    saying why."""
    from benchmarks.gpu_measured import attention

    report = attention.main(["--smoke", "--out-dir", str(tmp_path)])
    res = report["results"]
    assert list(res) == list(attention.VARIANTS)
    for name in ("fp32", "mpx-bf16", "amp-bf16-xla", "amp-bf16-fused"):
        r = res[name]
        assert r["ms_per_call"] > 0 and r["temp_bytes"] is not None and r["grad_finite"], (name, r)
        assert (r["fmha_forward"], r["fmha_backward"]) == (0, 0)
    assert res["fp32"]["grad_err"] < 1e-6 and res["fp32"]["out_err"] < 1e-6
    for name in ("mpx-bf16", "amp-bf16-xla"):
        assert 1e-4 < res[name]["grad_err"] < 0.05 and 1e-4 < res[name]["out_err"] < 0.05, (name, res[name])
    assert res["amp-bf16-xla"]["grad_err"] <= res["mpx-bf16"]["grad_err"]
    assert res["amp-bf16-fused"]["grad_err"] == res["amp-bf16-xla"]["grad_err"]
    assert "cuDNN" in res["cudnn"]["error"] and "cuDNN" in res["cudnn-from-f32"]["error"]
    # compiled first, then timed in rotated rounds; amp's two programs are one off a GPU
    assert report["rounds"] == 3 and report["orders"][1] == ["mpx-bf16", "amp-bf16-xla", "amp-bf16-fused", "fp32"]
    assert all(len(res[n]["rounds_s"]) == 3 and "fp32" in res[n]["vs"] for n in ("fp32", "amp-bf16-fused"))
    assert res["amp-bf16-fused"]["program_hash"] == res["amp-bf16-xla"]["program_hash"] != res["fp32"]["program_hash"]
    md = Path(report["paths"][0]).read_text()
    assert all(f"| {name} |" in md for name in attention.VARIANTS) and "failed: " in md
    with pytest.raises(ValueError, match="variant 'nope' unknown"):
        attention.variant("nope")


def test_bert_batch_and_its_attention():
    """The BERT task (smoke size): every masked position lies below its sequence's length,
    distinct, its input token replaced by the mask id and its label the original token;
    padding is id 0. amp finds the encoder's attention and reads its key-padding mask as
    key lengths (the fused kernel's ``key_value_seq_lengths`` route); its bfloat16 loss is
    float32's within bfloat16's rounding."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import autocast
    from benchmarks.models import bert
    from benchmarks.models import train_steps as S

    task = S.SMOKE_MODELS["bert-base"]()
    tokens, lengths, positions, labels = (np.asarray(x) for x in task.batch)
    seq = tokens.shape[1]
    for row, n, pos, lab in zip(tokens, lengths, positions, labels):
        assert len(set(pos.tolist())) == len(pos) and (pos < n).all()
        assert (row[pos] == bert.MASK_TOKEN).all() and (lab >= 4).all()
        assert (row[n:] == 0).all() and (np.delete(row[:n], pos) >= 4).all()
    assert lengths.min() >= 4 and lengths.max() <= seq
    params, static = eqx.partition(task.model, eqx.is_array)

    def loss(p, batch):
        return S._bert_loss(eqx.combine(p, static), batch)

    report = autocast.explain(loss, compute_dtype=jnp.bfloat16)(params, task.batch)
    (found,) = report.totals["attention"]
    assert "kv lengths" in found["attention"], found
    ref = jax.jit(loss)(params, task.batch)
    half = jax.jit(autocast.amp(loss, compute_dtype=jnp.bfloat16))(params, task.batch)
    assert ref.dtype == jnp.float32 and jnp.isfinite(ref) and abs(float(half) - float(ref)) < 0.02 * abs(float(ref))


LENT_SYSTEMS = ["autocast-bf16", "autocast-bf16-xla-attention", "mpx-bf16", "fp32"]


def test_lent_attention_section_dry_run(tmp_path):
    """``run_gpu_lent.sh COMMIT attention`` as the lent GPU runs it, at the smoke sizes on CPU
    (issue 47). Each item compiles every system (variant) first and times them in five rotated
    rounds: every system in every round, round ``r`` starting ``r`` systems later; per system the
    median and spread over rounds, ratios to fp32 and MPX taken within each round, and the hash
    of its program, recomputed here from the HLO the run saved. Off a GPU amp's attention is as
    written, so amp bf16 and ``attention="xla"`` compile to the same program: the same hash,
    and no other system shares it."""
    import tarfile

    from benchmarks.gpu_measured import rounds as R

    out, tmp = tmp_path / "out", tmp_path / "tmp"
    out.mkdir()
    env = dict(os.environ, JAX_PLATFORMS="cpu", OUT=str(out), AUTOCAST_LENT_TMP=str(tmp), AUTOCAST_LENT_SMOKE="1")
    env |= {"AUTOCAST_LENT_DEADLINE_S": "900", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"}
    script = ROOT / "benchmarks" / "gpu_measured" / "run_gpu_lent.sh"
    proc = subprocess.run(
        ["bash", str(script), "dry", "attention"], capture_output=True, text=True, env=env, timeout=900
    )
    log = (out / "log.txt").read_text()
    assert proc.returncode == 0 and "== done" in log, proc.stderr[-3000:] + log[-3000:]
    assert (
        log.count("--stop-rounds-at") == 3 and log.count("--compile-threads 4") == 3
    )  # the deadline reaches the rounds
    with tarfile.open(out / "results.tgz") as tar:
        tar.extractall(tmp_path / "results", filter="data")
    with tarfile.open(out / "hlo.tar") as tar:
        tar.extractall(tmp_path / "hlo", filter="data")
    res_dir, hlo_dir = tmp_path / "results" / "res", tmp_path / "hlo" / "hlo"
    for model in ("gpt2-small", "bert-base", "vit-base"):
        (js,) = (res_dir / f"attention-{model}").glob("gpu-cpu-*-smoke.json")
        report = json.loads(js.read_text())
        assert report["args"]["rounds"] == 5 and report["args"]["round_steps"] == 5 and not report["isolated"]
        res = report["models"][model]["runs"]["x1-triton"]["results"]
        assert list(res) == LENT_SYSTEMS
        for i, (name, r) in enumerate(res.items()):
            assert "error" not in r, (model, name, r)
            assert r["positions"] == [(i - k) % 4 for k in range(5)] and len(r["rounds_s"]) == 5
            s = r["step_s"]
            assert 0 < s["min"] <= s["median"] == r["median_step_s"] <= s["max"] and not r["rounds_cut"]
            assert set(r["vs"]) == {"fp32", "mpx-bf16"} and r["vs"]["fp32"]["min"] <= r["vs"]["fp32"]["median"]
            saved = gzip.decompress((hlo_dir / f"{model}-x1-triton-{name}.hlo.gz").read_bytes()).decode()
            assert r["program_hash"] == R.program_hash(saved)
        assert res["fp32"]["vs"]["fp32"] == {"median": 1.0, "min": 1.0, "max": 1.0, "iqr": 0.0}
        assert res["autocast-bf16"]["program_hash"] == res["autocast-bf16-xla-attention"]["program_hash"]
        assert len({res[n]["program_hash"] for n in ("autocast-bf16", "mpx-bf16", "fp32")}) == 3
        assert res["autocast-bf16"]["loss0"] == res["autocast-bf16-xla-attention"]["loss0"]
        md = js.with_suffix(".md").read_text()
        assert "rotated rounds" in md and "Round orders: 1: autocast-bf16, autocast-bf16-xla-attention" in md
        assert "5: autocast-bf16, autocast-bf16-xla-attention, mpx-bf16, fp32." in md
        assert "Identical programs: autocast-bf16 = autocast-bf16-xla-attention (medians" in md
        assert f"`{res['fp32']['program_hash'][:12]}`" in md
    (js,) = (res_dir / "attention").glob("attention-cpu-*-smoke.json")
    micro = json.loads(js.read_text())
    assert micro["rounds"] == 5 and len(micro["orders"]) == 5
    timed = [n for n, r in micro["results"].items() if "error" not in r]
    assert timed == ["fp32", "mpx-bf16", "amp-bf16-xla", "amp-bf16-fused"] and micro["orders"][1][0] == "mpx-bf16"
    r = micro["results"]
    assert r["amp-bf16-fused"]["program_hash"] == r["amp-bf16-xla"]["program_hash"] != r["mpx-bf16"]["program_hash"]
    assert "Identical programs: amp-bf16-xla = amp-bf16-fused." in js.with_suffix(".md").read_text()


# ----------------------------------------------------------------------------- the loss head (issue 49)


def test_vocab_sizes_the_gpt_models_and_is_refused_elsewhere():
    """``--vocab N`` (``make_task(vocab=)``): the GPT's tied embedding, hence its logits, has N
    rows and its tokens lie below N; the model's own vocabulary without it; refused for a model
    without one and below 2."""
    from benchmarks.models import train_steps as S

    task = S.make_task("gpt2-small", smoke=True, vocab=96)
    assert task.model.embed.weight.shape == (96, 32) and int(np.max(task.batch[0])) < 96
    assert task.description.startswith("GPT: vocabulary 96,")
    assert S.make_task("gpt2-small", smoke=True).model.embed.weight.shape == (64, 32)
    big = S.make_task("gpt2-small", shapes_only=True, vocab=256_000)  # Gemma's: shapes only, nothing made
    assert big.shapes_only and big.model.embed.weight.shape == (256_000, 768)
    assert "vocabulary 256000" in big.description
    assert S.make_task("gpt2-small", shapes_only=True).model.embed.weight.shape == (50257, 768)
    assert S.make_task("gpt-1b", vocab=128_256).model.embed.weight.shape == (128_256, 2048)
    assert S.vocab_tag(128_256) == "-vocab128256" and S.vocab_tag(None) == ""
    with pytest.raises(ValueError, match="only the GPT models"):
        S.make_task("vit-base", vocab=1000)
    with pytest.raises(ValueError, match=">= 2"):
        S.make_task("gpt2-small", vocab=1)
    assert gpu._parse(["--models", "gpt2-small", "--vocab", "128256"]).vocab == 128_256
    for bad in (
        ["--vocab", "1000"],
        ["--models", "gpt2-small", "vit-base", "--vocab", "9"],
        ["--models", "gpt2-small", "--vocab", "1"],
    ):
        with pytest.raises(SystemExit):
            gpu._parse(bad)


def test_loss_head_systems_at_another_vocabulary(tmp_path):
    """``--vocab 96`` with ``autocast-bf16`` (loss head ``"auto"``) and ``autocast-bf16-xla-loss-head``
    (``loss_head="xla"``): the report and each step's HLO carry the vocabulary in their names and the
    report in its arguments and description; both amp steps run, their gradients float32's within
    bfloat16's rounding. The smoke model's head is far too small to chunk ("auto" leaves it as
    written): the two compile to one program."""
    report = gpu.main(
        ["--smoke", "--isolate", "no", "--models", "gpt2-small", "--vocab", "96", "--out-dir", str(tmp_path)]
        + ["--systems", "fp32", "autocast-bf16", "autocast-bf16-xla-loss-head", "--save-hlo", str(tmp_path / "hlo")]
    )
    names = [Path(p).name for p in report["paths"]]
    assert all(re.fullmatch(r"gpu-cpu-vocab96-\d{4}-\d\d-\d\d-smoke\.(md|json)", n) for n in names), names
    assert json.loads(Path(report["paths"][1]).read_text())["args"]["vocab"] == 96
    run_ = report["models"]["gpt2-small"]["runs"]["x1-triton"]
    assert run_["description"].startswith("GPT: vocabulary 96,")
    res = run_["results"]
    for name in ("autocast-bf16", "autocast-bf16-xla-loss-head"):
        assert "error" not in res[name], res[name]
        assert 1e-4 < res[name]["grad_err_vs_fp32"] < 0.5
        assert (tmp_path / "hlo" / f"gpt2-small-vocab96-x1-triton-{name}.hlo.gz").stat().st_size > 0
    assert abs(res["autocast-bf16"]["loss0"] - res["fp32"]["loss0"]) < 0.02 * abs(res["fp32"]["loss0"])
    xla = res["autocast-bf16-xla-loss-head"]
    assert xla["program_hash"] == res["autocast-bf16"]["program_hash"] != res["fp32"]["program_hash"]
    assert xla["loss0"] == res["autocast-bf16"]["loss0"]


def test_largest_batch_stops_after_the_first_batch_every_system_fails(tmp_path, monkeypatch):
    """``--largest-batch``: the batch multiples in increasing order, the model made once; after
    the first at which every system failed (an out-of-memory error here, at batch 6 and up)
    none is tried; the report says per system the largest that ran and the first that failed."""
    real, batches, made = gpu.measure_in_process, [], []
    real_task = gpu._task
    monkeypatch.setattr(gpu, "_task", lambda *a, **k: made.append(a) or real_task(*a, **k))

    def measure(task, names, **kw):
        batches.append(task.batch[0].shape[0])
        if batches[-1] >= 6:
            return {n: {"error": "XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating"} for n in names}
        return real(task, names, **kw)

    monkeypatch.setattr(gpu, "measure_in_process", measure)
    report = gpu.main(
        ["--smoke", "--isolate", "no", "--models", "gpt2-small", "--systems", "autocast-bf16", "--largest-batch"]
        + ["--batch-mults", "4", "1", "2", "3", "8", "--out-dir", str(tmp_path)]
    )
    assert batches == [2, 4, 6] and len(made) == 1  # smoke batch 2: x1, x2, x3; x4 and x8 not tried
    runs = report["models"]["gpt2-small"]["runs"]
    assert (
        list(runs) == ["x1-triton", "x2-triton", "x3-triton"]
        and "error" not in runs["x2-triton"]["results"]["autocast-bf16"]
    )
    note = (
        "- `--largest-batch`, gpt2-small (batch multiples tried: x1, x2, x3): the largest that ran: autocast-bf16 x2 "
        "(x3 failed: XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory allocating)."
    )
    assert note in report["notes"] and note in Path(report["paths"][0]).read_text()
    with pytest.raises(SystemExit):
        gpu._parse(["--target", "h100", "--largest-batch"])


def test_target_report_carries_the_vocabulary(tmp_path, monkeypatch):
    """``--target h100 --vocab N`` (compiles replaced by a stand-in here; the real ones need the
    jax-cuda plugin): each step compiled from the GPT of that vocabulary, its figures and HLO
    saved under names with ``-vocab<N>``, the report named so and saying it."""
    from benchmarks.gpu_modeled import deviceless as D

    compiled = []

    def compile_system(task, name, mode, sharding, mult, hlo_path=None):
        compiled.append((task.model.embed.weight.shape, name, hlo_path.name))
        hlo_path.parent.mkdir(parents=True, exist_ok=True)  # as the real one, which writes the HLO there
        mem = {"argument": 1, "output": 1, "alias": 1, "temp": 2**20, "peak": 2**21, "xla_peak": 0}
        roof = {"time_s": 1e-3, "hbm_bytes": 2**30, "gemm_flops": 1e12, "kernels": 9, "gemm_kernels": 3}
        roof |= {"other_time_s": 5e-4, "gemm_time_s": 5e-4}
        return {"kernels": 9, "gemms": {}, "fp8_gemms": 0, "convolutions": {}, "f32_convolutions": 0} | {
            "memory": mem,
            "roofline": roof,
            "compile_s": 1.0,
        }

    monkeypatch.setattr(D, "target_sharding", lambda target: None)
    monkeypatch.setattr(D, "compile_system", compile_system)
    report = gpu.main(
        ["--target", "h100", "--smoke", "--models", "gpt2-small", "--modes", "triton", "--batch-mults", "1"]
        + ["--systems", "autocast-bf16", "autocast-bf16-xla-loss-head", "--vocab", "96", "--out-dir", str(tmp_path)]
        + ["--save-hlo", str(tmp_path / "hlo")]
    )
    assert compiled == [
        ((96, 32), "autocast-bf16", "gpt2-small-vocab96-x1-triton-autocast-bf16.hlo.gz"),
        ((96, 32), "autocast-bf16-xla-loss-head", "gpt2-small-vocab96-x1-triton-autocast-bf16-xla-loss-head.hlo.gz"),
    ]
    assert (tmp_path / "hlo" / "gpt2-small-vocab96-x1-triton-autocast-bf16.json").exists()
    assert report["vocab"] == 96 and "vocabulary 96" in report["models"]["gpt2-small"]["description"]
    (md,) = tmp_path.glob("gpu-target-h100-vocab96-*-smoke.md")
    assert "- the GPT models' vocabulary: 96 (`--vocab`)" in md.read_text()
