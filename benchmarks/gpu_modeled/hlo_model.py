"""Reading an optimised XLA:GPU module (``compiled.as_text()``): the census and the roofline model.

Pure text processing, no JAX: the tests feed it small HLO snippets, and the deviceless
compiles (:mod:`benchmarks.gpu_modeled.deviceless`) feed it whole train steps.

- :func:`census`: what the program launches: kernels, GEMMs by operand dtype, float8
  GEMMs, float32 GEMMs outside ``autocast.amp_stop``, convolutions, cuDNN fused attention
  calls, transposes around GEMMs.
- :func:`roofline`: a model of the step's time on a GPU from its traffic and work at the
  datasheet rates of :data:`H100_SXM`: per launched kernel, HBM bytes = its operands' bytes +
  its result's bytes, GEMM FLOPs = 2 x |output| x K (cuBLAS calls, Triton GEMM fusions, cuDNN
  convolutions; cuDNN's fused attention: its products, :func:`fmha_flops`), time = max(bytes / bandwidth, FLOPs / peak) + launch cost. A model, not a
  measurement: it ignores caches (an operand read twice from L2 counts twice), overlap of
  kernels, partial reads of sliced operands (a fusion that reads a slice of a large operand
  is charged the whole operand) and achieved-vs-peak GEMM rates.
"""

from __future__ import annotations

import collections
import json
import math
import re
from dataclasses import dataclass
from typing import Any, NamedTuple

# ----------------------------------------------------------------------------- parsing

