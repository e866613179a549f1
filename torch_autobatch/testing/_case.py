"""The prepared samples of ``torch_autobatch.testing.check`` and how results are compared.

A :class:`_Case` is one sample of one op, ready for every check: its tensor
leaves, which are differentiated, the cotangents and tangents, the eager
references, the tolerances. The checks themselves are in ``testing/_derivatives.py``,
``testing/_batching.py`` and ``testing/_op.py``;
the public surface and the report in ``testing/__init__.py``.

NOTE [How check compares]
Every check runs on a *working sample*: the sample with its floating tensors
in float64 where the op accepts float64 (else as given, with looser
tolerances). Derivatives are compared through random projections with fixed
seeds: a cotangent ``u`` per floating output and a tangent ``v`` per floating
input, so a Jacobian never has to be built (reverse mode gives ``J^T u``,
forward mode ``J v``, finite differences ``(f(x + eps v) - f(x - eps v)) /
2 eps``). A rule off by any factor, or bypassed, changes these projections
for all but a measure-zero set of ``u`` and ``v``. "Eager" is the op called
directly with ``.backward()`` (``torch.autograd.grad``) or dual tensors
(``torch.autograd.forward_ad``): the reference each transform must reproduce.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

OK, FAIL, SKIPPED = "ok", "FAIL", "skipped"
DEFAULT_SHAPES: tuple[tuple[int, ...], ...] = ((3, 4), (2, 3))
_BATCH = 3  # examples per vmap check
_FD_FULL_MAX = 64  # a leaf with at most this many elements gets an element-wise finite-difference VJP


class Sample:
    """One call of the op: ``Sample(*args, **kwargs)``.

    ``check``'s ``samples`` may also hold plain tuples of positional
    arguments, ``(args_tuple, kwargs_dict)`` pairs, a lone tensor, or
    OpInfo ``SampleInput`` objects (``.input``, ``.args``, ``.kwargs``).

    Example::

        >>> Sample(torch.zeros(2), 2.0, keepdim=True)
        Sample(Tensor[2] float32, 2.0, keepdim=True)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    def __repr__(self) -> str:
        parts = [_describe(a) for a in self.args] + [f"{k}={_describe(v)}" for k, v in self.kwargs.items()]
        return f"Sample({', '.join(parts)})"


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}] {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    return repr(value)


def _as_sample(s: Any) -> Sample:
    if isinstance(s, Sample):
        sample = s
    elif hasattr(s, "input") and hasattr(s, "args") and hasattr(s, "kwargs"):  # an OpInfo SampleInput
        sample = Sample(s.input, *s.args, **s.kwargs)
    elif isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], (tuple, list)) and isinstance(s[1], dict):
        sample = Sample(*s[0], **s[1])  # (args, kwargs): no op argument is a dict
    elif isinstance(s, (tuple, list)):
        sample = Sample(*s)
    else:
        sample = Sample(s)
    detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t  # noqa: E731
    return Sample(*tree_map(detach, sample.args), **tree_map(detach, sample.kwargs))


# -------------------------------------------------------------- check outcomes
class _Skip(Exception):
    def __init__(self, why: str) -> None:
        super().__init__(why)
        self.why = why


class _Fail(Exception):
    def __init__(self, why: str, argument: Optional[str] = None, max_error: Optional[float] = None) -> None:
        super().__init__(why)
        self.why, self.argument, self.max_error = why, argument, max_error


