"""`autocast.explain`: what ran in which dtype, why, and what it costs (trace only)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat, _dtypes, _walk
from ._amp import _combine, _is_array, _partition, _transform
from ._explain_record import ExplainContext, Float8Matmul, Float32Matmul, Observer, Record, runs
from ._options import AmpKwargs, AmpOptions, takes_amp_options
from ._policy import AMP_STOP


def _add(d: dict[str, int], key: str, n: int) -> None:
    d[key] = d.get(key, 0) + int(n)


def _costs(closed: Any) -> tuple[dict[str, int], dict[str, int], int]:
    """(matmul FLOPs by operand dtype, intermediate bytes by dtype, float casts) of a jaxpr."""
    flops: dict[str, int] = {}
    inter: dict[str, int] = {}
    casts = 0
    for eqn, _, _, mult in _walk.walk(closed):
        name = eqn.primitive.name
        if name in _walk.MATMULS:
            _add(flops, str(eqn.invars[0].aval.dtype), mult * _walk.flops(eqn))
        for v in eqn.outvars:
            if _dtypes.is_castable(v.aval.dtype):
                _add(inter, str(v.aval.dtype), mult * _walk.nbytes(v.aval))
        if name == "convert_element_type":
            src, dst = eqn.invars[0].aval.dtype, eqn.outvars[0].aval.dtype
            if _dtypes.is_castable(src) and _dtypes.is_castable(dst) and src != dst:
                casts += 1
    return flops, inter, casts


def _custom_vjps(jaxpr: Any, scopes: tuple[str, ...]) -> int:
    """How many `custom_vjp` equations `jaxpr` holds at any depth, outside `amp_stop`."""
    open_, _ = _compat.open_and_consts(jaxpr)
    n = 0
    for eqn in open_.eqns:
        here = scopes + _compat.scope_names(eqn.source_info.name_stack)
        if AMP_STOP in here:
            continue
        n += _walk.kind(eqn) == "custom_vjp"
        n += sum(_custom_vjps(sub, here) for sub in _walk.bodies(eqn))
    return n


_SUMS = frozenset({"reduce_sum", "cumsum", "reduce_window_sum", "psum", "reduce_scatter", "scatter-add", "scatter-sub"})
_MOVES = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "slice", "copy"})


def _float16_sums(jaxpr: Any) -> list[str]:
    """The sums amp computes in float32 and then rounds to float16 for what reads them
    (`source: primitive` each): where float16's range (65,504) may be the limit."""
    found: list[str] = []
    open_, _ = _compat.open_and_consts(jaxpr)
    made = {v: e for e in open_.eqns for v in e.outvars}

    def sum_behind(v: Any) -> Any:
        while v in made and made[v].primitive.name in _MOVES:
            v = made[v].invars[0]
        e = made.get(v)
        return e if e is not None and e.primitive.name in _SUMS else None

    for eqn in open_.eqns:
        for sub in _walk.bodies(eqn):
            found += _float16_sums(sub)
        if eqn.primitive.name != "convert_element_type" or np.dtype(eqn.params["new_dtype"]) != np.float16:
            continue
        x = eqn.invars[0]
        if isinstance(x, _compat.Literal) or x.aval.dtype != np.float32:
            continue
        e = sum_behind(x)
        if e is not None:
            found.append(f"{_walk.source(e.source_info)}: {e.primitive.name}")
    return found


def _saved(fun: Callable, args: list[Any]) -> dict[str, int] | None:
    """Bytes of the residuals `jax.vjp` saves, by dtype, as
    `jax.ad_checkpoint.print_saved_residuals` lists them: only computed values, not the
    arguments, constants and literals (already in memory). None where JAX cannot
    differentiate `fun` (a forward-only construct such as `Scan3`)."""
    out: dict[str, int] = {}
    try:
        residuals = _compat.saved_residuals(fun, *args)
    except NotImplementedError:
        return None
    for aval, where in residuals:
        if where.startswith(("from the argument", "from a constant", "from a literal")):
            continue
        _add(out, str(aval.dtype), _walk.nbytes(aval))
    return out


