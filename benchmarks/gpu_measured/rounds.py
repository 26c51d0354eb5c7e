"""Rotated rounds: every system compiled first, then timed in turns, so that systems can be ranked.

On a shared GPU two identical programs (the same compiled HLO) timed a minute apart differed by
30 % (issue 47: an Equinox BERT step, 34.5 against 26.8 ms on a lent H200). A measurement that
times one system after another ranks the machine's moments, not the systems. Here, for one
model in one process (``python -m benchmarks.gpu_measured.gpu --rounds N``, the lent GPU's
``attention`` section; the attention micro-benchmark times its variants the same way):

1. every system's step is traced and lowered one after the other (MPX's half dtype is a global
   setting read while tracing), then the programs are compiled together, ``compile_threads``
   at a time (XLA's compiles release the GIL), all of them before any is timed;
2. each system runs its step 0 (its gradient, compared with fp32's) and ``warmup`` more steps;
3. ``rounds`` rounds: in round ``r`` the systems take turns in the order rotated by ``r``
   (round 1: a b c d; round 2: b c d a; ...), each running ``steps`` steps back to back, only
   the last waited for (about the device's time per step: the host keeps ahead);
4. per system (:func:`summarise`): the median over rounds of the time per step and its spread
   (min-max and IQR over rounds); its ratio to ``fp32`` and to ``mpx-bf16`` taken within each
   round, so that what slows a whole round cancels, as the median and min-max of those
   ratios; XLA's memory analysis of its program; and :func:`program_hash`, the SHA-256 of its
   optimised HLO with names, metadata and source locations taken out: two systems that compile
   to the same program show the same hash (the difference between their times is the noise).

A deadline (``stop_at``, seconds since the epoch) ends the rounds early but cleanly: no round
starts after it (the first always runs), every system has the same rounds, and the report
says how many ran.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import _common as C

BASES = ("fp32", "mpx-bf16")
"""The systems every other is divided by, within each round."""

_TABLE_HEADS = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
# metadata={op_name="..." source_file="..." ...}: quoted strings may hold braces
_METADATA = re.compile(r',?\s*metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
# XLA:GPU's fingerprint of the module before its latency-hiding scheduler: of the text with
# its names and metadata, so two equal programs named differently differ there
_FINGERPRINT = re.compile(r',?\s*fingerprint_before_lhs="[^"]*"')
_NAME = re.compile(r"%[\w.\-]+")
# a computation's header: `[ENTRY ]%name (p0: f32[2], p1: s32[]) -> f32[2] {`
_HEADER = re.compile(r"^(ENTRY )?(%[\w.\-]+) \((.*)\) -> (.*) \{$")
_PARAM_NAME = re.compile(r"(^|, )[\w.\-]+: ")


def normalised_hlo(hlo: str) -> str:
    """Optimised HLO text with what does not change the program taken out: the module's name,
    the source-location tables, every ``metadata={...}`` (op names, source lines), XLA:GPU's
    ``fingerprint_before_lhs`` (a hash of the text before scheduling, names included), and the
    names of instructions, computations and parameters (renamed ``%0``, ``%1``, ... in order
    of first appearance, so that the wiring stays)."""
    lines, skipping = [], False
    for line in hlo.splitlines():
        if line.strip() in _TABLE_HEADS:
            skipping = True
        if skipping:
            skipping = bool(line.strip())
            continue
        if line.startswith("HloModule "):
            line = re.sub(r"^HloModule [^,\s]+", "HloModule m", line)
        line = _FINGERPRINT.sub("", _METADATA.sub("", line))
        header = _HEADER.match(line)
        if header:
            params = _PARAM_NAME.sub(r"\1", header[3])
            line = f"{header[1] or ''}{header[2]} ({params}) -> {header[4]} {{"
        if line.strip():
            lines.append(line.rstrip())
    names: dict[str, str] = {}
    text = "\n".join(lines)
    return _NAME.sub(lambda m: names.setdefault(m[0], f"%{len(names)}"), text)


def program_hash(hlo: str) -> str:
    """SHA-256 (hex) of :func:`normalised_hlo`: equal for the same compiled program however
    its function, arguments and source lines are named."""
    return hashlib.sha256(normalised_hlo(hlo).encode()).hexdigest()


def rotation(names: list[str], r: int) -> list[str]:
    """The order of round ``r`` (from 0): ``names`` rotated left by ``r``."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def rotated_rounds(
    runners: dict[str, Callable[[], Any]],
    *,
    rounds: int,
    steps: int,
    warmup: int = 1,
    stop_at: float | None = None,
) -> dict[str, Any]:
    """Time ``runners`` in rotated rounds (the module's docstring, steps 2-3).

    Each runner is called ``warmup`` times first (each waited for). Then in round ``r`` every
    runner, in the order :func:`rotation` gives, is called ``steps`` times back to back and
    waited for once; its time per call is recorded. No round starts after ``stop_at`` (the
    first always runs).

    Returns ``{"orders": [[name, ...] per round], "times": {name: [seconds per call, one per
    round]}, "cut": whether ``stop_at`` ended the rounds before ``rounds``}``.
    """
    names = list(runners)
    for _ in range(warmup):
        for name in names:
            C.block(runners[name]())
    orders: list[list[str]] = []
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        if r and stop_at is not None and time.time() >= stop_at:
            break
        orders.append(rotation(names, r))
        for name in orders[-1]:
            fn = runners[name]
            t0 = time.perf_counter()
            out = None
            for _ in range(steps):
                out = fn()
            C.block(out)
            times[name].append((time.perf_counter() - t0) / steps)
    return {"orders": orders, "times": times, "cut": len(orders) < rounds}


