"""Forward mode of a lifted ``autograd.Function`` with no ``jvp`` staticmethod: its backward, transposed.

NOTE [Lifting an autograd.Function] (lift/_lifted.py) maps a class onto an op; this
module gives that op a jvp where the class has none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch._C._functorch import TransformType
from torch.utils import _pytree as pytree

from ._ctx import _only_saved, _ReplayCtx, _unpack
from ._eager import NOT_RUN, ctx_parts, run_as_eager
from ._kinds import restoring_setup_context
from ._rules import (
    FunctionClass,
    OnceDifferentiableError,
    _count,
    _counted,
    _forward_below_this_level,
    _legacy_backward,
    _mark_as_forward_did,
    _once_message,
    _refuse_skipped,
    backward_as_eager,
    declares_no_derivative,
    once_checked,
)

_Tensor = torch.Tensor


# NOTE [Forward mode of a lifted class is its backward's transpose]
# A class's backward is what the class declares its derivative to be, and
# real libraries ship backwards that are deliberately not their forward's
# derivative (gradient scaling, straight-through estimators, an identity
# forward with a doubled backward). Forward mode derived from the forward
# would then disagree with reverse mode (jacfwd != jacrev, hessian !=
# jacrev(jacrev)). A class with no jvp staticmethod gets its forward mode
# from its backward instead: the backward is linear in its cotangent g, so
# J t = d/dg <bwd(g), t> (the gradient, with respect to g, of the backward's
# inner product with the input tangents), taken with torch.func.grad at
# g = 0 inside the jvp rule. jacfwd == jacrev and hessian == jacrev(jacrev)
# by construction, and transforms outside differentiate the backward's torch
# ops, as they do in reverse mode. A backward that cannot be differentiated
# (@once_differentiable, one that leaves torch) is an error naming the class
# and the fix: a jvp staticmethod. An output marked non-differentiable gets
# no tangent, and the cotangent of an integer output is zeros (as autograd
# materializes it) or None (set_materialize_grads(False)).
def _is_float(t: Any) -> bool:
    return isinstance(t, _Tensor) and (t.is_floating_point() or t.is_complex())


class _SkippedGradient(RuntimeError):
    """A transposed backward returned None for an input with a tangent (NOTE [A backward that asks requires_grad])."""


# NOTE [Forward mode on a basis]
# Where the backward cannot be differentiated with respect to its cotangent
# (``@once_differentiable``; it runs under no_grad, leaves torch, or runs
# autograd itself on detached copies; it returns None for an input because a
# tensor does not report requires_grad), its transpose is still its matrix:
# J's row i is the backward of the i-th basis cotangent, so J t is one
# backward per output element, each only evaluated, never differentiated.
# They run as eager .backward() runs the backward (NOTE [A backward
# torch.func cannot run runs as eager .backward() runs it], lift/_eager.py):
# no level on the stack, saved tensors requiring grad, once per example
# where a vmap batches them; a None gradient is then the backward's own zero
# (unless ctx keeps an object holding tensors). That is sound only where
# nothing differentiates J again: where a live level tracks a residual
# (jvp(jvp), a forward-mode level outside), the rows are not evaluated and the
# first error stands. A second derivative through such a backward (hessian)
# is still refused where the backward itself runs: forward mode is given,
# the backward's own derivative is not invented. Real floating outputs and
# inputs only; the cost is one backward per output element, a loop of
# .backward() as jacrev by hand would be, so past MAX_BASIS calls for one jvp
# it is an error naming the class (a jvp staticmethod, or reverse mode), not
# what would look like a hang.
Rows = Callable[[Callable[..., Any], tuple[Any, ...]], Any]


def _below_grad_wrappers(t: _Tensor) -> _Tensor:
    """An output as the levels below forward mode's see it (only its shape, per example, is read)."""
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t) and not functorch.is_batchedtensor(t):
        t = functorch.get_unwrapped(t)
    return t


def _below_this_level(ctx: Any) -> _ReplayCtx:
    """A new-style jvp's ctx as the levels below its own see it: what setup_context saved is the jvp's constant.

    (A tensor tracked by a level outside stays wrapped there, so the basis is refused where it is differentiated.)
    """
    functorch = torch._C._functorch
    top = functorch.peek_interpreter_stack()
    saved, attributes, needs, _ = ctx_parts(ctx)
    if top is None:
        return _ReplayCtx(saved, attributes, needs)
    level = top.level()

    def peel(t: _Tensor) -> _Tensor:
        while (
            functorch.is_functorch_wrapped_tensor(t)
            and not functorch.is_batchedtensor(t)
            and functorch.maybe_get_level(t) >= level
        ):
            t = functorch.get_unwrapped(t)
        return t

    saved, attributes = pytree.tree_map_only(_Tensor, peel, (saved, attributes))
    return _ReplayCtx(saved, attributes, needs)


