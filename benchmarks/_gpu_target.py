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
from typing import Any, NamedTuple

import jax

TARGETS = {"h100": "h100_sxm.txtpb"}
MODES = {"triton": None, "cublas": {"xla_gpu_enable_triton_gemm": False}}
_TARGET_DIR = Path(__file__).resolve().parent / "targets"


def _plugin_hint() -> str:
    """What to install (or set) for deviceless CUDA compiles, for an error message."""
    import importlib.util
    import os

    import jaxlib

    v = jaxlib.__version__
    try:
        installed = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        installed = False
    if not installed:
        return (
            f"install the jax-cuda12 plugin matching jaxlib {v} (no GPU or nvidia-* wheels needed): "
            f"pip install --no-deps jax-cuda12-plugin=={v} jax-cuda12-pjrt=={v}, "
            "or run bash tests/run_gpu_program.sh, which does"
        )
    if os.environ.get("JAX_PLATFORMS") != "cpu":
        return "the jax-cuda12 plugin is installed: set JAX_PLATFORMS=cpu before JAX starts (without a GPU it is not registered otherwise)"
    return f"the jax-cuda12 plugin is installed: check that its version is jaxlib's ({v})"


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
            f"--target {target}: cannot compile for a CUDA target here ({type(e).__name__}: {e}); {_plugin_hint()}"
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
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_NOT_KERNELS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all"})
_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas\$(?:lt\$matmul(?:\$f8)?|gemm))"')
_CALLS = re.compile(r"calls=%([^\s,}]+)")
_BODIES = re.compile(r"(?:condition|body|to_apply|true_computation|false_computation)=%([^\s,}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONV_TARGET = re.compile(r'custom_call_target="(__cudnn\$conv[^"]*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_AMP_STOP = "amp_stop"  # autocast.amp_stop's named scope, kept in the HLO's op_name metadata


class _Instr(NamedTuple):
    name: str
    shape: str
    op: str
    rest: str
    line: str

    def operands(self) -> list[str]:
        return re.findall(r"%([^\s,)]+)", self.rest.split(")", 1)[0])


def _dtype(shape: str) -> str:
    return shape.lstrip("(").split("[", 1)[0]


def _parse(hlo: str) -> tuple[str, dict[str, list[_Instr]]]:
    """The entry computation's name and every computation's instructions."""
    comps: dict[str, list[_Instr]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            current = comps.setdefault(c.group(2), [])
            entry = c.group(2) if c.group(1) else entry
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            current.append(_Instr(*m.groups(), line))
    return entry, comps


def _launch_computations(entry: str, comps: dict[str, list[_Instr]]) -> list[str]:
    """The entry computation and the while/conditional/call bodies it reaches (each once):
    the computations whose instructions are launched from the host, not fused."""
    order, todo = [], [entry]
    while todo:
        name = todo.pop(0)
        if name in order or name not in comps:
            continue
        order.append(name)
        for ins in comps[name]:
            if ins.op in ("while", "conditional", "call"):
                todo += _BODIES.findall(ins.line)
                for group in _BRANCHES.findall(ins.line):
                    todo += re.findall(r"%([^\s,]+)", group)
    return order


def _is_gemm_call(ins: _Instr) -> bool:
    """A GEMM launch: a cuBLAS(Lt) custom call or a Triton GEMM fusion."""
    if ins.op == "custom-call":
        return bool(_GEMM_TARGET.search(ins.line))
    if ins.op != "fusion" or "kind=kCustom" not in ins.line:
        return False
    called = _CALLS.search(ins.line)
    return '"__triton_gemm"' in ins.line or bool(called and "gemm_fusion" in called.group(1))


_MOVES_ONLY = {"parameter", "transpose", "bitcast", "copy", "reshape", "tuple", "get-tuple-element", "constant"}


def _transposes_around_gemms(instrs: list[_Instr], comps: dict[str, list[_Instr]]) -> tuple[int, int]:
    """GEMM operands made by, and GEMM launches whose result feeds, a transpose kernel: a
    transpose or copy, or a fusion that only moves data (a fusion that transposes while it
    computes, e.g. the optimizer update, is a launch the step has anyway)."""
    made = {i.name: i for i in instrs}
    users: dict[str, list[_Instr]] = collections.defaultdict(list)
    for i in instrs:
        for o in i.operands():
            users[o].append(i)
    see_through = ("bitcast", "get-tuple-element")

    def is_transpose(ins: _Instr | None) -> bool:
        while ins is not None and ins.op in see_through:
            ins = made.get(ins.operands()[0]) if ins.operands() else None
        if ins is None:
            return False
        if ins.op in ("transpose", "copy"):
            return True
        called = _CALLS.search(ins.line)
        body = comps.get(called.group(1), []) if ins.op == "fusion" and called else []
        ops = {i.op for i in body}
        return "transpose" in ops and ops <= _MOVES_ONLY

    def consumers(name: str) -> list[_Instr]:
        out = []
        for u in users.get(name, []):
            out += consumers(u.name) if u.op in see_through else [u]
        return out

    gemms = [i for i in instrs if _is_gemm_call(i)]
    into = sum(1 for g in gemms for o in g.operands()[:2] if is_transpose(made.get(o)))
    after = sum(1 for g in gemms if any(is_transpose(u) for u in consumers(g.name)))
    return into, after


def census(hlo: str) -> dict[str, Any]:
    """Counts in an optimised XLA:GPU module (``compiled.as_text()``).

    - ``kernels``: launches in one execution of each launch computation (the entry and the
      while/conditional bodies it reaches, a loop body counted once, not per trip): every
      instruction but ``parameter``, ``constant``, ``tuple``, ``get-tuple-element``,
      ``bitcast``, ``after-all`` and the ``while``/``conditional``/``call`` themselves;
      that is fusions, custom calls (cuBLAS, cuDNN), copies and the other unfused ops.
      ``kernel_ops`` breaks it down by opcode; ``gemm_kernels`` counts the GEMM launches.
    - ``gemms``: GEMMs by operand dtypes (``"bf16 x bf16"``): cuBLAS(Lt) calls and the dots
      of Triton GEMM fusions (and any other dot XLA kept); ``gemm_types`` adds the result
      dtype (``"bf16 x bf16 -> f32"``); ``fp8_gemms``: those with a float8 operand.
    - ``f32_gemms``: float32 x float32 GEMMs outside ``autocast.amp_stop`` (by the op_name
      metadata XLA keeps: JAX's name stack, forward and backward); ``f32_gemms_in_amp_stop``.
    - ``convolutions`` by operand dtypes (cuDNN calls), ``f32_convolutions``.
    - ``transposes_into_gemms`` / ``transposes_after_gemms``: GEMM operands made by, and
      GEMM results consumed by, a transpose or copy kernel of its own (a copy, transpose or
      fusion that only moves data; through bitcasts and tuple elements), where XLA did not
      fold the layout change into the GEMM.
    """
    entry, comps = _parse(hlo)
    types = {i.name: i.shape for instrs in comps.values() for i in instrs}
    launch = _launch_computations(entry, comps)
    kernels = [i for c in launch for i in comps[c] if i.op not in _NOT_KERNELS | {"while", "conditional", "call"}]

    gemms: collections.Counter = collections.Counter()
    gemm_types: collections.Counter = collections.Counter()
    convs: collections.Counter = collections.Counter()
    f32_gemms = f32_in_stop = 0
    for ins in (i for instrs in comps.values() for i in instrs):
        operands = " x ".join(_dtype(types.get(x, "?")) for x in ins.operands()[:2])
        if ins.op == "dot" or (ins.op == "custom-call" and _GEMM_TARGET.search(ins.line)):
            gemms[operands] += 1
            gemm_types[f"{operands} -> {_dtype(ins.shape)}"] += 1
            if operands == "f32 x f32":
                op_name = _OP_NAME.search(ins.line)
                in_stop = bool(op_name and _AMP_STOP in op_name.group(1).split("/"))
                f32_in_stop += in_stop
                f32_gemms += not in_stop
        elif ins.op == "convolution" or (ins.op == "custom-call" and _CONV_TARGET.search(ins.line)):
            convs[operands] += 1

    into = after = 0
    for c in launch:
        i, o = _transposes_around_gemms(comps[c], comps)
        into, after = into + i, after + o
    return {
        "kernels": len(kernels),
        "kernel_ops": dict(collections.Counter(i.op for i in kernels)),
        "gemm_kernels": sum(1 for i in kernels if _is_gemm_call(i)),
        "gemms": dict(gemms),
        "gemm_types": dict(gemm_types),
        "fp8_gemms": sum(v for k, v in gemms.items() if "f8" in k),
        "f32_gemms": f32_gemms,
        "f32_gemms_in_amp_stop": f32_in_stop,
        "convolutions": dict(convs),
        "f32_convolutions": sum(v for k, v in convs.items() if "f32" in k),
        "transposes_into_gemms": into,
        "transposes_after_gemms": after,
    }


def memory(compiled: Any) -> dict[str, int]:
    """XLA:GPU's buffer assignment in bytes: ``argument``, ``output``, ``alias`` (outputs
    sharing a donated argument's buffer), ``temp`` and ``peak`` = argument + output + temp
    - alias (what the step holds at once, at most); ``xla_peak``: XLA's own figure from its
    heap simulation (live ranges known: at most ``peak``), where reported."""
    ma = compiled.memory_analysis()
    mem = {k: int(getattr(ma, f"{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    mem["peak"] = mem["argument"] + mem["output"] + mem["temp"] - mem["alias"]
    mem["xla_peak"] = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    return mem


def compile_for_target(jitted: Any, args: tuple, **lower_kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """``jitted.lower(*args).compile()`` and its census plus XLA:GPU's memory analysis."""
    compiled = jitted.lower(*args, **lower_kwargs).compile()
    return compiled, {**census(compiled.as_text()), "memory": memory(compiled)}
