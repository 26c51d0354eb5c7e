"""Collectives in optimised HLO text (``jax.jit(f).lower(...).compile().as_text()``): which
dtypes and shapes each kind moves. Shared by the multi-device tests."""

from __future__ import annotations

import re

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_LINE = re.compile(r"=\s*(.*?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64|f8\w*)\[([\d,]*)\]")


def collectives(hlo: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(kind, dtype, shape)`` of every array each collective of ``hlo`` produces."""
    out = []
    for line in hlo.splitlines():
        m = _LINE.search(line)
        if m is None:
            continue
        for dtype, dims in _ARRAY.findall(m.group(1)):
            out.append((m.group(2), dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def kinds_with(hlo: str, shape: tuple[int, ...]) -> set[tuple[str, str]]:
    """``(kind, dtype)`` of the collectives producing arrays of ``shape``."""
    return {(k, d) for k, d, s in collectives(hlo) if s == shape}