#: The most backward calls forward mode on a basis makes for one jvp (NOTE above): past it, an error, not a hang.
MAX_BASIS = 1 << 14


class _TooManyRows(RuntimeError):
    def __init__(self, evaluations: int) -> None:
        super().__init__(evaluations)
        self.evaluations = evaluations


def _stacked(column: list[Any]) -> Any:
    """One input's gradients for each basis cotangent, stacked (a None is the backward's zero); None if all are."""
    like = next((g for g in column if g is not None), None)
    if like is None:
        return None
    return torch.stack([torch.zeros_like(like) if g is None else g for g in column])


def _on_a_basis(
    rows: Rows,
    outputs: tuple[Any, ...],
    where: list[int],
    tangents: tuple[Any, ...],
    fixed: Callable[[int, Any], Any],
) -> Any:
    """J t from the backward evaluated on a basis of cotangents (NOTE above); None where it cannot be."""
    if any(not _is_float(outputs[k]) or outputs[k].is_complex() for k in where) or any(
        isinstance(t, _Tensor) and t.is_complex() for t in tangents
    ):
        return None
    evaluations = sum(outputs[k].numel() for k in where)
    if evaluations > MAX_BASIS:
        raise _TooManyRows(evaluations)

    def evaluate(backward: Callable[..., Any], *outs: Any) -> tuple[Any, ...]:  # (one example's outputs)
        per_input: list[list[Any]] = [[] for _ in tangents]
        for k in where:
            n = outs[k].numel()
            for i in range(n):
                full = [fixed(m, o) for m, o in enumerate(outs)]
                e = torch.zeros(n, dtype=outs[k].dtype, device=outs[k].device)
                e[i] = 1
                full[k] = e.reshape(outs[k].shape)
                grads = backward(*full)
                grads = grads if isinstance(grads, tuple) else (grads,)
                for m, t in enumerate(tangents):
                    if isinstance(t, _Tensor):
                        g = grads[m] if m < len(grads) else None
                        per_input[m].append(g)
        return tuple(_stacked(column) for column in per_input)

    matrices = rows(evaluate, tuple(_below_grad_wrappers(o) if isinstance(o, _Tensor) else o for o in outputs))
    if matrices is None:
        return None
    total: Any = None
    for matrix, t in zip(matrices, tangents):
        if matrix is not None and isinstance(t, _Tensor):
            # (a gradient broadcast beyond its input's shape is summed to it, as the engine does)
            n = matrix.shape[0]
            rows_of = matrix.movedim(0, -1).sum_to_size(*t.shape, n).movedim(-1, 0).reshape(n, -1)
            part = rows_of @ t.reshape(-1).to(matrix.dtype)
            total = part if total is None else total + part
    out: list[Any] = [None] * len(outputs)
    offset = 0
    for k in where:
        n = outputs[k].numel()
        piece = torch.zeros_like(outputs[k]) if total is None else total[offset : offset + n].reshape(outputs[k].shape)
        out[k] = piece.to(outputs[k].dtype)
        offset += n
    return tuple(out)


def _check_transposable(cls: FunctionClass, grads: tuple[Any, ...], tangents: tuple[Any, ...]) -> None:
    """Raises _SkippedGradient where a gradient does not depend on its cotangent as torch sees it, or is None."""
    for i, (g, t) in enumerate(zip(grads, tangents)):
        if isinstance(g, _Tensor) and isinstance(t, _Tensor) and not g.requires_grad:
            raise _SkippedGradient(
                f"torch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp "
                f"staticmethod, so its forward mode is the transpose of its backward, and the backward's "
                f"gradient for input {i} does not depend on its cotangent as torch sees it (it ran under "
                f"no_grad, or on detached tensors): the transpose would be a silent zero. Give "
                f"{cls.__qualname__} a jvp staticmethod (jvp(ctx, *input_tangents)), or compute the backward "
                f"with grad mode on."
            )
        if g is None and isinstance(t, _Tensor):  # NOTE [A backward that asks requires_grad] (lift/_rules.py)
            raise _SkippedGradient(
                f"torch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp "
                f"staticmethod, so its forward mode is the transpose of its backward, and the backward "
                f"returned None for input {i}, which has a tangent. That may be a zero derivative, or a "
                f"backward that skips the gradient of a tensor that does not report requires_grad (tensors "
                f"inside a transform may not): a silent zero is not given. Give {cls.__qualname__} a jvp "
                f"staticmethod (jvp(ctx, *input_tangents)), or have its backward return a zero gradient."
            )