def _spread(xs: list[float]) -> dict[str, float]:
    q1, q3 = np.percentile(xs, [25, 75])
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "iqr": float(q3 - q1)}


def summarise(timing: dict[str, Any], bases: tuple[str, ...] = BASES) -> dict[str, dict[str, Any]]:
    """Per system of :func:`rotated_rounds`' result: ``step_s`` (median, min, max, IQR over
    rounds), ``vs`` (per base system timed: the same four of the per-round ratios
    ``time / base's time``), ``rounds_s`` (the times, round by round) and ``positions`` (its
    place in each round's order, from 0)."""
    times, orders = timing["times"], timing["orders"]
    out = {}
    for name, ts in times.items():
        if not ts:
            continue
        vs = {b: _spread([t / tb for t, tb in zip(ts, times[b])]) for b in bases if b in times and times[b]}
        positions = [order.index(name) for order in orders]
        out[name] = {"step_s": _spread(ts), "vs": vs, "rounds_s": list(ts), "positions": positions}
    return out


def identical_programs(results: dict[str, dict[str, Any]]) -> list[list[str]]:
    """Groups (two or more) of systems whose ``program_hash`` is the same."""
    groups: dict[str, list[str]] = {}
    for name, r in results.items():
        if r.get("program_hash"):
            groups.setdefault(r["program_hash"], []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def measure_resident(
    task: Any,
    names: list[str],
    *,
    rounds: int,
    steps: int,
    warmup: int,
    mode: str = "triton",
    hlo_prefix: Path | None = None,
    compile_threads: int = 1,
    stop_at: float | None = None,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every system of ``names`` on ``task`` compiled, resident together in this process, then
    timed in rotated rounds (the module's docstring). Returns ``{system: figures}``: those of
    :func:`benchmarks.gpu_measured.gpu.measure_in_process` (the step-0 gradient as ``grads0``,
    compile time, XLA memory, fmha and fp8 calls), ``program_hash``, and the rounds'
    (:func:`summarise`; ``median_step_s`` is the rounds' median). A system that fails to build
    or compile is a result (``error``). ``on_result`` gets the figures once all systems are
    compiled and again when they are timed (a run cut short keeps the first)."""
    from benchmarks.gpu_measured import gpu  # gpu imports this module

    results: dict[str, dict[str, Any]] = {}
    lowered = {}
    for name in names:
        try:
            lowered[name] = gpu._lower(task, name, mode, copy=len(names) > 1)
        except Exception as e:  # noqa: BLE001 - a failing system is a result
            results[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}

    def compile_one(name: str) -> tuple[Any, float]:
        t0 = time.perf_counter()
        return lowered[name].lowered.compile(), time.perf_counter() - t0

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, compile_threads)) as pool:
        futures = {name: pool.submit(compile_one, name) for name in lowered}
    compile_wall = time.perf_counter() - t0
    runners = {}
    for name in names:
        if name not in lowered:
            continue
        try:
            compiled, compile_s = futures[name].result()
            hlo_path = hlo_prefix.with_name(f"{hlo_prefix.name}-{name}.hlo.gz") if hlo_prefix else None
            runners[name], info = gpu._finish(task, lowered[name], compiled, compile_s, hlo_path)
        except Exception as e:  # noqa: BLE001
            results[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            continue
        results[name] = info | {"compile_wall_all_s": compile_wall, "compile_threads": compile_threads}
    results = {name: results[name] for name in names}  # the order asked for
    if on_result is not None:
        on_result({k: {f: v for f, v in r.items() if f != "grads0"} for k, r in results.items()})
    if not runners:
        return results
    timing = rotated_rounds(runners, rounds=rounds, steps=steps, warmup=warmup, stop_at=stop_at)
    for name, s in summarise(timing).items():
        results[name] |= s | {"median_step_s": s["step_s"]["median"], "rounds_cut": timing["cut"]}
    peak = C.device_peak_bytes()
    for name in runners:
        results[name]["process_peak_bytes"] = peak
    return results


# ----------------------------------------------------------------------------- report

METHOD = (
    "Method: every system compiled first and resident in one process, then timed in rotated "
    "rounds (round 1 in the order listed, each next round starting one system later), each "
    "system running its steps back to back in its turn, only the last waited for. Step time: "
    "the median over rounds of the time per step, with its spread over rounds (min-max; IQR). "
    "Ratios to fp32 and MPX: taken within each round, their median and min-max over rounds. "
    "Program: the first 12 hex digits of the SHA-256 of the optimised HLO, names, metadata "
    "and source locations taken out: systems with the same program have the same hash."
)


def _ms(s: float | None) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f}"


def _ratio(r: dict[str, Any], base: str) -> str:
    v = r.get("vs", {}).get(base)
    return "-" if not v else f"{v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f})"


def _mem(r: dict[str, Any], key: str) -> str:
    v = (r.get("xla_memory") or {}).get(key)
    return C.fmt_bytes(v) if v else "n/a"


def orders_line(results: dict[str, dict[str, Any]]) -> str:
    """The order of each round, from the systems' positions (``"1: a, b; 2: b, a"``)."""
    timed = {n: r["positions"] for n, r in results.items() if r.get("positions")}
    if not timed:
        return ""
    n_rounds = len(next(iter(timed.values())))
    orders = [sorted(timed, key=lambda n, i=i: timed[n][i]) for i in range(n_rounds)]
    return "; ".join(f"{i + 1}: {', '.join(o)}" for i, o in enumerate(orders))


def table(title: str, desc: str, results: dict[str, dict[str, Any]], fmha: Callable[[dict], str]) -> str:
    """One model's section of a rotated-rounds run: per system the step time and its spread,
    its per-round ratios to fp32 and MPX, XLA's temp and peak memory of its program, the
    step-0 gradient error, the cuDNN attention calls (``fmha``: the cell), compile time and
    program hash; then the round orders and the systems whose programs are identical."""
    rows = [
        f"### {title}\n\n{desc}\n",
        "| system | step time, median of rounds (back to back) | spread over rounds: min-max (IQR) | vs fp32, "
        "same round: median (min-max) | vs MPX bf16, same round | XLA temp | XLA peak | step-0 gradient error "
        "vs fp32 | cuDNN attention (fwd / bwd) | compile | program |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "error" in r:
            rows.append(f"| {name} | failed: {r['error']} | | | | | | | | | |")
            continue
        s = r.get("step_s")
        spread = f"{_ms(s['min'])}-{_ms(s['max'])} ms ({_ms(s['iqr'])})" if s else "not timed"
        err = r.get("grad_err_vs_fp32")
        rows.append(
            f"| {name} | {_ms(s and s['median'])} ms | {spread} | {_ratio(r, 'fp32')} | {_ratio(r, 'mpx-bf16')} | "
            f"{_mem(r, 'temp')} | {_mem(r, 'peak')} | {'n/a' if err is None else f'{err:.2e}'} | {fmha(r)} | "
            f"{r['compile_s']:.0f} s | `{r['program_hash'][:12]}` |"
        )
    orders = orders_line(results)
    cut = any(r.get("rounds_cut") for r in results.values())
    same = identical_programs(results)
    peak = next((r["process_peak_bytes"] for r in results.values() if r.get("process_peak_bytes")), None)
    rows.append("")
    rows.append(f"Round orders: {orders or 'none (not timed)'}" + (" (cut by the deadline)" if cut else "") + ".")
    rows.append("Identical programs: " + ("; ".join(_same_cell(g, results) for g in same) if same else "none") + ".")
    wall = next((r["compile_wall_all_s"] for r in results.values() if "compile_wall_all_s" in r), None)
    threads = next((r["compile_threads"] for r in results.values() if "compile_threads" in r), None)
    rows.append(
        (f"Compiled in {wall:.0f} s ({threads} at a time). " if wall is not None else "")
        + "Device peak of the process (all systems resident): "
        + (C.fmt_bytes(peak) if peak else "n/a")
        + "."
    )
    return "\n".join(rows)


def _same_cell(group: list[str], results: dict[str, dict[str, Any]]) -> str:
    """``a = b`` and, where both were timed, how far apart their medians are: the noise."""
    medians = [results[n]["step_s"]["median"] for n in group if results[n].get("step_s")]
    apart = f" (medians {max(medians) / min(medians) - 1:.1%} apart)" if len(medians) > 1 else ""
    return " = ".join(group) + apart
