"""A lifted ``autograd.Function``'s own rules as its op's: backward, jvp and ctx marks (NOTE [Lifting an autograd.Function] in lift/_lifted.py)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch._C._functorch import TransformType
from torch.autograd.function import once_differentiable
from torch.utils import _pytree as pytree

from .. import _C
from ..core._levels import Popped, restore
from ..core._per_example import per_example
from ..vmap._presets import _tangent_level
from ._ctx import Residuals, _only_saved, _ReplayCtx, _unpack
from ._eager import NOT_RUN, differentiated_elsewhere, level_exited, not_differentiable, run_as_eager

_Tensor = torch.Tensor
_forward_ad = torch.autograd.forward_ad
_is_compiling = torch.compiler.is_compiling
# torch's own errors are exactly these types; a user's own exception (a subclass too) goes on unchanged
_TORCH_ERRORS = (RuntimeError, NotImplementedError)
FunctionClass = type[torch.autograd.Function]


def _legacy_backward(backward: Callable[..., Any], n_in: int, cls: FunctionClass) -> Callable[..., Any]:
    """register_vjp's ``bwd`` for a legacy class: ``backward`` on a ctx rebuilt from the residuals."""
    backward = backward_as_eager(once_checked(backward, cls), f"{cls.__qualname__}.backward")

    def bwd(residuals: Residuals, *grads: Any, needs_input_grad: tuple[bool, ...]) -> Any:
        saved = _only_saved(residuals)  # NOTE [A lifted Function's residuals are flat]
        attributes: dict[str, Any] = {}
        if saved is None:
            saved, _, attributes = _unpack(residuals)
        out = backward(_ReplayCtx(saved, attributes, needs_input_grad), *grads)
        # (a gradient of another dtype than its input's, after an AMP forward
        # cast its inputs, is cast by the node: set_cast_grad_dtypes)
        return out if type(out) is tuple and len(out) == n_in else _count(out, n_in, cls)

    return bwd


