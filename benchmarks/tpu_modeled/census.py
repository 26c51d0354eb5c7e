"""Reading an optimised XLA:TPU module (``compiled.as_text()``): its matmuls and kernels.

Pure text processing, no JAX (the HLO parser is :mod:`benchmarks.gpu_modeled.hlo_model`'s): the
tests feed it small HLO snippets, :mod:`benchmarks.tpu_modeled.tpu` whole train steps.

XLA:TPU writes every matmul as a ``convolution`` (``dim_labels=bf_io->bf``, the batch dimensions
as spatial ones) inside a fusion whose operands are the fusion's parameters, so a matmul is told
from a convolution by the JAX primitive it came from: the last component of its ``op_name``
metadata (``.../dot_general`` or ``.../conv_general_dilated``), which XLA keeps through its passes,
forward and backward. The operand dtypes are those the MXU reads (a ``convert`` fused into an
operand counts in its result dtype).

Sharp edges:

- an instruction without ``op_name`` metadata (none seen in a train step) counts as a matmul if
  its opcode is ``dot``, as a convolution if it is ``convolution``;
- Pallas/Mosaic kernels are ``custom-call`` s with ``custom_call_target="tpu_custom_call"``; XLA's
  own custom calls (``ConcatBitcast``, ``AllocateBuffer``, ...) are counted apart. A kernel is
  named by its ``pallas_call`` 's name (the ``op_name`` component before ``pallas_call``, else
  the instruction's name without its ``.N``): splash attention's are ``splash_mha_fwd`` (or
  ``splash_mha_fwd_residuals``: the forward that keeps the logsumexp for the backward),
  ``splash_mha_dq_no_residuals`` and ``splash_mha_dkv_no_residuals`` (or one fused
  ``splash_mha_dkv``-named backward); :func:`attention_kernels` sorts them into forward and backward;
- a Mosaic kernel's ``frontend_attributes`` hold JSON with newlines, so one instruction spans
  several lines of ``as_text()``: they are joined before parsing.
"""

from __future__ import annotations

import collections
import re
from typing import Any

from benchmarks.gpu_modeled import hlo_model as H

_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
_KERNEL_SUFFIX = re.compile(r"\.\d+$")
_NEW_LINE = re.compile(r"^(\s*(ROOT\s+)?%|ENTRY |HloModule|\}\s*$|\s*$)")
_AMP_STOP = "amp_stop"  # autocast.amp_stop's named scope, kept in the op_name metadata
MOSAIC = "tpu_custom_call"
"""The custom-call target of a Pallas (Mosaic) TPU kernel, e.g. splash attention's."""


def _primitive(ins: H.Instr) -> str:
    """The JAX primitive an instruction came from (its ``op_name`` 's last component), or ''."""
    m = _OP_NAME.search(ins.line)
    return m.group(1).rsplit("/", 1)[-1] if m else ""


def _in_amp_stop(ins: H.Instr) -> bool:
    m = _OP_NAME.search(ins.line)
    return bool(m and _AMP_STOP in m.group(1).split("/"))


def _joined(hlo: str) -> str:
    """``hlo`` with each instruction on one line (a continuation line appended to the line before)."""
    lines: list[str] = []
    for line in hlo.splitlines():
        if lines and not _NEW_LINE.match(line):
            lines[-1] += line
        else:
            lines.append(line)
    return "\n".join(lines)


def kernel_name(ins: H.Instr) -> str:
    """A Mosaic kernel's name: its ``pallas_call`` 's (see the module's sharp edges)."""
    m = _OP_NAME.search(ins.line)
    parts = m.group(1).split("/") if m else []
    if len(parts) >= 2 and parts[-1].startswith("pallas_call"):
        return parts[-2]
    return _KERNEL_SUFFIX.sub("", ins.name)


def attention_kernels(kernels: dict[str, int]) -> dict[str, int]:
    """Splash (or flash) attention kernels of a census's ``kernels``: ``{"forward": n, "backward": n}``.

    A name with ``splash`` or ``flash`` in it is attention (splash's names are
    ``splash_{mha|mqa}_{fwd|dq|dkv}[_segmented]{_residuals|_no_residuals}``, flash's its kernel
    functions': ``_flash_attention_kernel``, ``_flash_attention_dkv_kernel``, ...). ``dkv`` or
    ``bwd`` in it makes it a backward kernel (the one that makes the keys' and values' gradients:
    one per layer whether splash fuses the query's gradient into it or not); a separate ``dq``
    kernel is counted in neither; any other is a forward kernel.

    Example::

        attention_kernels({"splash_mha_fwd_residuals": 2, "splash_mha_dq_no_residuals": 2,
                           "splash_mha_dkv_no_residuals": 2})  # {"forward": 2, "backward": 2}
    """
    out = {"forward": 0, "backward": 0}
    for name, n in kernels.items():
        low = name.lower()
        if "splash" not in low and "flash" not in low:
            continue
        if "dkv" in low or "bwd" in low:
            out["backward"] += n
        elif "_dq" not in low:
            out["forward"] += n
    return out


