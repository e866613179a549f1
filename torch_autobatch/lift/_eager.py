"""A lifted class's backward or jvp that torch.func cannot run, run as eager autograd runs it.

NOTE [A backward torch.func cannot run runs as eager .backward() runs it]
Libraries ship backwards (and jvps) that work under eager ``.backward()`` and
nowhere else: they leave torch (numpy, a C++ extension's kernel, anything
that reads ``data_ptr()``: functorch's wrappers have no storage), or use
autograd themselves (recompute- and checkpoint-style: ``with
torch.enable_grad(): x = x.detach().requires_grad_(); torch.autograd.grad(f(x),
x, g)``, whose ``requires_grad_`` functorch refuses while a level is on the
stack, or a ``torch.autograd.grad`` of a saved input that no longer requires
grad). (A TorchScript function dispatches each op through functorch, and
needs none of this.) Eager ``.backward()`` runs such a function on plain
tensors, with no torch.func level on the stack and grad mode off (the
function turns it on where it wants it), its saved inputs requiring grad. So
where the function fails under a torch.func transform (a RuntimeError or
NotImplementedError, torch's own error types), it runs again exactly so
(:func:`run_as_eager`):

- every torch.func level is popped for the call (NOTE [Popping levels,
  interruptibly]); the tensors it gets are plain (NOTE [Once per example, in
  Python] peels them), each a fresh alias (``detach()``, so a
  ``requires_grad_()`` never reaches a user's tensor), and a saved tensor
  (or a tensor ``ctx`` attribute) requires grad where it would in eager mode:
  where its wrapper at the node's own grad level (live, or dead once that
  level exited) requires grad; where torch.func stripped that level's wrapper
  (the level exited), where it is floating. Gradients and tangents do not, as
  in eager mode without ``create_graph``;
- where a vmap level batches any of them, once per example (vmap cannot
  batch autograd run on tensors it batches, nor a kernel outside torch): the
  definition of vmap, so the same values, at the cost of a Python loop.
  ``vmap(grad)``, ``jacrev`` and ``jacfwd`` of such a class are a loop of
  its ``.backward()`` (or jvp); the batched try runs first, so a backward
  vmap can batch keeps its speed;
- the results are detached: they carry no derivative.

A backward run for a level that has exited, with no level on the stack
(``vjp``'s pullback), gets plain tensors already: it runs so at once, not
tried first (:func:`level_exited`; a try could ``requires_grad_()`` a user's
own tensor, which torch.func then hands it).

That is sound only where nothing differentiates the function's result again
(:func:`_how`): no tensor it gets is tracked by a live torch.func level other
than its own (``grad(grad)``, ``hessian``, ``jacfwd(jacrev)``, forward mode
of a class with no jvp staticmethod, whose jvp is its backward
differentiated), nor by autograd at the base (requires grad with grad mode
on) or a forward-mode dual tangent; and the node's own level, while it lives,
does not keep its graph (``torch.autograd.grad(..., create_graph=True)``
inside a transform). There the failure is an error naming the class and
saying its backward (or jvp) is not differentiable by torch
(:func:`not_differentiable`), never a derivative of zero. Where no torch.func
level is involved at all the function ran as eager mode runs it already, and
its own error stands.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch._C._functorch import TransformType
from torch.utils import _pytree as pytree

from ..core._levels import Popped, restore
from ..core._per_example import DrewUnderError, per_example
from ._ctx import _CTX_INTERNALS, _ReplayCtx

__all__ = [
    "NOT_RUN",
    "ctx_parts",
    "differentiated_elsewhere",
    "level_exited",
    "not_differentiable",
    "note_inputs_in_objects",
    "run_as_eager",
]

_Tensor = torch.Tensor
_forward_ad = torch.autograd.forward_ad
_functorch = torch._C._functorch
_is_dead: Callable[[_Tensor], bool] = getattr(_functorch, "is_dead_tensor_wrapper")  # noqa: B009

_EAGER, _ONCE, _AGAIN, _GUARDED = range(4)
_REPLAY_OWN = frozenset({*_CTX_INTERNALS, "saved_tensors", "saved_variables", "transposed", "transposed_outputs"})
_INPUTS_IN = "_torch_autobatch_inputs_in_objects"  # NOTE [Inputs inside ctx objects]
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, types.ModuleType)
_AD = (TransformType.Grad, TransformType.Jvp)
#: :func:`run_as_eager`'s answer where the function must run as it is (it is differentiated again).
NOT_RUN: Any = object()


def level_exited(own: int) -> bool:
    """Does a backward run for a torch.func level with none on the stack (vjp's pullback once its level exited)?

    torch.func has stripped that level's dead wrappers: the tensors are
    plain, and the backward is run as eager mode runs it at once (a first
    try could ``requires_grad_()`` a user's own tensor).
    """
    return own > 0 and _functorch.peek_interpreter_stack() is None


def _how(
    leaves: list[Any],
    own: Optional[int],
    own_live: bool,
    live: set[int],
    own_may_differentiate: bool,
    base_is_again: bool = False,
) -> int:
    """_EAGER (no torch.func level involved), _ONCE (first derivative only), _AGAIN (differentiated again),
    or _GUARDED (first derivative, with a tensor autograd tracks at the base: NOTE [Autograd at the base])."""
    wrapped = bool(own)
    base = False
    for t in leaves:
        if not isinstance(t, _Tensor):
            continue
        while _functorch.is_functorch_wrapped_tensor(t):
            wrapped = True
            if not _functorch.is_batchedtensor(t) and not _is_dead(t):
                level = _functorch.maybe_get_level(t)
                if level in live and (level != own or not own_live or own_may_differentiate):
                    return _AGAIN
            t = _functorch.get_unwrapped(t)
        if t.requires_grad and torch.is_grad_enabled():
            if base_is_again:
                return _AGAIN
            base = True
        if _forward_ad._current_level >= 0 and _forward_ad.unpack_dual(t).tangent is not None:
            return _AGAIN
    if not wrapped:
        return _EAGER
    return _GUARDED if base else _ONCE


def _requires_grad(t: Any, own: Optional[int], own_live: bool) -> bool:
    """Would eager mode's tensor require grad (NOTE above)?

    As its wrapper at the own level (or a dead one) does, or the tensor
    below every level does (NOTE [Autograd at the base]: a module's
    parameter); a plain tensor whose level exited (torch.func stripped the
    wrapper) does if floating.
    """
    at_own = False
    while isinstance(t, _Tensor) and _functorch.is_functorch_wrapped_tensor(t):
        if not _functorch.is_batchedtensor(t) and (_is_dead(t) or _functorch.maybe_get_level(t) == own):
            at_own = True
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                return True
        t = _functorch.get_unwrapped(t)
    if not isinstance(t, _Tensor):
        return False
    if t.requires_grad or at_own:  # (a wrapper at its own level that does not: the base's answer)
        return bool(t.requires_grad)
    return bool(own) and not own_live and (t.is_floating_point() or t.is_complex())


def differentiated_elsewhere(leaves: list[Any]) -> bool:
    """Is a tensor among ``leaves`` tracked by a live torch.func level (or autograd, or a dual tangent)?"""
    stack = _functorch.get_interpreter_stack() or ()
    return _how(leaves, None, False, {i.level() for i in stack}, False, base_is_again=True) == _AGAIN


def not_differentiable(what: str, error: BaseException) -> RuntimeError:
    return RuntimeError(
        f"{error}\ntorch_autobatch: {what} is not differentiable by torch: it failed (above) on the "
        f"tensors of a torch.func transform, and this computation differentiates its result again (a "
        f"second derivative: grad(grad), hessian, jacrev(jacrev), jacfwd(jacrev), jvp(jvp), forward mode "
        f"of a class with no jvp staticmethod, or a create_graph=True backward inside a transform). Where "
        f"nothing differentiates it again it runs on plain tensors, as eager .backward() runs it; but a "
        f"function that leaves torch (numpy, TorchScript, a C++ extension) or runs autograd on detached "
        f"copies has no derivative, and zeros would be silently wrong. Take first derivatives only (grad, "
        f"vjp, jacrev, vmap(grad), jvp, jacfwd), give the class a jvp staticmethod for forward mode, or "
        f"write {what} with differentiable torch ops."
    )


def run_as_eager(
    fn: Callable[..., Any],
    ctx: Any,
    args: tuple[Any, ...],
    own: Optional[int],
    what: str,
    error: Optional[BaseException] = None,
    own_may_differentiate: bool = False,
    transposing: bool = False,
) -> Any:
    """``fn(ctx, *args)`` run as eager mode runs it (NOTE above), after it raised ``error`` under torch.func.

    ``ctx`` is the one ``fn`` got (a ``_ReplayCtx`` or a ``BackwardContext``,
    read inside that call); ``own`` the level the call runs for (the node's
    grad level, the jvp's forward-mode level); ``what`` names ``fn``
    (``"Cls.backward"``). With an ``error``, raises it where no torch.func
    level is involved (eager mode's own path ran) or where the rerun fails
    too, and a clear error where the result is differentiated again; with
    none (:func:`level_exited`), returns :data:`NOT_RUN` there.
    ``transposing``: a backward evaluated for forward mode (NOTE [Forward
    mode on a basis], lift/_transpose.py) runs so even where no level is
    involved, and every floating saved tensor requires grad (each input has a
    tangent, so eager mode's would).
    """
    saved, attributes, needs, for_forward = ctx_parts(ctx)
    tree = (saved, attributes, args)
    leaves, spec = pytree.tree_flatten(tree)
    stack = _functorch.get_interpreter_stack() or ()
    own_live = any(i.level() == own and i.key() in _AD for i in stack)
    how = _how(leaves, own, own_live, {i.level() for i in stack}, own_may_differentiate)
    if transposing and how == _EAGER:
        how = _ONCE
    if how not in (_ONCE, _GUARDED):
        if error is None:
            return NOT_RUN
        if how == _EAGER:
            raise error
        raise not_differentiable(what, error) from error
    n_ctx = len(pytree.tree_leaves((saved, attributes)))
    mask = [
        i < n_ctx and (_requires_grad(t, own, own_live) or (transposing and _is_floating(t)))
        for i, t in enumerate(leaves)
    ]

    def run(flat: list[Any]) -> Any:  # (one example's leaves of tree)
        popped = Popped()  # NOTE [Popping levels, interruptibly]
        try:
            popped.above(0)  # (functorch refuses requires_grad_ while any level is on the stack)
            saved, attributes, args = pytree.tree_unflatten([_fresh(t, m) for t, m in zip(flat, mask)], spec)
            replay = _ReplayCtx(saved, attributes, needs)
            undo = _inputs_requiring_grad(attributes, needs)
            if for_forward:  # NOTE [A jvp reads ctx.saved_for_forward] (op/_forward_mode.py)
                replay.saved_for_forward = saved  # type: ignore[attr-defined]
            try:
                with torch.no_grad():
                    out = fn(replay, *args)
            finally:
                for store, key, old in reversed(undo):
                    store[key] = old
            if type(out) is tuple:
                out = tuple(t.detach() if isinstance(t, _Tensor) and t.requires_grad else t for t in out)
            else:
                out = pytree.tree_map_only(_Tensor, lambda t: t.detach() if t.requires_grad else t, out)
            return _refusing_differentiation(out, what) if how == _GUARDED else out
        finally:
            restore(popped.back)

    if error is None:
        return per_example(run, tree, what, leaves=True)
    try:
        return per_example(run, tree, what, leaves=True)
    except DrewUnderError:
        raise  # (the loop's own refusal, not the function's failure)
    except Exception:
        raise error from None


# NOTE [Autograd at the base]
# A module's parameters require grad (every module's default), so a backward
# that reads them (an adjoint method, a reversible layer) gets tensors autograd
# tracks at the base even under a first-order ``grad(f)(y)``. Eager mode runs
# such a backward and returns a result with no derivative (it used autograd on
# detached copies): differentiating it again is silently wrong there. Ours runs
# it as eager mode does, its saved tensors requiring grad as they did, and gives
# each floating result torch's ``DelayedError`` node (what ``once_differentiable``
# does): a result differentiated again at the base raises, naming the class.
def _refusing_differentiation(out: Any, what: str) -> Any:
    """``out``'s floating tensors, each behind a node that raises if autograd differentiates it."""
    leaves, spec = pytree.tree_flatten(out)
    where = [i for i, t in enumerate(leaves) if isinstance(t, _Tensor) and (t.is_floating_point() or t.is_complex())]
    if not where:
        return out
    message = (
        f"torch_autobatch: {what} ran as eager .backward() runs it, so its result has no derivative "
        f"(NOTE [Autograd at the base]), and autograd is differentiating it again (a tensor it got "
        f"requires grad). Take first derivatives only through it."
    )
    with torch.enable_grad():
        err = torch._C._functions.DelayedError(message, len(where))
        guarded = err(*(leaves[i].detach().requires_grad_() for i in where))
    for i, t in zip(where, guarded if isinstance(guarded, tuple) else (guarded,)):
        leaves[i] = t
    return pytree.tree_unflatten(leaves, spec)


# NOTE [Inputs inside ctx objects]
# A legacy forward may keep on ctx an object built from its inputs
# (linear_operator's operator, ``ctx._linear_op = representation_tree(*args)``)
# and its backward ask that object's tensors ``requires_grad``, or
# differentiate through them. Under torch.func the object holds the tensors
# our kernel ran forward on, which do not require grad. The kernel notes which
# of them are which inputs (:func:`note_inputs_in_objects`); the eager rerun
# swaps each one whose input needs a gradient for a fresh leaf that requires
# grad, in the objects ctx keeps, for the backward's call, and swaps them back.
def note_inputs_in_objects(ctx_dict: dict[str, Any], args: tuple[Any, ...]) -> None:
    """Notes on a recording ctx which of its objects' tensors are which of forward's tensor arguments."""
    ids = {id(a): j for j, a in enumerate(args) if isinstance(a, _Tensor)}
    found: set[tuple[int, int]] = set()
    for value in list(ctx_dict.values()):
        if not _is_object(value):
            continue
        _walk(value, 4, set(), lambda store, key, t: found.add((ids[id(t)], id(t))) if id(t) in ids else None)
    if found:
        ctx_dict[_INPUTS_IN] = tuple(sorted(found))


def _is_object(value: Any) -> bool:
    """An instance holding stored data (an operator), not a tensor, class, function or module."""
    return hasattr(value, "__dict__") and not isinstance(value, (_Tensor, type, *_FUNCTIONS))


def _walk(value: Any, depth: int, seen: set[int], visit: Callable[[Any, Any, _Tensor], None]) -> None:
    """Calls ``visit(store, key, tensor)`` for each tensor held in ``value``'s stored data (a few levels deep)."""
    if depth == 0 or id(value) in seen:
        return
    seen.add(id(value))
    store = value if isinstance(value, (list, dict)) else getattr(value, "__dict__", None)
    if not isinstance(store, (list, dict)):
        return
    for key, item in list(store.items() if isinstance(store, dict) else enumerate(store)):
        if isinstance(item, _Tensor):
            visit(store, key, item)
        elif isinstance(item, tuple):
            for t in item:
                if isinstance(t, _Tensor):
                    visit(store, key, t)
                elif _is_object(t):
                    _walk(t, depth - 1, seen, visit)
        elif isinstance(item, (list, dict)) or _is_object(item):
            _walk(item, depth - 1, seen, visit)


def _inputs_requiring_grad(attributes: dict[str, Any], needs: tuple[bool, ...]) -> list[tuple[Any, Any, Any]]:
    """Swaps the noted inputs inside ctx's objects for fresh leaves that require grad; the undo log."""
    noted = attributes.get(_INPUTS_IN)
    if not noted:
        return []
    fresh: dict[int, _Tensor] = {}
    wanted = {tid for j, tid in noted if j < len(needs) and needs[j]}
    undo: list[tuple[Any, Any, Any]] = []

    def swap(store: Any, key: Any, t: _Tensor) -> None:
        if id(t) not in wanted or _functorch.is_functorch_wrapped_tensor(t):
            return
        new = fresh.setdefault(id(t), t.detach().requires_grad_())
        old = store[key]
        undo.append((store, key, old))
        store[key] = new if isinstance(old, _Tensor) else tuple(new if x is t else x for x in old)

    seen: set[int] = set()
    for value in attributes.values():
        if _is_object(value):
            _walk(value, 4, seen, swap)
    return undo


def _is_floating(t: Any) -> bool:
    return isinstance(t, _Tensor) and (t.is_floating_point() or t.is_complex())


def _fresh(t: Any, requires_grad: bool) -> Any:
    if not isinstance(t, _Tensor):
        return t
    return t.detach().requires_grad_() if requires_grad else t.detach()


def ctx_parts(ctx: Any) -> tuple[tuple[Any, ...], dict[str, Any], tuple[bool, ...], bool]:
    """(saved tensors, other attributes, needs_input_grad, reads saved_for_forward) of a ctx, read in its call."""
    attributes = {k: v for k, v in vars(ctx).items() if k not in _REPLAY_OWN}
    for_forward = getattr(ctx, "saved_for_forward", None) is not None
    return tuple(ctx.saved_tensors), attributes, tuple(ctx.needs_input_grad), for_forward