def transpose_backward(
    cls: FunctionClass,
    pullback: Callable[..., Any],
    outputs: tuple[Any, ...],
    tangents: tuple[Any, ...],
    non_differentiable: tuple[bool, ...],
    materialize: bool,
    rows: Rows,
    once: Optional[Callable[..., Any]] = None,
) -> tuple[Any, ...]:
    """Output tangents J t from ``pullback(*output_cotangents)`` (the class's backward): its transpose.

    ``rows(evaluate, outputs)`` runs ``evaluate(backward, *outputs)`` as
    eager mode runs the backward, or returns None where it cannot (NOTE
    [Forward mode on a basis]); ``once``: the backward, where it declares
    its result has no derivative (:func:`declares_no_derivative`), so only
    that is tried.
    """
    where = [k for k, o in enumerate(outputs) if _is_float(o) and not non_differentiable[k]]
    if not where or all(t is None for t in tangents):
        return tuple(None for _ in outputs)

    def fixed(k: int, o: Any) -> Any:
        return torch.zeros_like(o) if materialize and isinstance(o, _Tensor) else None

    try:
        return _transposed(cls, pullback, outputs, tangents, where, fixed, rows, once)
    except _TooManyRows as e:
        raise RuntimeError(
            f"torch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp staticmethod "
            f"and torch cannot differentiate its backward, so its forward mode is the backward's matrix, one "
            f"backward call per output element (NOTE [Forward mode on a basis]): {e.evaluations} calls here, "
            f"more than {MAX_BASIS}. Give {cls.__qualname__} a jvp staticmethod (jvp(ctx, *input_tangents)), "
            f"or use reverse mode (grad, vjp, jacrev)."
        ) from None


def _transposed(
    cls: FunctionClass,
    pullback: Callable[..., Any],
    outputs: tuple[Any, ...],
    tangents: tuple[Any, ...],
    where: list[int],
    fixed: Callable[[int, Any], Any],
    rows: Rows,
    once: Optional[Callable[..., Any]],
) -> tuple[Any, ...]:
    """:func:`transpose_backward`'s work: the differentiable transpose, else the basis (NOTE above)."""
    if once is not None:
        got = _on_a_basis(rows, outputs, where, tangents, fixed)
        if got is None:
            _refuse_once(cls, once)
        return got

    def inner(*gs: Any) -> _Tensor:
        full = [fixed(k, o) for k, o in enumerate(outputs)]
        for k, g in zip(where, gs):
            full[k] = g
        grads = pullback(*full)
        grads = grads if isinstance(grads, tuple) else (grads,)
        _check_transposable(cls, grads, tangents)
        total = gs[0].real.sum() * 0 if gs[0].is_complex() else gs[0].sum() * 0
        for g, t in zip(grads, tangents):
            if isinstance(g, _Tensor) and isinstance(t, _Tensor):
                total = total + ((g.conj() * t).real.sum() if g.is_complex() or t.is_complex() else (g * t).sum())
        return total

    seeds = tuple(torch.zeros_like(outputs[k]) for k in where)
    try:
        got = torch.func.grad(inner, argnums=tuple(range(len(where))))(*seeds)
    except (OnceDifferentiableError, _SkippedGradient):
        on_basis = _on_a_basis(rows, outputs, where, tangents, fixed)  # NOTE [Forward mode on a basis]
        if on_basis is None:
            raise
        return on_basis
    except (RuntimeError, NotImplementedError, TypeError) as e:
        if type(e) not in (RuntimeError, NotImplementedError, TypeError):
            raise  # a user's own exception (a subclass) goes on unchanged; torch's are these types
        on_basis = _on_a_basis(rows, outputs, where, tangents, fixed)  # NOTE [Forward mode on a basis]
        if on_basis is not None:
            return on_basis
        raise type(e)(
            f"{e}\ntorch_autobatch: forward-mode AD through {cls.__qualname__}: the class has no jvp "
            f"staticmethod, so its forward mode is the transpose of its backward, which needs the "
            f"backward to be differentiable with torch.func, and that failed (above). Give "
            f"{cls.__qualname__} a jvp staticmethod (jvp(ctx, *input_tangents))."
        ) from e
    out: list[Any] = [None] * len(outputs)
    for k, g in zip(where, got):
        # (a tangent of the output's dtype: the cotangent seeds had it)
        out[k] = g
    return tuple(out)


def _running_jvp_level() -> Optional[int]:
    """The forward-mode level whose jvp runs: the topmost Jvp on the stack.

    (It is the top itself, or below the vmap levels re-entered above it: NOTE [Forward mode under vmap].)
    A residual may be wrapped at it without a tangent; a wrapper of a level outside it is tracked.
    """
    for interpreter in reversed(torch._C._functorch.get_interpreter_stack() or ()):
        if interpreter.key() == TransformType.Jvp:
            return interpreter.level()
    return None


