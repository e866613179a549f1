"""``torch_autobatch.testing.check``: ``torch.library.opcheck`` for every transform.

For the people who own ops: one call in a library's CI checks that an op's
registered rules (backward, jvp, vmap rule, fake kernel) are right, agree
with each other and with the function, and are honoured by every transform
and by ``torch.compile``::

    from torch_autobatch.testing import check

    check(my_op, samples=[(torch.randn(8, 16), 2.0)])      # raises AssertionError with the report
    report = check(my_op, raise_on_failure=False)          # samples generated from the schema
    print(report)                                          # a table: check x sample -> ok / FAIL / skipped

What each check compares, and which run by default (``exhaustive=False``),
is listed in :data:`CHECKS` and in docs/api.md. Nothing here is imported by
``import torch_autobatch``; torch._dynamo and friends are imported inside the
checks that need them (NOTE [Lazy heavy imports] in ``__init__.py``).
The checks live in ``testing/_derivatives.py``, ``testing/_batching.py`` and
``testing/_op.py``, the prepared samples and the
comparisons (NOTE [How check compares]) in ``testing/_case.py``.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten

from ._batching import _check_grad_vmap, _check_second_thread, _check_vmap, _check_vmap_grad, _check_vmap_jvp
from ._case import (
    DEFAULT_SHAPES,
    FAIL,
    OK,
    SKIPPED,
    Sample,
    _as_sample,
    _Case,
    _Fail,
    _first_line,
    _generated_samples,
    _Op,
    _Skip,
)
from ._derivatives import (
    _check_backward_fd,
    _check_backward_function,
    _check_double_backward,
    _check_grad,
    _check_hessian,
    _check_jacfwd,
    _check_jacrev,
    _check_jvp,
    _check_jvp_backward,
    _check_jvp_fd,
    _check_jvp_function,
    _check_opcheck,
    _check_vjp,
)
from ._op import (
    _check_compile_aot_eager,
    _check_compile_eager,
    _check_compile_grad,
    _check_compile_inductor,
    _check_export,
    _check_make_fx,
    _check_op_identity,
    _check_saved_tensors_freed,
)

__all__ = ["CHECKS", "CheckReport", "CheckResult", "Sample", "check"]

Sample.__module__ = __name__  # public here (and its docstring example is found here)


# ----------------------------------------------------------------- the report
@dataclasses.dataclass
class CheckResult:
    """One cell of the report: a check on a sample."""

    check: str
    sample: int
    status: str  # "ok", "FAIL" or "skipped"
    why: str = ""
    argument: Optional[str] = None
    max_error: Optional[float] = None
    repro: str = ""
    seconds: float = 0.0

    def __str__(self) -> str:
        if self.status == OK:
            return OK
        return f"{self.status} ({self.why})"


class CheckReport:
    """What :func:`check` found: a table of check x sample -> ok / FAIL (why) / skipped (why).

    ``report.ok`` is True when nothing failed; ``report.failures`` lists the
    failed :class:`CheckResult` s; ``report[check, sample]`` is one cell and
    ``report.status(check)`` the check's worst status over the samples
    (``"FAIL"`` if any failed, else ``"ok"`` if any passed, else ``"skipped"``).
    ``str(report)`` is the readable table, then each failure with its
    argument, max error and the command that reproduces it.

    Example (a backward off by 2x)::

        >>> from torch_autobatch.testing import check
        >>> @torch_autobatch.custom_op("doc_check::softclip", mutates_args=())
        ... def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
        ...     return scale * torch.tanh(x / scale)
        >>> def setup_context(ctx, inputs, output):
        ...     ctx.save_for_backward(inputs[0])
        ...     ctx.scale = inputs[1]
        >>> def backward(ctx, grad):
        ...     (x,) = ctx.saved_tensors
        ...     return 2 * grad * (1 - torch.tanh(x / ctx.scale) ** 2), None  # a bug: 2x
        >>> _ = softclip.register_autograd(backward, setup_context=setup_context)
        >>> report = check(softclip, [(torch.randn(5), 2.0)], raise_on_failure=False,
        ...                only=["backward_vs_finite_differences", "vmap"])
        >>> print(report)  # doctest: +ELLIPSIS
        torch_autobatch.testing.check(doc_check::softclip): 1 FAIL, 1 ok, 0 skipped (...)
        samples:
          0: Sample(Tensor[5] float32, 2.0)  (checked in float64)
        <BLANKLINE>
        check                           sample 0
        ----------------------------------------
        backward_vs_finite_differences  FAIL
        vmap                            ok
        <BLANKLINE>
        failures:
        - backward_vs_finite_differences, sample 0 argument x, max error ...: backward vs finite differences (gradient): x differs (about 2x the reference)
          reproduce: torch_autobatch.testing.check('doc_check::softclip', samples=samples[0:1], only=['backward_vs_finite_differences'])
    """

    def __init__(self, op: str, samples: list[str], results: list[CheckResult], seconds: float) -> None:
        self.op = op
        self.samples = samples
        self.results = results
        self.seconds = seconds

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failures(self) -> list[CheckResult]:
        return [r for r in self.results if r.status == FAIL]

    @property
    def checks(self) -> list[str]:
        return list(dict.fromkeys(r.check for r in self.results))

    def __getitem__(self, key: tuple[str, int]) -> CheckResult:
        for r in self.results:
            if (r.check, r.sample) == key:
                return r
        raise KeyError(key)

    def status(self, check: str) -> str:
        statuses = {r.status for r in self.results if r.check == check}
        if not statuses:
            raise KeyError(f"no check named {check!r} ran; ran: {self.checks}")
        return FAIL if FAIL in statuses else OK if OK in statuses else SKIPPED

    def __repr__(self) -> str:
        return f"<CheckReport {self.op}: {len(self.failures)} failed of {len(self.results)}>"

    def __str__(self) -> str:
        n_ok = sum(r.status == OK for r in self.results)
        n_skip = sum(r.status == SKIPPED for r in self.results)
        lines = [
            f"torch_autobatch.testing.check({self.op}): {len(self.failures)} FAIL, {n_ok} ok, "
            f"{n_skip} skipped ({self.seconds:.1f} s)",
            "samples:",
            *(f"  {i}: {d}" for i, d in enumerate(self.samples)),
            "",
        ]
        width = max([len(c) for c in self.checks] + [5])
        header = f"{'check':<{width}}  " + "  ".join(f"{'sample ' + str(i):<9}" for i in range(len(self.samples)))
        header = header.rstrip()
        lines += [header, "-" * len(header)]
        cells = {(r.check, r.sample): r for r in self.results}
        for c in self.checks:
            row = []
            for i in range(len(self.samples)):
                r = cells.get((c, i))
                row.append(f"{'-' if r is None else r.status:<9}")
            lines.append((f"{c:<{width}}  " + "  ".join(row)).rstrip())
        if self.failures:
            lines += ["", "failures:"]
            for r in self.failures:
                where = f" argument {r.argument}" if r.argument else ""
                err = f", max error {r.max_error:.3g}" if r.max_error is not None else ""
                lines.append(f"- {r.check}, sample {r.sample}{where}{err}: {r.why}")
                lines.append(f"  reproduce: {r.repro}")
        skipped: dict[tuple[str, str], list[int]] = {}
        for r in self.results:
            if r.status == SKIPPED:
                skipped.setdefault((r.check, r.why), []).append(r.sample)
        if skipped:
            lines += ["", "skipped:"]
            for (c, why), idx in skipped.items():
                lines.append(f"- {c} (samples {', '.join(map(str, idx))}): {why}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _CheckDef:
    fn: Callable[[_Case, bool], None]
    exhaustive: bool
    doc: str


#: Every check, in the order it runs: name -> (exhaustive only?, what it compares).
_CHECK_DEFS: dict[str, _CheckDef] = {
    "opcheck": _CheckDef(
        _check_opcheck,
        False,
        "torch.library.opcheck (its default test_utils: schema, autograd registration, fake kernel, AOT "
        "dispatch with dynamic shapes) on the sample as given, and with inputs that require grad",
    ),
    "backward_vs_finite_differences": _CheckDef(
        _check_backward_fd, False, "the registered backward against central finite differences (float64)"
    ),
    "backward_vs_function": _CheckDef(
        _check_backward_function, False, "the registered backward against autograd of the op's own function"
    ),
    "jvp_vs_finite_differences": _CheckDef(_check_jvp_fd, False, "forward mode against finite differences"),
    "jvp_vs_function": _CheckDef(
        _check_jvp_function, False, "a registered jvp against forward-mode AD of the op's own function"
    ),
    "jvp_vs_backward": _CheckDef(_check_jvp_backward, False, "<J v, u> (forward mode) == <v, J^T u> (the backward)"),
    "double_backward": _CheckDef(
        _check_double_backward, False, "the backward's own derivative (create_graph=True) against finite differences"
    ),
    "vmap": _CheckDef(
        _check_vmap,
        False,
        "vmap (the vmap rule or the free one) against a per-example loop: all batched at dim 0, at the last "
        "dim, each argument batched alone",
    ),
    "grad": _CheckDef(_check_grad, False, "torch.func.grad against eager .backward()"),
    "vjp": _CheckDef(_check_vjp, False, "torch.func.vjp against eager .backward()"),
    "jvp": _CheckDef(_check_jvp, False, "torch.func.jvp against eager dual tensors"),
    "jacrev": _CheckDef(_check_jacrev, False, "torch.func.jacrev against eager .backward()"),
    "jacfwd": _CheckDef(_check_jacfwd, False, "torch.func.jacfwd against eager dual tensors"),
    "vmap_grad": _CheckDef(_check_vmap_grad, False, "vmap(grad) against a loop of eager .backward()"),
    "grad_vmap": _CheckDef(_check_grad_vmap, False, "grad(vmap) against a loop of eager .backward()"),
    "compile_aot_eager": _CheckDef(
        _check_compile_aot_eager, False, "torch.compile(backend='aot_eager', fullgraph=True) forward and backward"
    ),
    "compile_grad": _CheckDef(
        _check_compile_grad,
        False,
        "torch.compile(torch.func.grad(loss), backend='aot_eager', fullgraph=True) against eager .backward()",
    ),
    "op_identity": _CheckDef(_check_op_identity, False, "torch.ops.ns.name is the op and gives its values"),
    "make_fx": _CheckDef(_check_make_fx, False, "make_fx keeps the op as one node"),
    "saved_tensors_freed": _CheckDef(
        _check_saved_tensors_freed, False, "inputs and outputs freed by reference counting (no cycle, no leak)"
    ),
    "hessian": _CheckDef(_check_hessian, True, "torch.func.hessian against eager double backward"),
    "vmap_jvp": _CheckDef(_check_vmap_jvp, True, "vmap(jvp) against a loop of eager dual tensors"),
    "compile_eager": _CheckDef(_check_compile_eager, True, "torch.compile(backend='eager') forward and backward"),
    "compile_inductor": _CheckDef(_check_compile_inductor, True, "torch.compile (Inductor) forward and backward"),
    "export": _CheckDef(_check_export, True, "torch.export keeps the op as one node; the program gives eager's values"),
    "second_thread": _CheckDef(
        _check_second_thread, True, "forward, backward and vmap on a second thread give the main thread's answers"
    ),
}


#: name -> (exhaustive only, what it checks), in the order the checks run.
CHECKS: dict[str, tuple[bool, str]] = {name: (d.exhaustive, d.doc) for name, d in _CHECK_DEFS.items()}


def check(
    op: Any,
    samples: Optional[Iterable[Any]] = None,
    *,
    raise_on_failure: bool = True,
    exhaustive: bool = False,
    only: Optional[Sequence[str]] = None,
    skip: Sequence[str] = (),
    shapes: Sequence[tuple[int, ...]] = DEFAULT_SHAPES,
    atol: Optional[float] = None,
    rtol: Optional[float] = None,
) -> CheckReport:
    """Checks an op's rules against each other, the function, finite differences and every transform.

    ``torch.library.opcheck`` for every transform: each check of
    :data:`CHECKS` runs on each sample and is ``ok``, ``FAIL (why)`` or
    ``skipped (why)`` (no backward, no jvp, an opaque forward, integer
    outputs, a random op). Comparisons run in float64 where the op accepts it
    (NOTE [How check compares]).

    Args:
        op: a :func:`torch_autobatch.custom_op` op (also one upgraded with
            :func:`torch_autobatch.autobatch`, or a ``torch.library.custom_op``),
            its ``torch.ops.ns.name`` or ``"ns::name"``; or a lifted
            ``autograd.Function`` (:func:`torch_autobatch.from_function`), or a
            class lifted in place (``torch_autobatch.autobatch(FunctionClass)``,
            then ``check(FunctionClass)``: the checks call ``FunctionClass.apply``,
            so the compile checks see what Dynamo sees): each overload is
            checked with the samples that call it.
        samples: the calls to check: tuples of positional arguments,
            ``(args, kwargs)`` pairs, :class:`Sample` s or OpInfo
            ``SampleInput`` s. None: generated from the schema, one per entry
            of ``shapes`` (NOTE [Samples from the schema]).
        raise_on_failure: raise ``AssertionError`` with the report if a check
            failed (for pytest); else the :class:`CheckReport` is returned.
        exhaustive: also run the slow checks (``hessian``, ``vmap_jvp``,
            ``compile_eager``, ``compile_inductor``, ``export``, ``second_thread``).
        only: run just these checks (names of :data:`CHECKS`).
        skip: checks not to run (a rule deliberately unlike the function's
            derivative, say ``skip=["backward_vs_function"]``).
        shapes: tensor shapes of the generated samples.
        atol, rtol: tolerances between paths that compute the same math
            (default 1e-6, 1e-5 in float64; finite differences use 1e-5, 1e-3).

    Returns the :class:`CheckReport` (also when everything passed).

    Example::

        >>> from torch_autobatch.testing import check
        >>> @torch_autobatch.custom_op("doc_check::double", mutates_args=())
        ... def double(x: torch.Tensor) -> torch.Tensor:
        ...     return 2 * x
        >>> check(double, only=["vmap", "jvp", "make_fx"]).ok  # samples from the schema
        True
    """
    options: dict[str, Any] = dict(exhaustive=exhaustive, only=only, skip=skip, shapes=shapes, atol=atol, rtol=rtol)
    lifted, caller = _lifted_of(op)
    if lifted is not None:  # each overload with the samples that call it
        return _check_lifted(lifted, samples, raise_on_failure, caller, **options)
    return _check_one(_Op(op), samples, raise_on_failure, **options)


def _lifted_of(op: Any) -> tuple[Any, Optional[Callable[..., Any]]]:
    """A lifted ``autograd.Function`` and what calls it (``Cls.apply`` where lifted in place), or (None, None)."""
    from ..lift._lifted import _LIFTED, LiftedFunction

    if isinstance(op, LiftedFunction):
        return op, None
    if isinstance(op, type) and issubclass(op, torch.autograd.Function):
        if op not in _LIFTED or "apply" not in vars(op):
            raise TypeError(
                f"torch_autobatch.testing.check({op.__qualname__}): the class is not lifted in place. Call "
                f"torch_autobatch.autobatch({op.__qualname__}) first (then check calls {op.__qualname__}.apply), "
                f"or check torch_autobatch.from_function({op.__qualname__})."
            )
        return _LIFTED[op], op.apply
    return None, None


def _check_one(
    info: _Op,
    samples: Optional[Iterable[Any]],
    raise_on_failure: bool,
    *,
    exhaustive: bool,
    only: Optional[Sequence[str]],
    skip: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    atol: Optional[float],
    rtol: Optional[float],
) -> CheckReport:
    """:func:`check` of one op (``info``): each check on each sample, one report."""
    start = time.perf_counter()
    names = _check_names(only, skip, exhaustive)
    given = samples is not None
    sample_list = [_as_sample(s) for s in samples] if samples is not None else _generated_samples(info, shapes)
    if not sample_list:
        raise ValueError(f"torch_autobatch.testing.check({info.qualname}): no samples")
    results: list[CheckResult] = []
    descriptions = []
    for index, sample in enumerate(sample_list):
        case = _Case(info, index, sample, atol, rtol)
        if case.error is not None and not given:
            raise ValueError(
                f"torch_autobatch.testing.check({info.qualname}): sample {index} generated from the schema "
                f"({sample!r}) fails: {case.error}. Pass samples=[...] (NOTE [Samples from the schema])."
            )
        descriptions.append(_description(case))
        results += [_run_check(case, name, exhaustive, case.repro(name, given, shapes)) for name in names]
    report = CheckReport(info.qualname, descriptions, results, time.perf_counter() - start)
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report


def _check_names(only: Optional[Sequence[str]], skip: Sequence[str], exhaustive: bool) -> list[str]:
    """The checks to run, in order; unknown names are an error."""
    unknown = sorted((set(only or ()) | set(skip)) - set(_CHECK_DEFS))
    if unknown:
        raise ValueError(f"torch_autobatch.testing.check: unknown checks {unknown}; the checks are {list(_CHECK_DEFS)}")
    names = [n for n, d in _CHECK_DEFS.items() if (n in only if only is not None else exhaustive or not d.exhaustive)]
    return [n for n in names if n not in skip]


def _check_lifted(
    lifted: Any,
    samples: Optional[Iterable[Any]],
    raise_on_failure: bool,
    caller: Optional[Callable[..., Any]],
    **options: Any,
) -> CheckReport:
    """:func:`check` of a lifted ``autograd.Function``: each overload with the samples that call it, one report."""
    groups: dict[str, Optional[list[Any]]] = {}
    if samples is None:
        if not lifted.ops:
            raise ValueError(
                f"torch_autobatch.testing.check({lifted!r}): a lifted autograd.Function has an overload per "
                f"combination of argument kinds, defined on first call; pass samples=[...]."
            )
        groups = dict.fromkeys(lifted.ops)
    else:
        for raw in samples:
            sample = _as_sample(raw)
            name = lifted.overload_for(*sample.args, **sample.kwargs)._opoverload._overloadname
            groups.setdefault(name, []).append(sample)  # type: ignore[union-attr]
    reports = [
        _check_one(_Op(lifted.ops[name], caller), group, raise_on_failure=False, **options)
        for name, group in groups.items()
    ]
    descriptions: list[str] = []
    results: list[CheckResult] = []
    for r in reports:  # the samples numbered across overloads
        results += [dataclasses.replace(x, sample=x.sample + len(descriptions)) for x in r.results]
        descriptions += [f"{d}  [{r.op}]" for d in r.samples]
    report = CheckReport(lifted._qualname, descriptions, results, sum(r.seconds for r in reports))
    if raise_on_failure and not report.ok:
        raise AssertionError(str(report))
    return report


def _description(case: _Case) -> str:
    """The sample as the report lists it, with the dtype its checks ran in."""
    sample = case.given
    leaves = tree_flatten((sample.args, sample.kwargs))[0]
    floats = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
    note = ""
    if case.error is None and floats:
        widened = case.exact and any(t.dtype != torch.float64 for t in floats)
        note = "  (checked in float64)" if widened else "" if case.exact else "  (not in float64: loose tolerances)"
    return repr(sample) + note


def _run_check(case: _Case, name: str, exhaustive: bool, repro: str) -> CheckResult:
    """One cell of the report: ok, FAIL (why) or skipped (why)."""
    t0 = time.perf_counter()
    result = CheckResult(name, case.index, OK, repro=repro)
    if case.error is not None:
        result.status, result.why = FAIL, case.error
        return result
    try:
        _CHECK_DEFS[name].fn(case, exhaustive)
    except _Skip as s:
        result.status, result.why = SKIPPED, s.why
    except _Fail as f:
        result.status, result.why, result.argument, result.max_error = FAIL, f.why, f.argument, f.max_error
    except Exception as e:
        where = traceback.extract_tb(e.__traceback__)[-1]
        result.status = FAIL
        result.why = f"raised {_first_line(e)} (at {where.filename}:{where.lineno})"
    result.seconds = time.perf_counter() - t0
    return result