def _kind(ins: H.Instr) -> str | None:
    """``"matmul"``, ``"convolution"`` or None for an instruction of the module."""
    if ins.op not in ("dot", "convolution"):
        return None
    prim = _primitive(ins)
    if prim.startswith("dot_general"):
        return "matmul"
    if prim.startswith("conv_general_dilated"):
        return "convolution"
    return "matmul" if ins.op == "dot" else "convolution"


def census(hlo: str) -> dict[str, Any]:
    """Counts in an optimised XLA:TPU module.

    Args:
        hlo: the module's text (``compiled.as_text()``).

    Returns:
        A dict of:

        - ``matmuls``: matmuls (JAX ``dot_general`` s, whatever XLA:TPU made of them) by operand
          dtypes (``"bf16 x bf16"``); ``matmul_types`` adds the result dtype
          (``"bf16 x bf16 -> f32"``);
        - ``f32_matmuls``: float32 x float32 matmuls outside ``autocast.amp_stop``;
          ``f32_matmuls_in_amp_stop``: those inside it;
        - ``convolutions`` (JAX ``conv_general_dilated`` s) by operand dtypes, ``f32_convolutions``
          (those with a float32 operand);
        - ``mosaic_kernels``: Pallas/Mosaic kernels (``tpu_custom_call``); ``kernels``: those by
          name (:func:`kernel_name`: ``{"splash_mha_fwd_residuals": 12, ...}``); ``custom_calls``:
          every custom call by target;
        - ``fusions``: fusion instructions in the module (every computation, loop bodies once);
        - ``while_loops``: ``while`` instructions; ``jax_loops``: those JAX made (``lax.scan``,
          ``fori_loop``, ``while_loop``: op_name ending in ``while``), the others XLA's own
          (a scatter expanded into a loop). XLA's cost analysis counts a loop body once, whatever
          its trip count: a step with a JAX loop has its FLOPs and bytes accessed under-counted.

    Example::

        census(compiled.as_text())["matmuls"]  # {"bf16 x bf16": 54}
    """
    _, comps = H.parse(_joined(hlo))
    types = {i.name: i.shape for instrs in comps.values() for i in instrs}
    matmuls: collections.Counter = collections.Counter()
    matmul_types: collections.Counter = collections.Counter()
    convs: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    kernels: collections.Counter = collections.Counter()
    f32 = f32_in_stop = fusions = loops = jax_loops = 0
    for ins in (i for instrs in comps.values() for i in instrs):
        fusions += ins.op == "fusion"
        loops += ins.op == "while"
        jax_loops += ins.op == "while" and _primitive(ins) == "while"
        if ins.op == "custom-call" and (t := _TARGET.search(ins.line)):
            calls[t.group(1)] += 1
            if t.group(1) == MOSAIC:
                kernels[kernel_name(ins)] += 1
        kind = _kind(ins)
        if kind is None:
            continue
        operands = " x ".join(H.dtype(types.get(x, "?")) for x in ins.args[:2])
        if kind == "convolution":
            convs[operands] += 1
            continue
        matmuls[operands] += 1
        matmul_types[f"{operands} -> {H.dtype(ins.shape)}"] += 1
        if operands == "f32 x f32":
            stop = _in_amp_stop(ins)
            f32_in_stop += stop
            f32 += not stop
    return {
        "matmuls": dict(matmuls),
        "matmul_types": dict(matmul_types),
        "f32_matmuls": f32,
        "f32_matmuls_in_amp_stop": f32_in_stop,
        "convolutions": dict(convs),
        "f32_convolutions": sum(v for k, v in convs.items() if "f32" in k),
        "mosaic_kernels": calls.get(MOSAIC, 0),
        "kernels": dict(kernels),
        "custom_calls": dict(calls),
        "fusions": fusions,
        "while_loops": loops,
        "jax_loops": jax_loops,
    }


def cell(counts: dict[str, int]) -> str:
    """A census counter as a table cell: ``"41 bf16 x bf16, 13 f32 x f32"`` (most first), ``-`` if empty."""
    return ", ".join(f"{v} {k}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) or "-"