# NOTE [A backward vmap cannot batch]
# A library's backward may use what vmap cannot batch (entmax's sparsemax:
# ``grad[output == 0] = 0``, boolean-mask indexing). Where it failed on
# tensors batched by vmap, it runs once per example instead (NOTE [Once per
# example, in Python] in core/_per_example.py): the definition of vmap, so the
# same values. That runs below autograd, so only where nothing will
# differentiate the backward's result again; elsewhere the error stands. It
# is one case of NOTE [A backward torch.func cannot run runs as eager
# .backward() runs it] (lift/_eager.py), which says when that is.
def backward_as_eager(backward: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``backward(ctx, *grads)``, run as eager mode runs it where torch.func cannot (NOTE above)."""

    def call(ctx: Any, *grads: Any) -> Any:
        # (traced by compiled autograd, the level checks would break the graph: none has exited there)
        if not _is_compiling() and level_exited(own := _C._backward_level()):
            out = run_as_eager(backward, ctx, grads, own, what)
            if out is not NOT_RUN:
                _refuse_skipped(out, ctx, what)
                return out
        try:
            out = backward(ctx, *grads)
        except (RuntimeError, NotImplementedError) as e:
            if type(e) not in _TORCH_ERRORS:  # (OnceDifferentiableError, a user's own exception: unchanged)
                raise
            # the node's own level may differentiate the result again where it keeps its graph
            keeps = torch.is_grad_enabled() and _C._graph_task_keeps_graph()
            out = run_as_eager(backward, ctx, grads, _C._backward_level(), what, e, keeps)
            _refuse_skipped(out, ctx, what)
            return out
        if _missing(out, ctx) and not _is_compiling():  # NOTE [A backward that asks requires_grad]
            again = run_as_eager(backward, ctx, grads, _C._backward_level(), what)
            if again is not NOT_RUN:
                out = again
            _refuse_skipped(out, ctx, what)
        return out

    call.__qualname__ = getattr(backward, "__qualname__", what)
    return call


def _refuse_skipped(out: Any, ctx: Any, what: str) -> None:
    """Raises where the backward returned None for a needed gradient with a ctx object holding tensors."""
    if _missing(out, ctx) and (holder := _object_holding_tensors(ctx)) is not None:
        raise RuntimeError(
            f"torch_autobatch: {what} returned None for an input that needs a gradient, and its ctx "
            f"keeps {holder}, an object holding tensors. Under torch.func those are the tensors our "
            f"kernels ran forward on, which do not require grad: a backward that asks them "
            f"requires_grad would silently give zeros (NOTE [A backward that asks requires_grad]). "
            f"Ask ctx.needs_input_grad instead, or save the tensors with ctx.save_for_backward."
        )


# NOTE [A backward that asks requires_grad]
# Libraries' backwards skip a gradient when a saved tensor does not require
# grad (``g * x if w.requires_grad else None``), as eager mode allows. Under
# torch.func our node runs the backward on the tensors of the level it runs
# at, where a saved input may not report requires_grad (under vmap, in
# jacrev and vmap(grad)), so the gradient would silently be None: zeros. A
# backward that returns None for an input that needs a gradient is run
# again as eager .backward() runs it (NOTE [A backward torch.func cannot run
# runs as eager .backward() runs it], lift/_eager.py), on fresh tensors that
# require grad as eager mode's would, where nothing differentiates its
# result again; a None there is the backward's own answer, unless ctx keeps
# an object holding tensors (an operator built in forward): those are the
# tensors forward ran on, which never require grad, so a None may be a
# skipped gradient, and is an error naming the class.
def _object_holding_tensors(ctx: Any) -> Any:
    """The name of a ctx attribute that is an object (not a tensor or container) holding a tensor, or None.

    Through stored data (instance dicts, and tuples, lists and dicts in them), a few levels deep: an
    operator of operators (linear_operator's sums and products).
    """
    for name, value in getattr(ctx, "__dict__", {}).items():
        if isinstance(value, (_Tensor, tuple, list, dict)) or name.startswith("_torch_autobatch"):
            continue
        if _holds_tensor(value, 4, set()):
            return f"ctx.{name} ({type(value).__name__})"
    return None


_NOT_HOLDERS = (str, bytes, type, types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)


def _holds_tensor(value: Any, depth: int, seen: set[int]) -> bool:
    if isinstance(value, _Tensor):
        return True
    if depth == 0 or id(value) in seen or isinstance(value, _NOT_HOLDERS):
        return False
    seen.add(id(value))
    if isinstance(value, (tuple, list)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        stored = getattr(value, "__dict__", None)
        items = stored.values() if isinstance(stored, dict) else ()
    return any(_holds_tensor(v, depth - 1, seen) for v in list(items)[:64])


def _missing(out: Any, ctx: Any) -> bool:
    """Did the backward return None for a tensor input that needs a gradient?"""
    needs = getattr(ctx, "needs_input_grad", ())
    outs = out if type(out) is tuple else (out,)
    return any(g is None and n for g, n in zip(outs, needs))


def jvp_as_eager(jvp: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``jvp(ctx, *tangents)``, run as eager mode runs it where torch.func cannot.

    NOTE [A backward torch.func cannot run runs as eager .backward() runs it] (lift/_eager.py).
    """

    def call(ctx: Any, *tangents: Any) -> Any:
        try:
            return jvp(ctx, *tangents)
        except (RuntimeError, NotImplementedError) as e:
            if type(e) not in _TORCH_ERRORS:
                raise
            return run_as_eager(jvp, ctx, tangents, _tangent_level(tangents), what, e)

    call.__qualname__ = getattr(jvp, "__qualname__", what)
    return call


def _apply_marks(ctx: Any, output: Any, residuals: Residuals) -> None:
    """``mark_non_differentiable`` / ``set_materialize_grads`` as the legacy forward called them."""
    flat = (
        residuals[0] if isinstance(residuals[0], tuple) else residuals
    )  # NOTE [A lifted Function's residuals are flat]
    mask, materialize = flat[2], flat[3]
    if mask:
        outs = output if isinstance(output, tuple) else (output,)
        ctx.mark_non_differentiable(*(o for k, o in enumerate(outs) if mask >> k & 1))
    if not materialize:
        ctx.set_materialize_grads(False)


def _count(grads: Any, n_in: int, cls: FunctionClass) -> Any:
    """One gradient per input, as autograd.Function allows: a lone tensor, and trailing Nones beyond the inputs."""
    if not isinstance(grads, tuple):
        grads = (grads,)
    if len(grads) > n_in:
        if any(g is not None for g in grads[n_in:]):
            raise RuntimeError(
                f"torch_autobatch: {cls.__qualname__}.backward returned {len(grads)} gradients, but "
                f"apply was called with {n_in} arguments (extra ones may only be None)."
            )
        grads = grads[:n_in]
    return grads


def _counted(backward: Callable[..., Any], n_in: int) -> Callable[..., Any]:
    def counted(ctx: Any, *grads: Any) -> Any:
        return _count(backward(ctx, *grads), n_in, type(ctx))

    counted.__qualname__ = getattr(backward, "__qualname__", "backward")
    return counted


def _legacy_jvp(jvp: Callable[..., Any], cls: FunctionClass) -> Callable[..., Any]:
    as_eager = jvp_as_eager(jvp, f"{cls.__qualname__}.jvp")

    def run(ctx: Any, *tangents: Any) -> Any:
        return as_eager(ctx.replay, *tangents)

    run.__qualname__ = getattr(jvp, "__qualname__", "jvp")
    return run


def _legacy_jvp_setup_context(fwd: Callable[..., Any]) -> Callable[..., None]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        # The forward's ctx for a legacy jvp: forward runs again, on a
        # recording ctx (forward mode only; reverse mode never pays it).
        residuals = _forward_below_this_level(fwd, inputs)
        r = _unpack(residuals)
        saved = r.saved_for_forward if r.saved_for_forward is not None else r.saved
        ctx.replay = _ReplayCtx(saved, r.attributes, tuple(isinstance(a, _Tensor) for a in inputs))
        if r.saved_for_forward is not None:  # NOTE [A jvp reads ctx.saved_for_forward] (op/_forward_mode.py)
            ctx.replay.saved_for_forward = saved
        _mark_as_forward_did(ctx, output, residuals)

    return setup_context


def _forward_below_this_level(fwd: Callable[..., Any], inputs: tuple[Any, ...]) -> Residuals:
    """A legacy forward's residuals for a jvp, computed one level down: they carry no tangent of this level.

    The residuals are the jvp's constants at its own level (a forward that
    leaves torch, through numpy, could not even run on this level's
    wrappers); levels outside keep theirs, so they still differentiate what
    the jvp computes (jvp(jvp), hessian). The level is popped inside the
    ``try`` that pushes it back (NOTE [Popping levels, interruptibly]), so an
    exception anywhere leaves the stack as it was.
    """
    functorch = torch._C._functorch
    interpreter = functorch.peek_interpreter_stack()
    if interpreter is None:
        with torch.no_grad():
            return fwd(*inputs)[1]
    if interpreter.key() == TransformType.Vmap:
        # The jvp of a level below vmap (jvp(vmap(f)): NOTE [Forward mode under vmap]) runs with that
        # level already lowered and the vmap levels above re-entered: its inputs carry no tangent here.
        with torch.no_grad():
            return _forward_or_per_example(fwd, inputs)
    level = interpreter.level()
    inputs = pytree.tree_map_only(_Tensor, lambda t: functorch._unwrap_for_grad(t, level), inputs)
    popped = Popped()
    try:
        popped.one()
        with torch.no_grad():
            return _forward_or_per_example(fwd, inputs)
    finally:
        restore(popped.back)


def _forward_or_per_example(fwd: Callable[..., Any], inputs: tuple[Any, ...]) -> Residuals:
    """``fwd``'s residuals; once per example where the forward cannot run on tensors a vmap batches (numpy).

    NOTE [Once per example, in Python] (core/_per_example.py), as the op's own
    vmap="loop" runs that forward.
    """
    cls = getattr(getattr(fwd, "__self__", None), "cls", None)  # (a lifted class's _Kernel.fwd)
    what = f"{cls.__qualname__}.forward" if cls is not None else "the forward"
    try:
        return fwd(*inputs)[1]
    except (RuntimeError, NotImplementedError) as e:
        leaves = pytree.tree_leaves(inputs)
        if type(e) in _TORCH_ERRORS and differentiated_elsewhere(
            leaves
        ):  # jvp(jvp), jacfwd(jacfwd): a loop would drop the outer tangents
            raise not_differentiable(f"{what} (run again for its jvp's ctx)", e) from e
        if not any(torch._C._functorch.is_batchedtensor(t) for t in leaves if isinstance(t, _Tensor)):
            raise
    return per_example(lambda *a: fwd(*a)[1], inputs, what)


def _mark_as_forward_did(ctx: Any, output: Any, residuals: Residuals) -> None:
    """The outputs the legacy forward marked non-differentiable, marked on the jvp's ctx (no tangent: run_jvp)."""
    flat = residuals[0] if isinstance(residuals[0], tuple) else residuals
    mask = flat[2]
    if mask:
        outs = output if isinstance(output, tuple) else (output,)
        ctx.mark_non_differentiable(*(o for k, o in enumerate(outs) if mask >> k & 1))


# ------------------------------------------------------- once_differentiable
# NOTE [once_differentiable governs every transform]
# A backward decorated with ``@once_differentiable`` runs under no_grad: its
# result has no derivative. torch's own class makes that an error lazily, and
# only at the base and only when a *gradient* requires grad (a DelayedError
# node); under torch.func (where its check sees no ``requires_grad``) and
# where only the saved tensors are differentiated, the second derivative is
# silently zero (or, in forward mode, which no_grad does not stop, the
# derivative of torch ops the class declared final). A lifted class's
# declaration governs every path instead: its backward's result is
# differentiated again when a tensor it receives (a residual, rebuilt with
# history for a second derivative, or a gradient) is tracked by a
# differentiation other than the one running the backward: autograd at the
# base (requires grad: a DelayedError naming the class, raised if that
# derivative is ever taken, as torch does), a torch.func grad or jvp level
# that is not the backward's own, or a forward-mode dual tangent (both an
# error now, naming the class: torch.func has no lazy error node, and a jvp
# level's derivative is taken as the backward runs). vmap levels batch, they
# do not differentiate. Forward mode is its matrix, evaluated one basis
# cotangent at a time and never differentiated (NOTE [Forward mode on a
# basis], lift/_transpose.py). A backward decorated with ``@torch.no_grad()``
# declares the same (its result has no derivative: eager double backward
# raises) and is held to it the same way; else reverse mode over it would be
# silently zero (jacrev(jacrev)) where forward mode over it, which no_grad does
# not stop, is not (hessian).
class OnceDifferentiableError(RuntimeError):
    """A second derivative through a lifted class whose backward is ``@once_differentiable``."""


_ONCE_CODE = once_differentiable(lambda ctx: None).__code__


def is_once_differentiable(fn: Any) -> bool:
    """Is ``fn`` torch's ``once_differentiable`` wrapper (of a staticmethod's function)?"""
    return getattr(fn, "__code__", None) is _ONCE_CODE and hasattr(fn, "__wrapped__")


def runs_under_no_grad(fn: Any) -> bool:
    """Is ``fn`` decorated with ``@torch.no_grad()`` (torch's context decorator, holding its no_grad)?"""
    code, closure = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not closure or not hasattr(fn, "__wrapped__"):
        return False
    for name, cell in zip(code.co_freevars, closure):
        if name == "ctx_factory":
            return isinstance(getattr(cell.cell_contents, "__self__", None), torch.no_grad)
    return False


def declares_no_derivative(fn: Any) -> bool:
    """``@once_differentiable`` or ``@torch.no_grad()``: the backward's result has no derivative (NOTE above)."""
    return is_once_differentiable(fn) or runs_under_no_grad(fn)


def _once_message(cls: FunctionClass, how: str, backward: Any = None) -> str:
    decorator = "@torch.no_grad()" if backward is not None and runs_under_no_grad(backward) else "@once_differentiable"
    return (
        f"torch_autobatch: {cls.__qualname__}.backward is decorated with {decorator}, so its "
        f"result cannot be differentiated, and {how}. Take first derivatives only (grad, vjp, jacrev, "
        f"vmap(grad), one .backward()), or remove {decorator} from a backward made of "
        f"differentiable torch ops."
    )


_SECOND = (
    "this computation differentiates it again (a second derivative: grad(grad), jacrev(jacrev), hessian, "
    "jacfwd(jacrev), a .backward(create_graph=True) differentiated again)"
)


def _tracked(leaves: list[Any]) -> tuple[str, list[_Tensor]]:
    """How tensors among ``leaves`` are tracked by a differentiation other than the running backward's.

    ('level', []) for a live torch.func grad/jvp level other than the
    backward's own, or a forward-mode tangent; ('base', tensors) for
    autograd at the base (the tensors that require grad); ('', []) for none.
    """
    functorch = torch._C._functorch
    own = _C._backward_level()
    live = None
    base: list[_Tensor] = []
    for t in leaves:
        if not isinstance(t, _Tensor):
            continue
        while functorch.is_functorch_wrapped_tensor(t):
            if not functorch.is_batchedtensor(t):
                level = functorch.maybe_get_level(t)
                if level != own:
                    if live is None:
                        live = {i.level() for i in functorch.get_interpreter_stack() or ()}
                    if level in live:
                        return "level", []
            t = functorch.get_unwrapped(t)
        if t.requires_grad:
            base.append(t)
        if _forward_ad._current_level >= 0 and _forward_ad.unpack_dual(t).tangent is not None:
            return "level", []
    return ("base", base) if base else ("", [])


def once_checked(backward: Callable[..., Any], cls: FunctionClass) -> Callable[..., Any]:
    """``backward``, with a ``@once_differentiable`` declaration enforced on every path (NOTE above)."""
    return _once(backward, cls) if declares_no_derivative(backward) else backward


def _once(backward: Callable[..., Any], cls: FunctionClass) -> Callable[..., Any]:
    """``backward`` (once_differentiable) with its declaration enforced on every path (NOTE above)."""
    inner = backward.__wrapped__  # type: ignore[attr-defined]

    def call(ctx: Any, *grads: Any) -> Any:
        with torch.no_grad():
            out = inner(ctx, *grads)
        if not torch.is_grad_enabled():
            return out
        received = [*ctx.saved_tensors, *(v for v in vars(ctx).values() if isinstance(v, _Tensor)), *grads]
        how, tracked = _tracked(received)
        if how == "level":
            raise OnceDifferentiableError(_once_message(cls, _SECOND, backward))
        if how != "base":
            return out
        # torch's DelayedError node, fed by what is differentiated too (torch's own feeds it fresh
        # leaves only, so a derivative taken with autograd.grad misses it): the error is raised if,
        # and when, that derivative is taken
        outs = out if isinstance(out, tuple) else (out,)
        present = [k for k, o in enumerate(outs) if isinstance(o, _Tensor)]
        error = torch._C._functions.DelayedError(
            _once_message(cls, _SECOND, backward).encode(), len(present) + len(tracked)
        )
        fed = error(*[outs[k].detach().requires_grad_() for k in present], *tracked)
        fed = fed if isinstance(fed, tuple) else (fed,)
        result = list(outs)
        for k, o in zip(present, fed):
            result[k] = o
        return tuple(result) if isinstance(out, tuple) else result[0]

    call.__qualname__ = getattr(inner, "__qualname__", "backward")
    return call
