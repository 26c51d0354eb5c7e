"""What a TPU step's temp memory holds: the buffers live at the peak of XLA:TPU's heap.

``python -m benchmarks.tpu_modeled.buffers --model gpt2-2blocks --systems mpx-bf16 autocast-bf16``
compiles each step for the deviceless TPU (:func:`benchmarks.tpu_modeled.tpu.compile_step`) with
XLA's dumps on (``xla_dump_to``) and reads three of the files XLA writes after its optimisations:

- ``*-buffer-assignment.txt``: the allocations; XLA:TPU puts the step's temporaries in one
  ``preallocated-temp`` heap per memory space (HBM, colour 0; VMEM, colour 1; ...), each value at
  an offset in it. ``memory_analysis().temp_size_in_bytes`` is their sum (the HBM heap, VMEM's
  scratch and a few small thread-local buffers);
- ``*-live-range.txt``: each value's live range over the flattened schedule (loop bodies
  inline);
- ``*after_optimizations.txt``: the optimised HLO, for each value's producer and the JAX
  ``op_name`` it came from (through copies, the memory-space prefetches and evictions XLA:TPU
  adds: ``copy-start``/``copy-done``).

Reported per step: the HBM heap's size, the schedule step where the most of it is live at once,
and the largest values live there, each with its shape, dtype and origin. The heap can be larger
than its live peak (fragmentation: values placed at offsets that later values cannot share).

``--from-dump DIR`` reads dumps an earlier run left (``--dump``, or
``python -m benchmarks.tpu_modeled.tpu --dump``) instead of compiling.
"""

from __future__ import annotations

import argparse
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_modeled import hlo_model as H

