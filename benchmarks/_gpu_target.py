"""Deviceless compiles for a GPU target (``python -m benchmarks.gpu --target h100``).

XLA compiles for an NVIDIA GPU described by a target file (``benchmarks/targets/``) on a
machine without one, through the jax-cuda plugin's topology API: what comes back is the
optimised HLO and XLA:GPU's buffer assignment, with no autotuning (GEMM configurations are
XLA's defaults) and nothing run. Compare systems within one GEMM mode, never across:

- ``triton``: XLA's default (GEMMs as Triton fusions where it chooses to);
- ``cublas``: ``xla_gpu_enable_triton_gemm=False`` (every GEMM a cuBLAS(Lt) call).
"""

from __future__ import annotations

import collections
import re
from pathlib import Path
from typing import Any

import jax

TARGETS = {"h100": "h100_sxm.txtpb"}
MODES = {"triton": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}
_TARGET_DIR = Path(__file__).resolve().parent / "targets"


def target_sharding(target: str) -> Any:
    """A one-device ``NamedSharding`` on the deviceless ``target`` GPU.

    Raises ``RuntimeError`` naming the missing piece when the jax-cuda plugin is absent."""
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    if target not in TARGETS:
        raise ValueError(f"--target {target!r} unknown; allowed: {sorted(TARGETS)}")
    text = (_TARGET_DIR / TARGETS[target]).read_text()
    try:
        topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
    except Exception as e:  # noqa: BLE001 - the plugin's absence shows as several exception types
        raise RuntimeError(
            f"--target {target}: cannot compile for a CUDA target here ({type(e).__name__}: {e}); "
            "install the jax-cuda12 plugin matching jax (no GPU needed)"
        ) from e
    mesh = topologies.make_mesh(topo, (1,), ("x",))
    return NamedSharding(mesh, PartitionSpec())


def abstract(tree: Any, sharding: Any, batch_mult: int = 1) -> Any:
    """``ShapeDtypeStruct`` s of ``tree``'s arrays on ``sharding`` (leading axis times
    ``batch_mult``); PRNG keys and other leaves as they are."""

    def one(x):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            return x
        shape = (x.shape[0] * batch_mult, *x.shape[1:]) if batch_mult != 1 else x.shape
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    return jax.tree_util.tree_map(one, tree)


_INSTR = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\(.*?\)|\S+) ([a-z][a-z0-9\-]*)\((.*)$")
_NOT_KERNELS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all"})
_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas\$(?:lt\$matmul(?:\$f8)?|gemm))"')
_CALLS = re.compile(r"calls=%([^\s,}]+)")
_CONV_TARGET = re.compile(r'custom_call_target="(__cudnn\$conv[^"]*)"')


def _dtype(shape: str) -> str:
    return shape.lstrip("(").split("[", 1)[0]


def census(hlo: str) -> dict[str, Any]:
    """Counts in an optimised XLA:GPU module: ``kernels`` (the entry computation's
    instructions that launch work: fusions, custom calls, copies ...), ``gemms`` by operand
    dtypes (cuBLAS calls and the dots of Triton GEMM fusions), ``fp8_gemms``,
    ``convolutions`` by operand dtypes and ``transposes_into_gemms`` (GEMM operands made
    by a transpose or copy kernel of their own, rather than folded into the GEMM)."""
    types: dict[str, str] = {}
    entry: list[tuple[str, str, str]] = []
    gemms: collections.Counter = collections.Counter()
    convs: collections.Counter = collections.Counter()
    in_entry = False
    parsed = []
    for line in hlo.splitlines():
        if line.startswith("ENTRY "):
            in_entry = True
            continue
        if line.startswith("}"):
            in_entry = False
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        types[name] = shape
        parsed.append((op, rest, line))
        if in_entry and op not in _NOT_KERNELS:
            entry.append((name, op, line))

    def operand_dtypes(rest: str, n: int) -> str:
        names = re.findall(r"%([^\s,)]+)", rest.split(")", 1)[0])[:n]
        return " x ".join(_dtype(types.get(x, "?")) for x in names)

    for op, rest, line in parsed:
        if op == "dot":
            gemms[operand_dtypes(rest, 2)] += 1
        elif op == "custom-call" and _GEMM_TARGET.search(line):
            gemms[operand_dtypes(rest, 2)] += 1
        elif op == "convolution" or (op == "custom-call" and _CONV_TARGET.search(line)):
            convs[operand_dtypes(rest, 2)] += 1
    in_triton = sum(1 for _, _, line in entry if "__triton_gemm" in line or "gemm_fusion" in line)
    # GEMM operands made by a transpose kernel of their own (one not folded into the GEMM)
    made = {name: (op, line) for name, op, line in entry}
    bitcast_of = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m and m.group(3) == "bitcast":
            src = re.findall(r"%([^\s,)]+)", m.group(4).split(")", 1)[0])
            if src:
                bitcast_of[m.group(1)] = src[0]

    def is_transpose(name: str) -> bool:
        name = bitcast_of.get(name, name)
        op, line = made.get(name, ("", ""))
        called = _CALLS.search(line)
        return op in ("transpose", "copy") or bool(called and "transpose" in called.group(1))

    transposes_into_gemms = 0
    for _, _, line in entry:
        if _GEMM_TARGET.search(line) or "__triton_gemm" in line or "gemm_fusion" in line:
            operands = re.findall(r"%([^\s,)]+)", line.split("(", 1)[1].split(")", 1)[0])
            transposes_into_gemms += sum(1 for o in operands[:2] if is_transpose(o))
    # a Triton GEMM fusion's dot is counted once (its computation), not again at its call site
    return {
        "kernels": len(entry),
        "kernel_ops": dict(collections.Counter(op for _, op, _ in entry)),
        "gemm_kernels": in_triton
        + sum(1 for _, op, line in entry if op == "custom-call" and _GEMM_TARGET.search(line)),
        "gemms": dict(gemms),
        "fp8_gemms": sum(v for k, v in gemms.items() if "f8" in k),
        "convolutions": dict(convs),
        "f32_convolutions": sum(v for k, v in convs.items() if "f32" in k),
        "transposes_into_gemms": transposes_into_gemms,
    }


def compile_for_target(jitted: Any, args: tuple, **lower_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``jitted.lower(*args).compile()`` and its census plus XLA:GPU's memory analysis."""
    compiled = jitted.lower(*args, **lower_kwargs).compile()
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    mem["peak"] = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    return compiled, {**census(compiled.as_text()), "memory": mem}