def _eager_rows(backward: Callable[..., Any], cls: FunctionClass, n_in: int, ctx: Any) -> Rows:
    """``rows`` for :func:`transpose_backward`: the class's own ``backward`` on ``ctx``, run as eager mode runs it."""
    what = f"{cls.__qualname__}.backward"

    def rows(evaluate: Callable[..., Any], outs: tuple[Any, ...]) -> Any:
        def on(replay: Any, *outs: Any) -> Any:
            def call(*gs: Any) -> Any:
                grads = _count(backward(replay, *gs), n_in, cls)
                _refuse_skipped(grads, replay, what)
                return grads

            return evaluate(call, *outs)

        try:
            got = run_as_eager(on, ctx, outs, _running_jvp_level(), what, transposing=True)
        except (RuntimeError, NotImplementedError, TypeError) as e:
            if type(e) not in (RuntimeError, NotImplementedError, TypeError):
                raise  # (a user's own exception, our own refusals: unchanged)
            return None  # (the transpose's first error stands)
        return None if got is NOT_RUN else got

    return rows


def _marked(ctx: Any, outs: tuple[Any, ...]) -> tuple[bool, ...]:
    """Per output: did ``ctx.mark_non_differentiable`` name it?"""
    marked = ctx.non_differentiable or ()
    return tuple(any(o is m for m in marked) for o in outs)


def _refuse_once(cls: FunctionClass, backward: Callable[..., Any]) -> None:
    raise OnceDifferentiableError(
        _once_message(
            cls,
            "forward-mode AD of a class with no jvp staticmethod evaluates that backward on a basis of "
            "cotangents (NOTE [Forward mode on a basis]), which cannot be done here: a complex output or "
            "tangent, a result differentiated again (jvp(jvp), a forward-mode level outside), or a backward "
            "that failed when run as eager mode runs it (one that leaves torch cannot run on torch.compile's "
            "fake tensors). Give the class a jvp staticmethod (jvp(ctx, *input_tangents)) for that",
            backward,
        )
    )


def legacy_transposed_jvp(
    cls: FunctionClass, backward: Callable[..., Any], fwd: Callable[..., Any], n_in: int
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """register_jvp's (jvp, setup_context) for a legacy class with no jvp: its backward, transposed."""
    once = backward if declares_no_derivative(backward) else None
    bwd = _legacy_backward(backward, n_in, cls)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        # (forward mode only: reverse mode never pays this second forward)
        residuals = _forward_below_this_level(fwd, inputs)
        _mark_as_forward_did(ctx, output, residuals)
        flat = residuals[0] if isinstance(residuals[0], tuple) else residuals
        ctx.transposed = (residuals, output if isinstance(output, tuple) else (output,), bool(flat[3]))

    def jvp(ctx: Any, *tangents: Any) -> Any:
        residuals, outs, materialize = ctx.transposed
        needs = tuple(isinstance(t, _Tensor) for t in tangents)
        saved = _only_saved(residuals)  # NOTE [A lifted Function's residuals are flat]
        attributes: dict[str, Any] = {}
        if saved is None:
            saved, _, attributes = _unpack(residuals)
        result = transpose_backward(
            cls,
            lambda *gs: bwd(residuals, *gs, needs_input_grad=needs),
            outs,
            tangents,
            _marked(ctx, outs),
            materialize,
            _eager_rows(backward, cls, n_in, _ReplayCtx(saved, attributes, needs)),
            once,
        )
        return result if len(outs) > 1 else result[0]

    jvp.__qualname__ = f"{cls.__qualname__}.backward (transposed)"
    return jvp, setup_context


def new_style_transposed_jvp(
    cls: FunctionClass, backward: Callable[..., Any], n_in: int, kinds: tuple[Any, ...]
) -> tuple[Callable[..., Any], Callable[..., None]]:
    """register_jvp's (jvp, setup_context) for a class with setup_context and no jvp: its backward, transposed."""
    once = backward if declares_no_derivative(backward) else None
    counted = _counted(backward_as_eager(once_checked(backward, cls), f"{cls.__qualname__}.backward"), n_in)
    user_setup = restoring_setup_context(cls.setup_context, kinds)

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        user_setup(ctx, inputs, output)
        ctx.transposed_outputs = output if isinstance(output, tuple) else (output,)

    def jvp(ctx: Any, *tangents: Any) -> Any:
        outs = ctx.transposed_outputs
        ctx.needs_input_grad = tuple(isinstance(t, _Tensor) for t in tangents)
        result = transpose_backward(
            cls,
            lambda *gs: counted(ctx, *gs),
            outs,
            tangents,
            _marked(ctx, outs),
            ctx.materialize_grads,
            _eager_rows(backward, cls, n_in, _below_this_level(ctx)),
            once,
        )
        return result if len(outs) > 1 else result[0]

    jvp.__qualname__ = f"{cls.__qualname__}.backward (transposed)"
    return jvp, setup_context