_ALLOC = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+?)(\{[0-9,]*\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_RANGE = re.compile(r"^    (\S+\{[0-9,]*\}):(\d+)-(\d+)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([^\s,}]+)")
_MOVES = frozenset({"copy-start", "copy-done", "copy", "bitcast", "get-tuple-element"})


@dataclass(frozen=True)
class Value:
    """One HLO value in an allocation: its instruction, tuple index (``"{}"``, ``"{0}"``), bytes,
    offset and shape (text)."""

    name: str
    index: str
    size: int
    offset: int
    shape: str

    @property
    def key(self) -> str:
        return f"{self.name}{self.index}"


@dataclass(frozen=True)
class Allocation:
    """One allocation of XLA's buffer assignment: its number, bytes, description and values."""

    number: int
    size: int
    kind: str
    values: tuple[Value, ...]

    @property
    def color(self) -> int:
        m = re.search(r"\bcolor (\d+)", self.kind)
        return int(m.group(1)) if m else 0


def allocations(text: str) -> list[Allocation]:
    """The allocations of a ``*-buffer-assignment.txt`` dump."""
    out: list[Allocation] = []
    head: tuple[int, int, str] | None = None
    values: list[Value] = []
    for line in text.splitlines():
        if a := _ALLOC.match(line):
            if head:
                out.append(Allocation(*head, tuple(values)))
            head, values = (int(a.group(1)), int(a.group(2)), a.group(3)), []
        elif head and (v := _VALUE.match(line)):
            values.append(Value(v.group(1), v.group(2) or "{}", int(v.group(3)), int(v.group(4)), v.group(5)))
        elif head and line and not line.startswith(" "):
            out.append(Allocation(*head, tuple(values)))
            head = None
    if head:
        out.append(Allocation(*head, tuple(values)))
    return out


def live_ranges(text: str) -> dict[str, tuple[int, int]]:
    """``"name{index}" -> (first, last)`` schedule steps of a ``*-live-range.txt`` dump."""
    out: dict[str, tuple[int, int]] = {}
    section = False
    for line in text.splitlines():
        if line.strip() == "BufferLiveRange:":
            section = True
        elif section and (m := _RANGE.match(line)):
            out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
        elif section and line.strip():
            break
    return out


def origin(name: str, instrs: dict[str, H.Instr]) -> tuple[str, str]:
    """``(producer, op_name)`` of instruction ``name``: through copies, bitcasts and tuple
    elements to the instruction that computed it, and the JAX ``op_name`` it carries (for an
    entry parameter: the pytree path JAX gave it, ``a[0].embed.weight``)."""
    seen = set()
    while name in instrs and name not in seen:
        seen.add(name)
        ins = instrs[name]
        m = _OP_NAME.search(ins.line)
        if m and ins.op not in _MOVES:
            return name, m.group(1)
        if ins.op not in _MOVES or not ins.args:
            return name, m.group(1) if m else ins.op
        name = ins.args[0]
    return name, ""


def fusion_output(name: str, index: str, comps: dict[str, list[H.Instr]], instrs: dict[str, H.Instr]) -> str | None:
    """The JAX ``op_name`` of output ``index`` of a multi-output fusion ``name`` (None if it is not
    one): the instruction its fused computation's ROOT tuple puts there, through bitcasts and
    converts, not the fusion's own ``op_name`` (which XLA takes from one of its outputs)."""
    ins = instrs.get(name)
    called = _CALLS.search(ins.line) if ins is not None and ins.op == "fusion" else None
    if called is None or not index.strip("{}") or called.group(1) not in comps:
        return None
    body = {i.name: i for i in comps[called.group(1)]}
    root = next((i for i in comps[called.group(1)] if i.line.lstrip().startswith("ROOT ")), None)
    i = int(index.strip("{}").split(",")[0])
    if root is None or root.op != "tuple" or i >= len(root.args):
        return None
    node = body.get(root.args[i])
    while node is not None:
        m = _OP_NAME.search(node.line)
        if m:
            return m.group(1)
        node = body.get(node.args[0]) if node.op in ("bitcast", "convert", "copy") and node.args else None
    return None


def _element(shape: str, index: str) -> str:
    """The array of ``shape`` at tuple ``index`` (``"{}"``: the shape itself), as ``dtype[dims]``."""
    arrays = H.arrays(shape)
    i = int(index.strip("{}").split(",")[0]) if index.strip("{}") else 0
    dt, dims = arrays[min(i, len(arrays) - 1)] if arrays else ("?", ())
    return f"{dt}[{','.join(map(str, dims))}]"


def heap_peak(dump: Path, top: int = 12) -> dict[str, Any]:
    """The HBM temp heap of the step dumped under ``dump`` and what is live at its peak.

    Args:
        dump: an ``xla_dump_to`` folder of one compile of ``jit_train_step``.
        top: how many of the largest live values to list.

    Returns:
        ``{"temp_by_color": {colour: bytes}, "heap": bytes, "peak_step": step, "live_bytes": bytes,
        "live": [{"bytes", "value", "array", "producer", "op_name"}, ...], "by_array": [[array, count,
        bytes], ...]}`` (largest first; ``by_array``: the live values grouped by shape and dtype; a
        multi-output fusion's value named by the op_name of its own output, :func:`fusion_output`).
    """

    def one(pattern: str) -> Path:
        found = sorted(dump.glob(f"*jit_train_step*{pattern}"))
        if not found:
            raise FileNotFoundError(f"no *jit_train_step*{pattern} under {dump}")
        return found[0]

    allocs = allocations(one("after_optimizations-buffer-assignment.txt").read_text())
    ranges = live_ranges(one("after_optimizations-live-range.txt").read_text())
    _, comps = H.parse(one("after_optimizations.txt").read_text())
    instrs = {i.name: i for body in comps.values() for i in body}
    temps = [a for a in allocs if "preallocated-temp" in a.kind or "thread-local" in a.kind]
    by_color: dict[int, int] = {}
    for a in temps:
        by_color[a.color] = by_color.get(a.color, 0) + a.size
    heap = max((a for a in temps if a.color == 0 and "preallocated-temp" in a.kind), key=lambda a: a.size)
    events: dict[int, int] = {}
    for v in heap.values:
        if v.key in ranges:
            start, end = ranges[v.key]
            events[start] = events.get(start, 0) + v.size
            events[end + 1] = events.get(end + 1, 0) - v.size
    live = best = step = 0
    for t in sorted(events):
        live += events[t]
        if live > best:
            best, step = live, t
    at_peak = [v for v in heap.values if v.key in ranges and ranges[v.key][0] <= step <= ranges[v.key][1]]
    rows = []
    for v in sorted(at_peak, key=lambda v: -v.size)[:top]:
        producer, op_name = origin(v.name, instrs)
        op_name = fusion_output(v.name, v.index, comps, instrs) or op_name
        rows.append(
            {
                "bytes": v.size,
                "value": v.key,
                "array": _element(v.shape, v.index),
                "producer": producer,
                "op_name": op_name,
            }
        )
    groups: dict[str, list[int]] = {}
    for v in at_peak:
        g = groups.setdefault(_element(v.shape, v.index), [0, 0])
        g[0], g[1] = g[0] + 1, g[1] + v.size
    by_array = sorted(([a, n, b] for a, (n, b) in groups.items()), key=lambda r: -r[2])[:top]
    return {
        "temp_by_color": by_color,
        "by_array": by_array,
        "heap": heap.size,
        "peak_step": step,
        "live_bytes": best,
        "live": rows,
    }


def markdown(title: str, peak: dict[str, Any]) -> str:
    """A :func:`heap_peak` result as a markdown section."""
    mib = lambda n: f"{n / 2**20:,.1f}"  # noqa: E731
    colors = ", ".join(f"colour {c}: {mib(b)} MiB" for c, b in sorted(peak["temp_by_color"].items()))
    rows = [
        f"#### {title}\n",
        f"Temp allocations by memory space: {colors} (colour 0: HBM, 1: VMEM). HBM temp heap "
        f"{mib(peak['heap'])} MiB; at its peak (schedule step {peak['peak_step']}) {mib(peak['live_bytes'])} MiB "
        "of it live at once.\n",
        "By array: " + ", ".join(f"{n} x {a} {mib(b)} MiB" for a, n, b in peak["by_array"]) + ". The largest values:\n",
        "| MiB | array | HLO value | computed by | JAX op_name |",
        "|---|---|---|---|---|",
    ]
    for r in peak["live"]:
        rows.append(f"| {mib(r['bytes'])} | {r['array']} | `{r['value']}` | `{r['producer']}` | `{r['op_name']}` |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    """Compile (or read the dumps of) each system's step and print :func:`markdown` of each."""
    from benchmarks.tpu_modeled import tpu

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(tpu.TARGETS), default="v5e")
    ap.add_argument("--model", choices=sorted(tpu.MODELS), default="gpt2-2blocks")
    ap.add_argument("--systems", nargs="+", default=["mpx-bf16", "autocast-bf16", "autocast-bf16-xla-loss-head"])
    ap.add_argument("--batch", type=int, help="the model at this batch size (default: its own)")
    ap.add_argument("--top", type=int, default=12, help="how many live values to list")
    ap.add_argument(
        "--dump", help="keep the dumps under DIR/<model>[-batch<N>]-<system>/ (default: a temporary folder)"
    )
    ap.add_argument("--from-dump", help="read DIR/<model>[-batch<N>]-<system>/ instead of compiling")
    args = ap.parse_args(argv)
    tag = f"{args.model}{f'-batch{args.batch}' if args.batch else ''}"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.from_dump or args.dump or tmp)
        if not args.from_dump:
            task, sharding = tpu.make_task(args.model, args.batch), tpu.target_sharding(args.target)
            for name in args.systems:
                tpu.compile_step(task, name, sharding, root / f"{tag}-{name}")
        for name in args.systems:
            print(markdown(f"{tag} {name} ({args.target})", heap_peak(root / f"{tag}-{name}", args.top)) + "\n")


if __name__ == "__main__":
    main()