BACKWARD = "jit(autocast_backward)"
"""How the backward pass explain and find_overflow trace shows in a nesting path
(`_walk.label`): one `jit` call holding every equation of it (transposes, `custom_vjp`
backward rules, recomputations), whatever their name stacks say."""


def gradients(fun: Callable, args: list[Any], idx: list[int], cotangents: Callable[[Any], Any]) -> tuple[Any, Any]:
    """`(fun(*args), gradients)`: the gradients with respect to `args[i]` for `i` in
    `idx`, from `cotangents(outputs)`, traced as the call `BACKWARD`."""

    def of_idx(*floats: Any) -> Any:
        full = list(args)
        for i, f in zip(idx, floats):
            full[i] = f
        return fun(*full)

    out, vjp = jax.vjp(of_idx, *(args[i] for i in idx))

    def autocast_backward(cts: Any) -> Any:
        return vjp(cts)

    return out, jax.jit(autocast_backward)(cotangents(out))


def _backward_matmuls(fun: Callable, args: list[Any]) -> dict[str, int] | None:
    """Bytes the matmuls and convolutions of `fun`'s backward pass write, by result
    dtype: the weight gradients (float32 under `weight_grad_dtype="float32"`), the
    activation gradients, matmuls a `custom_vjp` backward rule or a recomputation runs.
    `fun` is differentiated with respect to its floating arguments, from a cotangent of
    ones for each floating output; None where JAX cannot transpose it (a forward-only
    construct such as `Scan3`, a `while_loop`)."""
    idx = [i for i, x in enumerate(args) if _dtypes.is_floating(_dtypes.dtype_of(x))]

    def floats_out(*a: Any) -> list[Any]:
        return [y for y in fun(*a) if _dtypes.is_floating(_dtypes.dtype_of(y))]

    def backward(*dyn: Any) -> Any:
        return gradients(floats_out, list(dyn), idx, lambda outs: [jnp.ones_like(y) for y in outs])[1]

    try:
        closed = jax.make_jaxpr(backward)(*args)
    except (NotImplementedError, ValueError, TypeError):  # no transpose: Scan3, while_loop, ...
        return None
    out: dict[str, int] = {}
    for eqn, _, path, mult in _walk.walk(closed):
        if BACKWARD in path and eqn.primitive.name in _walk.MATMULS:
            for v in eqn.outvars:
                _add(out, str(v.aval.dtype), mult * _walk.nbytes(v.aval))
    return out


def _as_dict(m: Any) -> dict[str, Any]:
    """A matmul dataclass as JSON: its tuples as lists."""
    return {
        **dataclasses.asdict(m),
        "shape": [list(s) for s in m.shape],
        "scopes": list(m.scopes),
        "path": list(m.path),
    }