def _first_line(e: BaseException) -> str:
    """``Type: first line`` of an exception (with the next line where the first only introduces it)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    msg = lines[0] if lines else ""
    if msg.endswith(":") and len(lines) > 1:  # dynamo's "backend=... raised:" then the error
        msg = lines[1]
    return f"{type(e).__name__}: {msg[:300]}"


# ---------------------------------------------------------------- the op
class _Op:
    """What check needs to know about an op: its rules, its schema, how to call it."""

    def __init__(self, op: Any, caller: Optional[Callable[..., Any]] = None) -> None:
        from torch._library import custom_ops

        #: what calls the op, where not the op itself: ``FunctionClass.apply`` of a class lifted in place
        self.caller = caller

        opdef = op
        if not isinstance(op, custom_ops.CustomOpDef):
            if isinstance(op, str):
                qualname = op
            elif isinstance(op, torch._ops.OpOverload):
                qualname = op._schema.name
            elif isinstance(op, torch._ops.OpOverloadPacket):
                qualname = op._qualified_op_name
            else:
                raise TypeError(
                    f"torch_autobatch.testing.check: expected an op made by torch_autobatch.custom_op "
                    f"(or upgraded with torch_autobatch.autobatch, or a torch.library.custom_op), its "
                    f"torch.ops.ns.name or 'ns::name'; got {type(op).__name__}."
                )
            opdef = custom_ops._maybe_get_opdef(qualname)
            if opdef is None:
                raise TypeError(
                    f"torch_autobatch.testing.check: {qualname} is not a custom op defined in Python "
                    f"(torch_autobatch.custom_op, autobatch() or torch.library.custom_op)."
                )
        self.op = opdef
        self.qualname: str = opdef._qualname
        self.overload: torch._ops.OpOverload = opdef._opoverload
        self.schema = self.overload._schema
        self.fn: Callable[..., Any] = opdef._init_fn
        extras = getattr(opdef, "_ab", None)
        self.ours = extras is not None
        self.has_backward = opdef._backward_fn is not None
        self.registered_jvp = extras is not None and extras.jvp_fn is not None
        self.vmap_rule = opdef._vmap_fn is not None
        self.mutable = self.schema.is_mutable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.caller or self.op)(*args, **kwargs)


# ---------------------------------------------------------------- samples
def _generated_samples(op: _Op, shapes: Sequence[tuple[int, ...]]) -> list[Sample]:
    """Samples from the schema (NOTE [Samples from the schema])."""
    # NOTE [Samples from the schema]
    # One sample per shape in ``shapes`` (default (3, 4) then (2, 3)), seed 0:
    # every Tensor argument a float64 standard normal of that shape, a
    # Tensor[] two of them, a Tensor? one in the first sample and its default
    # (None) in the others; non-tensor arguments take their schema default,
    # else float 1.5, int 1, bool False (True in the second sample), int[]
    # [0], float[] [1.5, -0.5], ScalarType float64, Device cpu. Arguments with a
    # default are passed (positional ones positionally, keyword-only ones by
    # keyword). A str or other argument without a default cannot be
    # generated: pass ``samples=``.
    g = torch.Generator().manual_seed(0)
    samples = []
    for k, shape in enumerate(shapes):
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for a in op.schema.arguments:
            value = _generated_value(op, a, shape, k, g)
            if a.kwarg_only:
                kwargs[a.name] = value
            else:
                args.append(value)
        samples.append(Sample(*args, **kwargs))
    return samples


def _generated_value(op: _Op, a: Any, shape: tuple[int, ...], k: int, g: torch.Generator) -> Any:
    t = a.type
    kind = t.kind()
    if kind == "OptionalType":
        inner = t.getElementType()
        if inner.kind() == "TensorType" and k == 0:
            return torch.randn(shape, generator=g, dtype=torch.float64)
        if a.has_default_value():
            return a.default_value
        t, kind = inner, inner.kind()
    if kind == "TensorType":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "ListType" and t.getElementType().kind() in ("TensorType", "OptionalType"):
        return [torch.randn(shape, generator=g, dtype=torch.float64) for _ in range(2)]
    if a.has_default_value():
        return a.default_value
    text = str(t)
    table: dict[str, Any] = {
        "float": 1.5,
        "int": 1,
        "SymInt": 1,
        "bool": k == 1,
        "number": 1.5,
        "Scalar": 1.5,
        "List[int]": [0],
        "int[]": [0],
        "SymInt[]": [0],
        "List[SymInt]": [0],
        "List[float]": [1.5, -0.5],
        "float[]": [1.5, -0.5],
        "ScalarType": torch.float64,
        "Device": torch.device("cpu"),
    }
    if text in table:
        return table[text]
    raise ValueError(
        f"torch_autobatch.testing.check({op.qualname}): cannot generate a value for argument "
        f"'{a.name}: {text}' from the schema (NOTE [Samples from the schema]); pass samples=[...]."
    )


def _fresh(op: _Op, value: Any) -> Any:
    """``value`` with its tensors cloned for an op that mutates its arguments (the samples stay as given)."""
    if not op.mutable:
        return value
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def _real(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return torch.view_as_real(t).double() if t.is_complex() else t.double()


def _float64(value: Any) -> Any:
    return tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, value)


def _floats(out: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _same_values(a: Any, b: Any) -> bool:
    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    if sa != sb:
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            if not (
                torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, rtol=0, atol=0, equal_nan=True))
            ):
                return False
        elif x != y:
            return False
    return True


class _Case:
    """One sample of one op, prepared: leaves, differentiable leaves, cotangents, tangents."""

    def __init__(self, op: _Op, index: int, given: Sample, atol: Optional[float], rtol: Optional[float]) -> None:
        self.op, self.index, self.given = op, index, given
        self.sample = given
        self.error: Optional[str] = None
        try:
            out = op(*_fresh(op, given.args), **_fresh(op, given.kwargs))
        except Exception as e:
            self.error = f"the op raised on this sample: {_first_line(e)}"
            return
        wide = Sample(*_float64(given.args), **_float64(given.kwargs))
        try:
            wide_out = op(*_fresh(op, wide.args), **_fresh(op, wide.kwargs))
            if all(t.dtype == torch.float64 for t in _floats(wide_out)):  # the op accepts float64
                self.sample, out = wide, wide_out
        except Exception:
            pass
        #: every floating input and output in float64: tight tolerances
        self.exact = all(t.dtype == torch.float64 for t in _floats((self.sample.args, self.sample.kwargs, out)))
        self.out = out
        self.leaves, self.spec = tree_flatten((self.sample.args, dict(self.sample.kwargs)))
        self.names = _leaf_names(op, self.sample)
        mutated = {a.name for a in op.schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        self.tensors = [i for i, t in enumerate(self.leaves) if isinstance(t, torch.Tensor)]
        self.diff = [
            i for i in self.tensors if self.leaves[i].is_floating_point() and self.names[i].split("[")[0] not in mutated
        ]
        self.float_outs = _floats(out)
        g = torch.Generator().manual_seed(1234 + index)
        self.u = [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in self.float_outs]
        self.v = [torch.randn(self.leaves[i].shape, generator=g, dtype=self.leaves[i].dtype) for i in self.diff]
        self.w = [torch.randn(self.leaves[i].shape, generator=g, dtype=self.leaves[i].dtype) for i in self.diff]
        # tolerances: paths of the same math (NOTE [How check compares])
        self.atol = atol if atol is not None else (1e-6 if self.exact else 1e-4)
        self.rtol = rtol if rtol is not None else (1e-5 if self.exact else 1e-3)
        # finite differences
        self.eps = 1e-6 if self.exact else 1e-3
        self.fd_atol = 1e-5 if self.exact else 1e-2
        self.fd_rtol = 1e-3 if self.exact else 1e-2
        try:
            again = op(*_fresh(op, self.sample.args), **_fresh(op, self.sample.kwargs))
            self.random = not _same_values(out, again)
        except Exception:
            self.random = False

    # ---- calling
    def call(self, leaves: Sequence[Any], fn: Optional[Callable[..., Any]] = None) -> Any:
        args, kwargs = tree_unflatten(list(leaves), self.spec)
        args, kwargs = _fresh(self.op, args), _fresh(self.op, kwargs)
        return (fn or self.op)(*args, **kwargs)

    def with_diff(self, primals: Sequence[torch.Tensor], base: Optional[Sequence[Any]] = None) -> list[Any]:
        leaves = list(self.leaves if base is None else base)
        for i, p in zip(self.diff, primals):
            leaves[i] = p
        return leaves

    def floats_of(self, primals: Sequence[torch.Tensor], fn: Optional[Callable[..., Any]] = None) -> tuple:
        return tuple(_floats(self.call(self.with_diff(primals), fn)))

    def primals(self) -> list[torch.Tensor]:
        return [self.leaves[i] for i in self.diff]

    def diff_names(self) -> list[str]:
        return [self.names[i] for i in self.diff]

    def loss(self, outs: Sequence[torch.Tensor]) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float64)
        for o, u in zip(outs, self.u):
            total = total + (o * u).sum()
        return total

    # ---- eager references
    def eager_vjp(
        self, fn: Optional[Callable[..., Any]] = None, primals: Optional[Sequence[torch.Tensor]] = None
    ) -> list[torch.Tensor]:
        ps = [p.detach().requires_grad_() for p in (primals if primals is not None else self.primals())]
        outs = self.floats_of(ps, fn)
        pairs = [(o, u) for o, u in zip(outs, self.u) if o.requires_grad]
        if not pairs:
            if fn is not None:
                raise _Skip("opaque forward: the function's outputs do not depend on its inputs through torch ops")
            return [torch.zeros_like(p) for p in ps]
        grads = torch.autograd.grad([o for o, _ in pairs], ps, [u for _, u in pairs], allow_unused=True)
        return [torch.zeros_like(p) if g is None else g for p, g in zip(ps, grads)]

    def eager_jvp(
        self,
        tangents: Sequence[Optional[torch.Tensor]],
        fn: Optional[Callable[..., Any]] = None,
        primals: Optional[Sequence[torch.Tensor]] = None,
    ) -> list[torch.Tensor]:
        import torch.autograd.forward_ad as fwAD

        ps = list(primals if primals is not None else self.primals())
        with fwAD.dual_level():
            duals = [p if t is None else fwAD.make_dual(p, t) for p, t in zip(ps, tangents)]
            outs = self.floats_of(duals, fn)
            result = []
            for o in outs:
                t = fwAD.unpack_dual(o).tangent
                result.append(torch.zeros_like(o) if t is None else t.clone())
        return result

    def numerical_jvp(self, j: int, direction: torch.Tensor, fn: Optional[Callable[..., Any]] = None) -> list:
        ps = self.primals()
        plus = list(ps)
        minus = list(ps)
        plus[j] = ps[j] + self.eps * direction
        minus[j] = ps[j] - self.eps * direction
        with torch.no_grad():
            hi, lo = self.floats_of(plus, fn), self.floats_of(minus, fn)
        return [(a - b) / (2 * self.eps) for a, b in zip(hi, lo)]

    def dot_u(self, ts: Sequence[torch.Tensor]) -> float:
        return float(sum((t.double() * u.double()).sum() for t, u in zip(ts, self.u)))

    def repro(self, check: str, given_samples: bool, shapes: Sequence[tuple[int, ...]]) -> str:
        # Cls.apply of a class lifted in place: check(Cls) calls it
        owner = getattr(self.op.caller, "__self__", None)
        op = f"'{self.op.qualname}'" if owner is None else owner.__qualname__
        if given_samples:
            return (
                f"torch_autobatch.testing.check({op}, samples=samples[{self.index}:{self.index + 1}], only=['{check}'])"
            )
        shape_arg = "" if tuple(shapes) == DEFAULT_SHAPES else f", shapes={list(shapes)}"
        return f"torch_autobatch.testing.check({op}{shape_arg}, only=['{check}'])  # sample {self.index}"


def _leaf_names(op: _Op, sample: Sample) -> list[str]:
    positional = [a.name for a in op.schema.arguments if not a.kwarg_only]
    names: list[str] = []
    for i, value in enumerate(sample.args):
        base = positional[i] if i < len(positional) else f"args[{i}]"
        names += _names_of(base, value)
    for k, value in sample.kwargs.items():
        names += _names_of(k, value)
    return names


def _names_of(base: str, value: Any) -> list[str]:
    leaves, _ = tree_flatten(value)
    if isinstance(value, (list, tuple)):
        return [f"{base}[{i}]" for i in range(len(leaves))]
    return [base] * len(leaves)


# ------------------------------------------------------------- comparing
def _compare(
    got: Sequence[Any], expected: Sequence[Any], names: Sequence[str], atol: float, rtol: float, what: str
) -> None:
    """Raises _Fail naming the first mismatching entry and the max error over all of them."""
    if len(got) != len(expected):
        raise _Fail(f"{what}: {len(got)} results, expected {len(expected)}")
    worst: Optional[tuple[float, str]] = None
    for g, e, name in zip(got, expected, names):
        if not isinstance(g, torch.Tensor) or not isinstance(e, torch.Tensor):
            if g != e:
                raise _Fail(f"{what}: {name} is {g!r}, expected {e!r}", argument=name)
            continue
        if g.shape != e.shape:
            raise _Fail(f"{what}: {name} has shape {list(g.shape)}, expected {list(e.shape)}", argument=name)
        if not (g.is_floating_point() or g.is_complex()):
            if not torch.equal(g, e):
                raise _Fail(f"{what}: {name} differs (integer values)", argument=name)
            continue
        g64, e64 = _real(g), _real(e)
        nan = torch.isnan(g64) != torch.isnan(e64)
        diff = (g64 - e64).abs().nan_to_num(0.0)
        if nan.any():
            raise _Fail(f"{what}: {name} has NaN where the reference has none (or back)", argument=name)
        bad = diff > atol + rtol * e64.abs().nan_to_num(0.0)
        if bad.any():
            err = float(diff.max())
            if worst is None or err > worst[0]:
                ratio = _ratio(g64, e64)
                worst = (err, f"{what}: {name} differs{ratio}")
    if worst is not None:
        err, why = worst
        name = why.split(": ", 1)[1].split(" differs")[0]
        raise _Fail(why, argument=name, max_error=err)


def _ratio(g: torch.Tensor, e: torch.Tensor) -> str:
    """' (about 2x the reference)' when got is a constant multiple of expected."""
    mask = e.abs() > 1e-3
    if not mask.any():
        return ""
    if not g.any():
        return " (all zeros: the rule was dropped?)"
    r = g[mask] / e[mask]
    if float(r.max() - r.min()) < 1e-3 * max(1.0, float(r.abs().max())) and abs(float(r.mean()) - 1) > 1e-3:
        return f" (about {float(r.mean()):.3g}x the reference)"
    return ""


def _compare_scalar(got: float, expected: float, name: str, atol: float, rtol: float, what: str) -> None:
    err = abs(got - expected)
    if not err <= atol + rtol * max(abs(got), abs(expected)):
        ratio = f" (about {got / expected:.3g}x)" if abs(expected) > 1e-8 else ""
        if got == 0 or expected == 0:
            ratio = " (one side is zero: a rule was dropped?)"
        raise _Fail(f"{what}: {got:.6g} vs {expected:.6g}{ratio}", argument=name, max_error=err)


# --------------------------------------------------------- skip conditions
def _need_diff(case: _Case) -> None:
    if not case.diff:
        raise _Skip("no floating-point tensor inputs to differentiate")
    if not case.float_outs:
        raise _Skip("integer outputs only: nothing to differentiate")


def _need_values(case: _Case) -> None:
    if case.random:
        raise _Skip("the op is random (two calls on the same inputs differ): its values cannot be compared")
    if case.op.mutable:
        raise _Skip("the op mutates its arguments: this check covers functional ops")


def _need_backward(case: _Case) -> None:
    _need_values(case)
    _need_diff(case)
    if not case.op.has_backward:
        raise _Skip("no backward registered (register_autograd / register_vjp)")


def _forward_mode(case: _Case) -> None:
    """Skips unless the op has forward mode (a registered jvp, or one derived from its function)."""
    _need_values(case)
    _need_diff(case)
    if case.op.registered_jvp:
        return
    try:
        case.eager_jvp(case.v)
    except Exception as e:
        raise _Skip(f"no jvp: none registered, and forward-mode AD of the function failed ({_first_line(e)})") from e


def _function_grads(case: _Case) -> list[torch.Tensor]:
    """The function's own autograd (not the op): skips if its forward is opaque."""
    try:
        return case.eager_vjp(fn=case.op.fn)
    except _Skip:
        raise
    except Exception as e:
        raise _Skip(f"opaque forward: the function is not differentiable by torch ({_first_line(e)})") from e


def _differentiable_backward(case: _Case) -> Callable[..., torch.Tensor]:
    """``h(x) = <J(x)^T u, w>`` computed with create_graph=True; skips if the backward is not differentiable."""

    def h(primals: Sequence[torch.Tensor], create_graph: bool = True) -> torch.Tensor:
        outs = case.floats_of(primals)
        pairs = [(o, u) for o, u in zip(outs, case.u) if o.requires_grad]
        if not pairs:
            return torch.zeros((), dtype=torch.float64)
        grads = torch.autograd.grad(
            [o for o, _ in pairs],
            list(primals),
            [u for _, u in pairs],
            allow_unused=True,
            create_graph=create_graph,
        )
        total = torch.zeros((), dtype=torch.float64)
        for g, w in zip(grads, case.w):
            if g is not None:
                total = total + (g * w).sum()
        return total

    ps = [p.detach().requires_grad_() for p in case.primals()]
    try:
        value = h(ps)
    except Exception as e:
        raise _Skip(f"the backward cannot run with create_graph=True ({_first_line(e)})") from e
    if not value.requires_grad:
        raise _Skip("the backward is not differentiable (its result does not depend on the inputs through autograd)")
    return h
