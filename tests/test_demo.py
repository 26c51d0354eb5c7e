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
    for run, ok in within.items():  # within one point, or better
        assert ok == (summary[run]["diff_vs_fp32_points_mean"] >= -1.0 - 1e-9)
    assert data["verdict"]["text"].startswith("Verdict (2 seeds)")
    # the fp8 run is also paired with bf16, seed by seed
    d = [100 * (acc["amp-fp8", k] - acc["amp-bf16", k]) for k in (0, 1)]
    assert summary["amp-fp8"]["diff_vs_bf16_points_per_seed"] == pytest.approx(d)
    assert data["verdict"]["fp8_within_one_point_of_bf16"] == (sum(d) / 2 >= -1.0 - 1e-9)
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


def _result(run: str, seed: int, acc: float) -> dict:
    """One run of one seed as ``demo.train`` returns it (the fields the summary reads)."""
    return dict(
        run=run, seed=seed, test_acc=acc, compute_dtype="-", train_loss=0.1, median_step_s=0.01,
        activation_bytes=1, state_bytes=1, skipped_steps=0, final_scale=None,
    )  # fmt: skip


def _verdict(accuracies: dict[str, list[float]]) -> dict:
    results = [_result(run, seed, a) for run, accs in accuracies.items() for seed, a in enumerate(accs)]
    return demo.verdict(demo.summarise(results))


@pytest.mark.parametrize(
    "diff, points, met",
    [(+1.39, 1.0, True), (0.0, 1.0, True), (-0.99, 1.0, True), (-1.0, 1.0, True), (-1.01, 1.0, False),
     (+5.0, 0.3, True), (-0.3, 0.3, True), (-0.31, 0.3, False)],
)  # fmt: skip
def test_target_is_within_the_points_or_better(diff, points, met):
    assert demo.meets_target(diff, points) is met


def test_a_run_better_than_float32_meets_the_target():
    """Issue 42: one seed where amp-f16 beat float32 by 1.39 points read "not within 1 point
    of fp32: target missed"; being better is not a miss."""
    v = _verdict({"fp32": [0.9500], "amp-f16": [0.9639], "amp-bf16": [0.9472]})
    assert v["within_one_point"] == {"amp-f16": True, "amp-bf16": True}
    assert "amp-f16 96.39 % (+1.39 points)" in v["text"]
    assert v["text"].endswith("-> within one point of float32, or better: target met")
    assert "missed" not in v["text"]


def test_a_run_more_than_a_point_below_float32_misses_the_target():
    v = _verdict({"fp32": [0.95, 0.96], "amp-f16": [0.97, 0.97], "amp-bf16": [0.935, 0.945]})
    assert v["within_one_point"] == {"amp-f16": True, "amp-bf16": False}  # bf16: -1.50 points
    assert "amp-bf16 more than one point below float32: target missed" in v["text"]


def test_runs_judged_against_bf16_pass_when_better():
    v = _verdict({"fp32": [0.95], "amp-bf16": [0.94], "amp-fp8": [0.96], "amp-bf16-sr": [0.9360]})
    assert v["fp8_within_one_point_of_bf16"] is True  # +2.00 points over bf16
    assert (
        "amp-fp8 vs amp-bf16: +2.00 points (mean of per-seed differences) -> within one point of bf16, or better"
        in v["text"]
    )
    assert v["bf16_sr_within_0.3_points_of_bf16"] is False  # -0.40 points
    assert "more than 0.3 points below bf16: target missed" in v["text"]