class Explanation:
    """What `amp` does to a function: made by `autocast.explain`.

    `print(explanation)` shows a table (`rich` when installed); `to_dict` and
    `to_markdown` export it.

    Attributes:
        compute_dtype: The compute dtype's name (`"float16"`, `"bfloat16"` or `"float32"`).
        rows: One dict per group of equations (same scope, nesting, primitive, dtypes, rule
            and reason): `scope`, `nesting`, `primitive`, `count`, `operands` (their dtypes
            before → after the rule), `result`, `rule`, `why`.
        totals: A dict: `matmul_flops`, `intermediate_bytes`, `saved_bytes` (for the
            backward pass) and `backward_matmul_bytes` (what the backward pass's matmuls
            write), each `{"amp": ..., "float32": ...}` by dtype (the last two None where
            JAX cannot differentiate the function); `casts_inserted`; `float32_islands`
            and `islands_recomputed`; `custom_vjp_bwd` (`count`, `mode`); `float16_sums`;
            `attention` (each attention found: `attention`, `kernel`); `loss_head` (each
            loss head found: `loss_head`, `how`). See `autocast.explain`.
        float32_matmuls: Every matmul / convolution (any depth) whose operands are not in
            the compute dtype (float8 matmuls excepted), with its `primitive`, `shape`,
            `dtype`, `reason`, `scopes`, `path` and `source` line.
        float8_matmuls: Every matmul that runs as a scaled float8 product: its `shape`,
            `count` (loop trips multiplied in), `bytes_saved` (residual bytes), `scopes`,
            `path`, `source` and `reason`.
        float8_declined: Every matmul a float8 rule was given and left in the compute
            dtype, with its `reason`.

    Example:
        ```python
        report = autocast.explain(loss_fn)(params, batch)
        assert isinstance(report, autocast.Explanation) and not report.float32_matmuls
        table = report.to_markdown()
        ```
    """

    def __init__(self, compute_dtype: str, records: list[Record], totals: dict[str, Any]):
        self.compute_dtype = compute_dtype
        self._records = records
        self.totals = totals
        groups: dict[tuple, dict[str, Any]] = {}
        for r in records:
            where = "/".join(r.scopes) or "(top)"
            nest = " > ".join(r.path)
            key = (where, nest, r.primitive, r.before, r.after, r.result, r.rule, r.why)
            row = groups.get(key)
            if row is None:
                row = groups[key] = dict(
                    scope=where,
                    nesting=nest,
                    primitive=r.primitive,
                    count=0,
                    operands=f"{runs(r.before)} → {runs(r.after)}",
                    result=runs(r.result),
                    rule=r.rule,
                    why=r.why,
                )
            row["count"] += r.mult
        self.rows: list[dict[str, Any]] = list(groups.values())
        half = np.dtype(compute_dtype)
        self.float32_matmuls: list[Float32Matmul] = [
            Float32Matmul(r.primitive, r.shapes, runs(r.after), r.why, r.scopes, r.path, r.source)
            for r in records
            if r.primitive in _walk.MATMULS and r.after and r.after[0] != _walk.dtype_name(half) and not r.float8
        ]
        self.float8_matmuls: list[Float8Matmul] = [
            Float8Matmul(
                r.shapes,
                r.mult,
                r.mult
                * sum(int(np.prod(s, dtype=np.int64)) for s, kept in zip(r.shapes, r.float8_kept) if kept)
                * (half.itemsize - 1),
                r.scopes,
                r.path,
                r.source,
                r.float8_why,
            )
            for r in records
            if r.float8
        ]
        self.float8_declined: list[Float8Matmul] = [
            Float8Matmul(r.shapes, r.mult, 0, r.scopes, r.path, r.source, r.float8_why)
            for r in records
            if r.float8_why and not r.float8
        ]

    # --- output ------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict: `compute_dtype`, `rows`, `totals`, `float8_matmuls`,
        `float8_declined`, `float32_matmuls`."""
        return {
            "compute_dtype": self.compute_dtype,
            "rows": [dict(r) for r in self.rows],
            "totals": self.totals,
            "float8_matmuls": [_as_dict(m) for m in self.float8_matmuls],
            "float8_declined": [_as_dict(m) for m in self.float8_declined],
            "float32_matmuls": [_as_dict(m) for m in self.float32_matmuls],
        }

    _COLUMNS = ("scope", "nesting", "primitive", "count", "operands", "result", "rule", "why")

    def _cells(self) -> list[list[str]]:
        return [[str(row[c]) for c in self._COLUMNS] for row in self.rows]

    def _total_lines(self) -> list[tuple[str, str, str]]:
        t = self.totals
        out = []
        for key, title, fmt in (
            ("matmul_flops", "matmul/conv FLOPs", _fmt_flops),
            ("intermediate_bytes", "intermediate values", _fmt_bytes),
            ("saved_bytes", "saved for backward", _fmt_bytes),
            ("backward_matmul_bytes", "backward matmul results", _fmt_bytes),
        ):
            amp, orig = t[key]["amp"], t[key]["float32"]
            out.append((title, _by_dtype(amp, fmt), _by_dtype(orig, fmt)))
        return out

    def _summary(self) -> str:
        t = self.totals
        lines = [
            f"casts inserted: {t['casts_inserted']}; float32 islands: {t['float32_islands']} "
            f"({t['islands_recomputed']} recomputed in the backward pass)",
        ]
        if self.float32_matmuls:
            lines.append(f"matmuls not in {self.compute_dtype}: {len(self.float32_matmuls)}")
            for m in self.float32_matmuls:
                lines.append(f"  {m.primitive} {' x '.join(map(str, m.shape))} {m.dtype} at {m.source} ({m.reason})")
        else:
            lines.append(f"matmuls not in {self.compute_dtype}: none")
        vjp = t.get("custom_vjp_bwd", {})
        if vjp.get("count"):
            how = (
                f"under this policy (custom_vjp_bwd='amp': matmuls in {self.compute_dtype}, reductions in float32)"
                if vjp["mode"] == "amp"
                else "as written, on residuals and cotangents as they arrive (custom_vjp_bwd='original')"
            )
            lines.append(f"custom_vjp backward rules: {vjp['count']}, run {how}")
        for att in t.get("attention") or []:
            lines.append(f"{att['attention']}: {att['kernel']}")
        for head in t.get("loss_head") or []:
            lines.append(f"{head['loss_head']}: {head['how']}")
        sums = t.get("float16_sums") or []
        if sums:
            lines.append(
                f"float16 range: {len(sums)} sum(s) computed in float32 are rounded to float16 for what reads them; "
                "a sum beyond 65,504 becomes inf there (find_overflow names it; compute_dtype=jnp.bfloat16 has "
                "float32's range)"
            )
            lines += [f"  {x}" for x in sums]
        if self.float8_matmuls:
            saved = sum(m.bytes_saved for m in self.float8_matmuls)
            lines.append(
                f"matmuls in float8: {sum(m.count for m in self.float8_matmuls)} "
                f"(residuals {_fmt_bytes(saved)} smaller than in {self.compute_dtype})"
            )
            for f8 in self.float8_matmuls:
                times = f" x{f8.count}" if f8.count > 1 else ""
                lines.append(f"  dot_general {' x '.join(map(str, f8.shape))}{times} at {f8.source}: {f8.reason}")
        if self.float8_declined:
            lines.append(
                f"matmuls the float8 rule left in {self.compute_dtype}: {sum(m.count for m in self.float8_declined)}"
            )
            for f8 in self.float8_declined:
                times = f" x{f8.count}" if f8.count > 1 else ""
                lines.append(f"  dot_general {' x '.join(map(str, f8.shape))}{times} at {f8.source}: {f8.reason}")
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """The table, the totals and the float32 matmuls as GitHub markdown."""
        head = "| " + " | ".join(self._COLUMNS) + " |\n|" + "---|" * len(self._COLUMNS) + "\n"
        body = "".join("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |\n" for cells in self._cells())
        totals = f"\n| total | amp ({self.compute_dtype}) | float32 original |\n|---|---|---|\n"
        totals += "".join(f"| {a} | {b} | {c} |\n" for a, b, c in self._total_lines())
        return head + body + totals + "\n" + self._summary().replace("\n  ", "\n- ") + "\n"

    def __str__(self) -> str:
        try:
            return self._rich()
        except ImportError:
            return self._plain()

    def __repr__(self) -> str:
        return f"Explanation({len(self.rows)} rows, {len(self.float32_matmuls)} float32 matmuls)"

    def _plain(self) -> str:
        rows = [list(self._COLUMNS), *self._cells()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._COLUMNS))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        tl = [("total", f"amp ({self.compute_dtype})", "float32 original"), *self._total_lines()]
        tw = [max(len(r[i]) for r in tl) for i in range(3)]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, tw)).rstrip() for r in tl]
        return "\n".join(lines) + "\n" + self._summary()

    def _rich(self) -> str:
        import io

        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"autocast.explain (compute dtype {self.compute_dtype})")
        for c in self._COLUMNS:
            table.add_column(c, justify="right" if c == "count" else "left")
        for cells in self._cells():
            table.add_row(*cells)
        totals = Table(title="totals")
        for c in ("total", f"amp ({self.compute_dtype})", "float32 original"):
            totals.add_column(c)
        for row in self._total_lines():
            totals.add_row(*row)
        width = sum(max(len(c) for c in col) + 3 for col in zip(*([list(self._COLUMNS)] + self._cells()))) + 4
        buf = io.StringIO()
        console = Console(file=buf, width=max(width, 100), color_system=None, force_terminal=False)
        console.print(table)
        console.print(totals)
        console.print(self._summary(), highlight=False, markup=False)
        return buf.getvalue().rstrip("\n")


def _fmt_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _fmt_flops(n: int) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} FLOP"


def _by_dtype(d: dict[str, int] | None, fmt: Callable[[int], str]) -> str:
    if d is None:
        return "n/a"
    if not d:
        return "0"
    return ", ".join(f"{_walk.dtype_name(k)} {fmt(v)}" for k, v in sorted(d.items()))


def _flat(fn: Callable, args: tuple, kwargs: dict) -> tuple[Callable, list[Any]]:
    """`fn` as a function of its arguments' array leaves (other leaves are static); a
    `jax.ShapeDtypeStruct` leaf stands for an array (`eqx.filter_eval_shape`'s output:
    a model explained from its shapes, never made)."""
    treedef, mask, dynamic, static = _partition(
        (args, kwargs), lambda x: _is_array(x) or isinstance(x, jax.ShapeDtypeStruct)
    )

    def flat_fn(*dyn):
        a, kw = _combine(treedef, mask, dyn, static)
        return [x for x in jax.tree_util.tree_leaves(fn(*a, **kw)) if _is_array(x)]

    return flat_fn, dynamic


def _check_fn(name: str, fn: Any) -> None:
    if not callable(fn):
        raise TypeError(
            f"{name}(fn={fn!r}): fn must be callable (a function, an Equinox module, ...), got {type(fn).__name__}."
        )


@takes_amp_options
def explain(fn: Callable, **options: Unpack[AmpKwargs]) -> Callable[..., Explanation]:
    """Show what `autocast.amp` does to `fn`: which rule each operation gets and why, the
    dtypes it runs in, and what that costs, without running anything (trace only).

    `explain` takes `fn` and every option of `autocast.amp`, with the same defaults: the
    report is of the program `amp(fn, **options)` makes.

    Args:
        fn: The function, as `autocast.amp` takes it.
        compute_dtype: `float16` (default), `bfloat16` or `float32` (a dtype or a string
            such as `"bf16"`).
        amp_policy: A mapping from primitives or `jax.named_scope` names to rules;
            default `autocast.default_amp_policy`.
        remat_float32: Which float32 islands are recomputed in the backward pass: `"auto"`
            (default), `True` (every island), `"matmuls"` (every island, with the matmuls
            between them) or `False` (none); the totals count them, and
            the bytes saved for the backward pass change with it.
        weight_grad_dtype: The dtype the matmuls computing weight gradients write:
            `"float32"` (default) or `"compute"` (see `totals["backward_matmul_bytes"]`).
        custom_vjp_bwd: How the backward rules of `jax.custom_vjp` functions run: `"amp"`
            (default, under the policy) or `"original"` (as written); the totals say how
            many there are and how they run.
        attention: `"auto"` (default: attention amp proves equal to one fused call runs as
            cuDNN's kernel on a CUDA GPU) or `"xla"` (never fused); `totals["attention"]`
            lists each attention found, with what amp does with it and why.
        loss_head: `"auto"` (default), `"xla"` or a number of chunks (see `autocast.amp`);
            `totals["loss_head"]` lists each loss head found, with its chunks or why it
            runs as written.

    Returns:
        A function that takes `fn`'s arguments (arrays, or `jax.ShapeDtypeStruct` leaves:
            a model explained from its shapes) and returns an `Explanation`: `print` it for
            a table grouped by named scope and primitive (count, operand dtypes before →
            after the rule, result dtype, rule, why), read `.totals` (by dtype, beside the
            float32 original's: matmul FLOPs, intermediate bytes, bytes saved for the
            backward pass and bytes the backward pass's matmuls write, the weight gradients
            among them, the last two None where JAX cannot differentiate `fn`; casts
            inserted; float32 islands and how many are recomputed; `custom_vjp_bwd`: how
            many `custom_vjp` backward rules the program holds and how they run;
            `float16_sums`: with float16, the sums computed in float32 and rounded to
            float16 for what reads them; `attention`: each attention found, what it is
            and its kernel, or why it runs as written; `loss_head`: each loss head found,
            chunked or why not) and `.float32_matmuls` (each matmul/convolution
            not in the compute dtype, with its source line), or export `.to_dict()` /
            `.to_markdown()`.

    Raises:
        TypeError: `fn` is not callable, a keyword is not an option of `autocast.amp`, or
            `amp_policy` is not a mapping from primitives or scope names to rules.
        ValueError: An option has a value `autocast.amp` does not allow.

    Example:
        ```python
        report = autocast.explain(loss_fn)(params, batch)
        print(report)
        assert not report.float32_matmuls
        ```
    """
    _check_fn("explain", fn)
    opts = AmpOptions.from_kwargs("explain", options)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Explanation:
        flat_fn, dynamic = _flat(fn, args, kwargs)
        closed = jax.make_jaxpr(flat_fn)(*dynamic)
        ctx = opts.context(ExplainContext)
        observer = Observer(ctx)
        ctx.observer = observer
        scopes = _compat.scope_names(_compat.current_name_stack())
        transformed = _transform(closed, scopes, ctx)
        observer.active = False  # custom rules traced later (by jax.vjp below) are not the program
        flops_amp, inter_amp, casts_amp = _costs(transformed)
        flops_32, inter_32, casts_32 = _costs(closed)
        islands = {id(r.island[0]): r.island[1] for r in observer.records if r.island is not None}
        totals = {
            "matmul_flops": {"amp": flops_amp, "float32": flops_32},
            "intermediate_bytes": {"amp": inter_amp, "float32": inter_32},
            "saved_bytes": {
                "amp": _saved(_compat.jaxpr_as_fun(transformed), dynamic),
                "float32": _saved(_compat.jaxpr_as_fun(closed), dynamic),
            },
            "backward_matmul_bytes": {
                "amp": _backward_matmuls(_compat.jaxpr_as_fun(transformed), dynamic),
                "float32": _backward_matmuls(_compat.jaxpr_as_fun(closed), dynamic),
            },
            "casts_inserted": max(0, casts_amp - casts_32),
            "float32_islands": len(islands),
            "islands_recomputed": sum(islands.values()),
            "custom_vjp_bwd": {
                "count": _custom_vjps(closed, scopes),
                "mode": opts.custom_vjp_bwd,
            },
            "float16_sums": sorted(set(_float16_sums(transformed))) if opts.dtype == np.float16 else [],
            "attention": [
                {"attention": a, "kernel": k} for a, k in dict.fromkeys(observer.rewrites.get("attention", []))
            ],
            "loss_head": [{"loss_head": a, "how": k} for a, k in dict.fromkeys(observer.rewrites.get("loss_head", []))],
        }
        return Explanation(opts.dtype.name, observer.records, totals)

    return run
