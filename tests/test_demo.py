"""The demo (``benchmarks/accuracy/demo.py``) over several seeds: pairing, per-seed results, verdict.

A smoke run with a tiny ViT and a small synthetic digits-like data set (so scikit-learn,
an optional ``demo`` dependency, is not needed) for a few steps; the real demo numbers
come from ``python -m benchmarks.accuracy.demo`` (``benchmarks/results/accuracy/demo.md``).
"""

import json

import numpy as np
import pytest

from benchmarks import _common as C
from benchmarks.accuracy import demo
from benchmarks.models.vit import ViTConfig

RUNS = ("fp32", "amp-bf16", "amp-fp8")


def _synthetic_digits(seed: int = 0):
    """Ten class prototypes plus noise; the seed picks the split, like the real loader.

    Train and test halves have the same size, so the evaluation compiles for one shape.
    """
    rng = np.random.default_rng(1234)
    protos = rng.normal(size=(10, 1, 8, 8)).astype(np.float32)
    y = np.repeat(np.arange(10, dtype=np.int32), 8)
    x = protos[y] + 0.5 * rng.normal(size=(len(y), 1, 8, 8)).astype(np.float32)
    perm = np.random.default_rng(seed).permutation(len(y))
    tr, te = perm[:40], perm[40:]
    return x[tr], y[tr], x[te], y[te]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    made = []
    mp = pytest.MonkeyPatch()
    mp.setattr(C, "RESULTS_DIR", out)
    mp.setattr(demo, "load_digits", _synthetic_digits)
    mp.setattr(
        demo,
        "DIGITS_VIT",
        ViTConfig(image_size=8, channels=1, patch=4, width=16, mlp_hidden=32, depth=1, heads=2, classes=10),
    )
    mp.setattr(demo, "plot", lambda *a: False)
    make_step = demo._make_step

    def counting_make_step(*args):
        made.append(make_step(*args))
        return made[-1]

    mp.setattr(demo, "_make_step", counting_make_step)
    try:
        # fp32, bf16 and fp8 only: compiling the f16 step (loss scaler) would add to the time
        results = demo.main(["--steps", "6", "--batch", "16", "--seeds", "0", "1", "--runs", *RUNS])
    finally:
        mp.undo()
    written = out / "accuracy"  # the demo writes to results/accuracy/
    data = json.loads((written / "demo.json").read_text())
    return results, data, (written / "demo.md").read_text(), made


def test_one_result_per_run_and_seed(smoke):
    results, data, md, _ = smoke
    pairs = {(r["run"], r["seed"]) for r in data["results"]}
    assert pairs == {(run, s) for run in RUNS for s in (0, 1)}
    assert len(data["results"]) == len(results) == 2 * len(RUNS)
    assert data["args"]["seeds"] == [0, 1]
    for run in RUNS:
        for s in (0, 1):
            assert f"| {s} | {run} |" in md  # the per-seed table


def test_runs_of_a_seed_share_init_and_batches_seeds_differ(smoke):
    _, data, _, _ = smoke
    curve = {(r["run"], r["seed"]): np.asarray(r["losses"]) for r in data["results"]}
    for s in (0, 1):  # same model and batch: the first loss agrees to half precision
        np.testing.assert_allclose(curve["amp-bf16", s][0], curve["fp32", s][0], rtol=2e-2)
    assert np.max(np.abs(curve["fp32", 0] - curve["fp32", 1])) > 0.05


def test_step_built_once_per_run_type_and_compiled_once(smoke):
    _, data, _, made = smoke
    assert len(made) == len(RUNS)  # not once per seed
    assert all(step._cache_size() == 1 for step in made)  # seed 1 reused seed 0's compile


def test_summary_is_paired_per_seed_and_verdict_follows_it(smoke):
    _, data, _, _ = smoke
    acc = {(r["run"], r["seed"]): r["test_acc"] for r in data["results"]}
    summary = {s["run"]: s for s in data["summary"]}
    for run, s in summary.items():
        assert s["test_acc_per_seed"] == [acc[run, 0], acc[run, 1]]
        assert s["test_acc_mean"] == pytest.approx((acc[run, 0] + acc[run, 1]) / 2)
        diffs = [100 * (acc[run, k] - acc["fp32", k]) for k in (0, 1)]
        assert s["diff_vs_fp32_points_per_seed"] == pytest.approx(diffs)
        assert s["diff_vs_fp32_points_mean"] == pytest.approx(sum(diffs) / 2)
        assert len(s["skipped_steps_per_seed"]) == len(s["final_scale_per_seed"]) == 2
    within = data["verdict"]["within_one_point"]
    assert set(within) == {"amp-bf16"}  # fp8 is judged against bf16, below
    for run, ok in within.items():
        assert ok == (abs(summary[run]["diff_vs_fp32_points_mean"]) <= 1.0 + 1e-9)
    assert data["verdict"]["text"].startswith("Verdict (2 seeds)")
    # the fp8 run is also paired with bf16, seed by seed
    d = [100 * (acc["amp-fp8", k] - acc["amp-bf16", k]) for k in (0, 1)]
    assert summary["amp-fp8"]["diff_vs_bf16_points_per_seed"] == pytest.approx(d)
    assert data["verdict"]["fp8_within_one_point_of_bf16"] == (abs(sum(d) / 2) <= 1.0 + 1e-9)
    assert "amp-fp8 vs amp-bf16" in data["verdict"]["text"]


def test_fp8_run_uses_the_fp8_policy(smoke):
    _, data, md, _ = smoke
    fp8 = [r for r in data["results"] if r["run"] == "amp-fp8"]
    assert fp8 and all(r["policy"] == "fp8" and r["compute_dtype"] == "bfloat16" for r in fp8)
    assert demo.POLICIES == {"amp-fp8": "fp8"} and set(demo.DEFAULT_RUNS) == {"fp32", "amp-f16", "amp-bf16", "amp-fp8"}
    assert set(demo.RUNS) == {*demo.DEFAULT_RUNS, "amp-bf16-sr"} and demo.HALF_PARAMS == {"amp-bf16-sr"}
    assert "| amp-fp8 |" in md


@pytest.mark.parametrize("argv, seeds", [([], [0]), (["--seed", "3"], [3]), (["--seeds", "4", "0"], [4, 0])])
def test_seed_options(argv, seeds):
    assert demo._parse(argv).seeds == seeds


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--seed", "1", "--seeds", "2"], "not allowed with"),
        (["--seeds", "1", "1"], "--seeds: got [1, 1]"),
        (["--seeds", "-1"], "--seeds: got [-1]"),
        (["--steps", "0"], "--steps: got 0"),
    ],
)
def test_bad_options_are_rejected_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        demo._parse(argv)
    assert message in capsys.readouterr().err