_HEAD = re.compile(r"^\s*(?:ROOT )?%(\S+) = ")
_OP = re.compile(r" ([a-z][a-z0-9\-]*)\(")
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{\s*$")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


class Instr(NamedTuple):
    """One HLO instruction: ``name``, result ``shape`` (text), ``op``, ``rest`` (the text after
    ``op(``), the whole ``line`` and its operand names."""

    name: str
    shape: str
    op: str
    rest: str
    line: str
    args: tuple[str, ...]

    def operands(self) -> list[str]:
        return list(self.args)


def _close(text: str, i: int) -> int:
    """The index after the parenthesis that closes the one at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "(":
            depth += 1
        elif text[j] == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def parse_instr(line: str) -> Instr | None:
    """An instruction line, or None (tuple shapes and operand lists with nested parentheses
    are matched as a whole)."""
    m = _HEAD.match(line)
    if not m:
        return None
    i = m.end()
    j = _close(line, i) if line.startswith("(", i) else line.find(" ", i)
    if j < 0:
        return None
    op = _OP.match(line, j)
    if not op:
        return None
    k = _close(line, op.end() - 1)
    args = tuple(re.findall(r"%([^\s,()]+)", line[op.end() : k - 1]))
    return Instr(m.group(1), line[i:j], op.group(1), line[op.end() :], line, args)


def parse(hlo: str) -> tuple[str, dict[str, list[Instr]]]:
    """The entry computation's name and every computation's instructions."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            current = comps.setdefault(c.group(2), [])
            entry = c.group(2) if c.group(1) else entry
            continue
        ins = parse_instr(line) if current is not None else None
        if ins is not None and current is not None:
            current.append(ins)
    return entry, comps


def dtype(shape: str) -> str:
    """The element type of an array shape (the first element's for a tuple)."""
    return shape.lstrip("(").split("[", 1)[0]


# bits per element; token and opaque hold no data
_BITS = {"pred": 8, "token": 0, "opaque": 0, "c64": 64, "c128": 128}


def _bits(dt: str) -> int:
    if dt in _BITS:
        return _BITS[dt]
    if dt.startswith(("f8", "f4", "f6")):
        return int(dt[1])  # f8e4m3fn, f8e5m2, ...: 8 bits; f4e2m1fn: 4
    m = re.fullmatch(r"[a-z]+?(\d+)", dt)
    if not m:
        raise ValueError(f"unknown HLO element type {dt!r}")
    return int(m.group(1))


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays of a shape, tuples flattened: ``[(dtype, dims), ...]``."""
    return [(dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _ARRAY.findall(shape)]


def nbytes(shape: str) -> int:
    """Bytes of a shape (tuples: the sum of their arrays; sub-byte types packed)."""
    return sum(math.ceil(math.prod(dims) * _bits(dt) / 8) for dt, dims in arrays(shape))


def _dims_attr(line: str, key: str) -> list[int]:
    m = re.search(rf"\b{key}=\{{([0-9,]*)\}}", line)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


# ----------------------------------------------------------------------------- census

_NOT_KERNELS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all"})
_CONTROL = frozenset({"while", "conditional", "call"})
_GEMM_TARGET = re.compile(r'custom_call_target="(__cublas\$(?:lt\$matmul(?:\$f8)?|gemm))"')
_CALLS = re.compile(r"calls=%([^\s,}]+)")
_BODIES = re.compile(r"(?:condition|body|to_apply|true_computation|false_computation)=%([^\s,}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONV_TARGET = re.compile(r'custom_call_target="(__cudnn\$conv[^"]*)"')
# cuDNN's fused attention (jax.nn.dot_product_attention(..., implementation="cudnn")):
# __cudnn$fmhaSoftmax, __cudnn$fmhaScaleBiasSoftmax, ...Dropout, their ...Backward, fp8 variants
_FMHA_TARGET = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_AMP_STOP = "amp_stop"  # autocast.amp_stop's named scope, kept in the HLO's op_name metadata


def launch_computations(entry: str, comps: dict[str, list[Instr]]) -> dict[str, int]:
    """The entry computation and the while/conditional/call bodies it reaches: the
    computations whose instructions are launched from the host, not fused, each with how
    many times one step runs it (a while body: its known trip count, else 1; a conditional's
    branches: once each, an upper bound), in the order they are reached."""
    runs: dict[str, int] = {}
    todo = [(entry, 1)]
    while todo:
        name, n = todo.pop(0)
        if name in runs or name not in comps:
            continue
        runs[name] = n
        for ins in comps[name]:
            if ins.op not in _CONTROL:
                continue
            trips = _TRIP_COUNT.search(ins.line) if ins.op == "while" else None
            todo += [(c, n * (int(trips.group(1)) if trips else 1)) for c in _BODIES.findall(ins.line)]
            for group in _BRANCHES.findall(ins.line):
                todo += [(c, n) for c in re.findall(r"%([^\s,]+)", group)]
    return runs


def kernels(entry: str, comps: dict[str, list[Instr]]) -> list[tuple[Instr, int]]:
    """Every launched kernel, with the times one step launches it: the instructions of the
    launch computations but ``parameter``, ``constant``, ``tuple``, ``get-tuple-element``,
    ``bitcast``, ``after-all`` and the ``while``/``conditional``/``call`` themselves."""
    runs = launch_computations(entry, comps)
    return [(i, n) for c, n in runs.items() for i in comps[c] if i.op not in _NOT_KERNELS | _CONTROL]


def is_gemm_call(ins: Instr) -> bool:
    """A GEMM launch: a cuBLAS(Lt) custom call or a Triton GEMM fusion."""
    if ins.op == "custom-call":
        return bool(_GEMM_TARGET.search(ins.line))
    if ins.op != "fusion" or "kind=kCustom" not in ins.line:
        return False
    called = _CALLS.search(ins.line)
    return '"__triton_gemm"' in ins.line or bool(called and "gemm_fusion" in called.group(1))


_MOVES_ONLY = {"parameter", "transpose", "bitcast", "copy", "reshape", "tuple", "get-tuple-element", "constant"}


def _transposes_around_gemms(instrs: list[Instr], comps: dict[str, list[Instr]]) -> tuple[int, int]:
    """GEMM operands made by, and GEMM launches whose result feeds, a transpose kernel: a
    transpose or copy, or a fusion that only moves data (a fusion that transposes while it
    computes, e.g. the optimizer update, is a launch the step has anyway)."""
    made = {i.name: i for i in instrs}
    users: dict[str, list[Instr]] = collections.defaultdict(list)
    for i in instrs:
        for o in i.args:
            users[o].append(i)
    see_through = ("bitcast", "get-tuple-element")

    def is_transpose(ins: Instr | None) -> bool:
        while ins is not None and ins.op in see_through:
            ins = made.get(ins.args[0]) if ins.args else None
        if ins is None:
            return False
        if ins.op in ("transpose", "copy"):
            return True
        called = _CALLS.search(ins.line)
        body = comps.get(called.group(1), []) if ins.op == "fusion" and called else []
        ops = {i.op for i in body}
        return "transpose" in ops and ops <= _MOVES_ONLY

    def consumers(name: str) -> list[Instr]:
        out = []
        for u in users.get(name, []):
            out += consumers(u.name) if u.op in see_through else [u]
        return out

    gemms = [i for i in instrs if is_gemm_call(i)]
    into = sum(1 for g in gemms for o in g.args[:2] if is_transpose(made.get(o)))
    after = sum(1 for g in gemms if any(is_transpose(u) for u in consumers(g.name)))
    return into, after


def fmha_call(ins: Instr) -> str | None:
    """``"forward"`` or ``"backward"`` for a cuDNN fused attention call (``__cudnn$fmha*``;
    ``...Backward``), else None."""
    m = _FMHA_TARGET.search(ins.line) if ins.op == "custom-call" else None
    return None if m is None else ("backward" if "Backward" in m.group(1) else "forward")


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
    - ``fmha_forward`` / ``fmha_backward``: cuDNN fused attention calls (``__cudnn$fmha*``
      custom calls; ``...Backward``: the backward pass's).
    """
    entry, comps = parse(hlo)
    types = {i.name: i.shape for instrs in comps.values() for i in instrs}
    launched = [i for i, _ in kernels(entry, comps)]

    gemms: collections.Counter = collections.Counter()
    gemm_types: collections.Counter = collections.Counter()
    convs: collections.Counter = collections.Counter()
    f32_gemms = f32_in_stop = 0
    fmha: collections.Counter = collections.Counter()
    for ins in (i for instrs in comps.values() for i in instrs):
        if kind := fmha_call(ins):
            fmha[kind] += 1
        operands = " x ".join(dtype(types.get(x, "?")) for x in ins.args[:2])
        if ins.op == "dot" or (ins.op == "custom-call" and _GEMM_TARGET.search(ins.line)):
            gemms[operands] += 1
            gemm_types[f"{operands} -> {dtype(ins.shape)}"] += 1
            if operands == "f32 x f32":
                op_name = _OP_NAME.search(ins.line)
                in_stop = bool(op_name and _AMP_STOP in op_name.group(1).split("/"))
                f32_in_stop += in_stop
                f32_gemms += not in_stop
        elif ins.op == "convolution" or (ins.op == "custom-call" and _CONV_TARGET.search(ins.line)):
            convs[operands] += 1

    into = after = 0
    for c in launch_computations(entry, comps):
        i, o = _transposes_around_gemms(comps[c], comps)
        into, after = into + i, after + o
    return {
        "kernels": len(launched),
        "kernel_ops": dict(collections.Counter(i.op for i in launched)),
        "gemm_kernels": sum(1 for i in launched if is_gemm_call(i)),
        "gemms": dict(gemms),
        "gemm_types": dict(gemm_types),
        "fp8_gemms": sum(v for k, v in gemms.items() if "f8" in k),
        "f32_gemms": f32_gemms,
        "f32_gemms_in_amp_stop": f32_in_stop,
        "convolutions": dict(convs),
        "f32_convolutions": sum(v for k, v in convs.items() if "f32" in k),
        "transposes_into_gemms": into,
        "transposes_after_gemms": after,
        "fmha_forward": fmha["forward"],
        "fmha_backward": fmha["backward"],
    }


# ----------------------------------------------------------------------------- roofline


@dataclass(frozen=True)
class Chip:
    """Datasheet rates of a GPU: HBM bandwidth (bytes/s), dense tensor-core peaks (FLOP/s)
    by GEMM operand type, and a fixed cost per kernel launch (s)."""

    name: str
    hbm_bytes_per_s: float
    peak_flops: dict[str, float]
    launch_s: float

    def peak(self, a: str, b: str) -> float:
        """The dense peak of a GEMM with operand types ``a`` and ``b``: float8 (or int8) if
        either is 8-bit, bf16/f16 if both are 16-bit floats, float64, else float32's (TF32)."""
        if any(t.startswith("f8") or t in ("s8", "u8") for t in (a, b)):
            return self.peak_flops["f8"]
        if a in ("bf16", "f16") and b in ("bf16", "f16"):
            return self.peak_flops["bf16"]
        if "f64" in (a, b):
            return self.peak_flops["f64"]
        return self.peak_flops["f32"]


# H100 SXM5 (80 GB HBM3): 3.35 TB/s; dense tensor-core peaks without sparsity: 1979 TFLOP/s
# float8 (and int8), 989 bf16/f16, 495 TF32 (JAX's default float32 matmul precision on
# Hopper), 67 float64.
H100_SXM = Chip(
    name="H100 SXM",
    hbm_bytes_per_s=3.35e12,
    peak_flops={"f8": 1979e12, "bf16": 989e12, "f32": 495e12, "f64": 67e12},
    launch_s=2e-6,
)
# H200 SXM (141 GB HBM3e): the H100's tensor cores and clocks, 4.8 TB/s.
H200_SXM = Chip(name="H200 SXM", hbm_bytes_per_s=4.8e12, peak_flops=H100_SXM.peak_flops, launch_s=2e-6)


def chip_for(device_kind: str) -> Chip:
    """The rates to model a step on the device ``jax.devices()[0].device_kind`` names: an
    H200's where it says H200, else the H100 SXM's (the ``--target``)."""
    return H200_SXM if "H200" in device_kind.upper() else H100_SXM


class Kernel(NamedTuple):
    """One launched kernel's cost: ``name``, ``op``, HBM ``bytes`` (operands + result),
    GEMM ``flops``, ``gemm_s`` (its FLOPs at its peak), ``runs`` per step, and ``time_s``
    (one run: max(bytes / bandwidth, gemm_s) + launch)."""

    name: str
    op: str
    bytes: int
    flops: int
    gemm_s: float
    runs: int
    time_s: float


def scratch_free(ins: Instr) -> str:
    """A custom call's result without its trailing scratch buffers (the ``s8``/``u8``
    workspace of cuBLAS and cuDNN calls: memory they may use, not traffic)."""
    shape = ins.shape
    if ins.op == "custom-call" and shape.startswith("("):
        parts = arrays(shape)
        while len(parts) > 1 and parts[-1][0] in ("s8", "u8") and len(parts[-1][1]) == 1:
            parts.pop()
        return " ".join(f"{dt}[{','.join(map(str, dims))}]" for dt, dims in parts)
    return shape


def _dot_flops(ins: Instr, types: dict[str, str]) -> tuple[int, str, str]:
    """2 x |output| x K of a ``dot`` instruction, and its operand types."""
    lhs = arrays(types.get(ins.args[0], ""))
    k = math.prod(lhs[0][1][d] for d in _dims_attr(ins.line, "lhs_contracting_dims")) if lhs else 0
    out = math.prod(arrays(ins.shape)[0][1])
    return 2 * out * k, dtype(types.get(ins.args[0], "?")), dtype(types.get(ins.args[1], "?"))


def _gemm_call_flops(ins: Instr, types: dict[str, str]) -> tuple[int, str, str]:
    """2 x |output| x K of a cuBLAS custom call (K from its ``dot_dimension_numbers``)."""
    m = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', ins.line)
    contracting = [int(d) for d in json.loads(m.group(1))["lhs_contracting_dimensions"]] if m else []
    lhs = arrays(types.get(ins.args[0], ""))
    k = math.prod(lhs[0][1][d] for d in contracting) if lhs else 0
    out = math.prod(arrays(ins.shape)[0][1])
    return 2 * out * k, dtype(types.get(ins.args[0], "?")), dtype(types.get(ins.args[1], "?"))


def _conv_flops(ins: Instr, types: dict[str, str]) -> tuple[int, str, str]:
    """2 x |output| x (kernel window x input features per group): each output element
    takes |kernel| / output features multiply-adds (``dim_labels`` names the kernel's
    output-feature dimension ``o``)."""
    m = re.search(r"dim_labels=[^_\s]+_([^-\s]+)->", ins.line)
    rhs = arrays(types.get(ins.args[1], ""))
    if not m or not rhs:
        return 0, "?", "?"
    dims = rhs[0][1]
    o = dims[m.group(1).index("o")]
    out = math.prod(arrays(ins.shape)[0][1])
    return 2 * out * (math.prod(dims) // o), dtype(types.get(ins.args[0], "?")), rhs[0][0]


def fmha_flops(ins: Instr, types: dict[str, str]) -> tuple[int, str, str]:
    """The products of a cuDNN fused attention call over its ``[B, N, T, S]`` scores
    (``intermediate_tensor_shape`` in its backend config), with ``Hqk`` and ``Hv`` the last
    dimensions of q and v: forward ``Q K^T`` and ``P V``, 2 B N T S (Hqk + Hv); backward
    (``...Backward``: the scores recomputed, ``dV``, ``dP``, ``dQ``, ``dK``) 2 B N T S
    (3 Hqk + 2 Hv); counted over the scores a causal mask (top-left) or a sliding window
    keeps (a padding mask's lengths are not known from the program: all kept). Returns the
    FLOPs and q's and k's dtypes."""
    m = _FMHA_TARGET.search(ins.line)
    dims = re.search(r'"intermediate_tensor_shape":\s*\{[^{}]*?"dimensions":\s*\[([^\]]*)\]', ins.line)
    if not m or not dims or len(ins.args) < 3:
        return 0, "?", "?"
    q, v = arrays(types.get(ins.args[0], "")), arrays(types.get(ins.args[2], ""))
    if not q or not v:
        return 0, "?", "?"
    b, n, t, s = (int(d) for d in re.findall(r"\d+", dims.group(1)))
    hq, hv = q[0][1][-1], v[0][1][-1]
    mask = re.search(r'"mask_type":\s*"(\w+)"', ins.line)
    window = re.search(r'"sliding_window_length":\s*"?(\d+)', ins.line)
    w = int(window.group(1)) if window else 0
    per_row = [min(i + 1, s) for i in range(t)] if mask and "CAUSAL" in mask.group(1) else [s] * t
    if w > 0:
        per_row = [min(r, w) for r in per_row]
    pairs = b * n * sum(per_row)
    flops = 2 * pairs * ((3 * hq + 2 * hv) if "Backward" in m.group(1) else (hq + hv))
    return flops, q[0][0], dtype(types.get(ins.args[1], "?"))


def _work(ins: Instr, comps: dict[str, list[Instr]], types: dict[str, str], chip: Chip) -> tuple[int, float]:
    """GEMM FLOPs of a kernel and their time at the chip's peaks: a cuBLAS or cuDNN call's,
    or the dots and convolutions inside a fusion (nested fusions included)."""
    if ins.op == "custom-call":
        if _GEMM_TARGET.search(ins.line):
            flops, a, b = _gemm_call_flops(ins, types)
        elif _CONV_TARGET.search(ins.line):
            flops, a, b = _conv_flops(ins, types)
        elif _FMHA_TARGET.search(ins.line):
            flops, a, b = fmha_flops(ins, types)
        else:
            return 0, 0.0
        return flops, flops / chip.peak(a, b)
    if ins.op in ("dot", "convolution"):
        flops, a, b = (_dot_flops if ins.op == "dot" else _conv_flops)(ins, types)
        return flops, flops / chip.peak(a, b)
    total, seconds = 0, 0.0
    seen: set[str] = set()
    todo = _CALLS.findall(ins.line) if ins.op == "fusion" else []
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for i in comps.get(c, []):
            if i.op in ("dot", "convolution"):
                f, s = _work(i, comps, types, chip)
                total, seconds = total + f, seconds + s
            elif i.op == "fusion":
                todo += _CALLS.findall(i.line)
    return total, seconds


def kernel_costs(hlo: str, chip: Chip = H100_SXM) -> list[Kernel]:
    """The modeled cost of every kernel the step launches (see :func:`roofline`)."""
    entry, comps = parse(hlo)
    types = {i.name: i.shape for instrs in comps.values() for i in instrs}
    out = []
    for ins, runs in kernels(entry, comps):
        traffic = sum(nbytes(types.get(a, "")) for a in ins.args) + nbytes(scratch_free(ins))
        flops, gemm_s = _work(ins, comps, types, chip)
        t = max(traffic / chip.hbm_bytes_per_s, gemm_s) + chip.launch_s
        out.append(Kernel(ins.name, ins.op, traffic, flops, gemm_s, runs, t))
    return out


def roofline(hlo: str, chip: Chip = H100_SXM) -> dict[str, Any]:
    """The roofline model of one step: per launched kernel, HBM bytes = its operands' bytes +
    its result's bytes (a cuBLAS/cuDNN call's scratch buffer left out), GEMM FLOPs = 2 x
    |output| x K (K: the contracted size) for cuBLAS calls, the dots of (Triton GEMM)
    fusions and convolutions, and the products of cuDNN's fused attention
    (:func:`fmha_flops`), time = max(bytes / HBM bandwidth, FLOPs / peak for the GEMM's
    operand types) + the launch cost; a while body counts its known trip count times.

    Returns ``hbm_bytes``, ``gemm_flops``, ``kernels`` (launches per step),
    ``gemm_kernels`` (those with FLOPs), ``time_s`` = ``gemm_time_s`` + ``other_time_s``
    (the kernels with and without GEMM work), ``gemm_bytes`` / ``other_bytes`` and
    ``flop_bound_gemm_kernels`` (GEMM kernels whose FLOPs take longer than their bytes).
    """
    ks = kernel_costs(hlo, chip)
    gemm = [k for k in ks if k.flops]
    other = [k for k in ks if not k.flops]
    return {
        "chip": chip.name,
        "hbm_bytes": sum(k.bytes * k.runs for k in ks),
        "gemm_flops": sum(k.flops * k.runs for k in ks),
        "kernels": sum(k.runs for k in ks),
        "gemm_kernels": sum(k.runs for k in gemm),
        "time_s": sum(k.time_s * k.runs for k in ks),
        "gemm_time_s": sum(k.time_s * k.runs for k in gemm),
        "other_time_s": sum(k.time_s * k.runs for k in other),
        "gemm_bytes": sum(k.bytes * k.runs for k in gemm),
        "other_bytes": sum(k.bytes * k.runs for k in other),
        "flop_bound_gemm_kernels": sum(k.runs for k in gemm if k.gemm_s * chip.hbm_bytes_per_s > k.bytes),
    }
