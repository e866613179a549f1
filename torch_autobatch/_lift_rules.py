"""A lifted ``autograd.Function``'s own rules as its op's: backward, jvp and ctx marks (NOTE [Lifting an autograd.Function] in _lift.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import _C
from ._lift_ctx import Residuals, _only_saved, _ReplayCtx, _unpack
from ._per_example import per_example

_Tensor = torch.Tensor
FunctionClass = type[torch.autograd.Function]


def _legacy_backward(backward: Callable[..., Any], n_in: int, cls: FunctionClass) -> Callable[..., Any]:
    """register_vjp's ``bwd`` for a legacy class: ``backward`` on a ctx rebuilt from the residuals."""

    def bwd(residuals: Residuals, *grads: Any, needs_input_grad: tuple[bool, ...]) -> Any:
        saved = _only_saved(residuals)  # NOTE [A lifted Function's residuals are flat]
        attributes: dict[str, Any] = {}
        if saved is None:
            saved, _, attributes = _unpack(residuals)
        try:
            out = backward(_ReplayCtx(saved, attributes, needs_input_grad), *grads)
        except (RuntimeError, NotImplementedError) as e:
            if not _may_loop_backward((saved, attributes, grads)):
                raise
            try:  # NOTE [A backward vmap cannot batch]
                out = per_example(
                    functools.partial(_call_backward, backward, needs_input_grad),
                    (saved, attributes, grads),
                    f"{cls.__qualname__}.backward",
                )
            except Exception:
                raise e from None
        # (a gradient of another dtype than its input's, after an AMP forward
        # cast its inputs, is cast by the node: set_cast_grad_dtypes)
        return out if type(out) is tuple and len(out) == n_in else _count(out, n_in, cls)

    return bwd


def _call_backward(
    backward: Callable[..., Any],
    needs_input_grad: tuple[bool, ...],
    saved: tuple[Any, ...],
    attributes: dict[str, Any],
    grads: tuple[Any, ...],
) -> Any:
    return backward(_ReplayCtx(saved, attributes, needs_input_grad), *grads)


def _may_loop_backward(tree: Any) -> bool:
    """May a legacy backward that failed on batched tensors run once per example instead?

    NOTE [A backward vmap cannot batch]
    A library's backward may use what vmap cannot batch (entmax's sparsemax:
    ``grad[output == 0] = 0``, boolean-mask indexing). Where it failed on
    tensors batched by vmap, it runs once per example (NOTE [Once per
    example, in Python] in _per_example.py): the definition of vmap, so the
    same values. That runs below autograd, so only where nothing will
    differentiate the backward's result: no graph kept (not
    ``create_graph=True`` inside a transform) and no tensor tracked by
    autograd or by a torch.func grad level other than the one this backward
    runs for (``grad(vmap(grad(f)))``, ``hessian``). Elsewhere the error stands.
    """
    functorch = torch._C._functorch
    if torch.is_grad_enabled() and _C._graph_task_keeps_graph():
        return False
    own = _C._backward_level()
    batched = False
    for t in pytree.tree_leaves(tree):
        while isinstance(t, _Tensor) and functorch.is_functorch_wrapped_tensor(t):
            if functorch.is_batchedtensor(t):
                batched = True
            elif functorch.maybe_get_level(t) != own:
                return False
            t = functorch.get_unwrapped(t)
        if isinstance(t, _Tensor) and t.requires_grad and torch.is_grad_enabled():
            return False
    return batched


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


def _legacy_jvp(jvp: Callable[..., Any]) -> Callable[..., Any]:
    def run(ctx: Any, *tangents: Any) -> Any:
        return jvp(ctx.replay, *tangents)

    run.__qualname__ = getattr(jvp, "__qualname__", "jvp")
    return run


def _legacy_jvp_setup_context(fwd: Callable[..., Any]) -> Callable[..., None]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        # The forward's ctx for a legacy jvp: forward runs again, on a
        # recording ctx (forward mode only; reverse mode never pays it).
        with torch.no_grad():
            _, residuals = fwd(*inputs)
        r = _unpack(residuals)
        saved = r.saved_for_forward if r.saved_for_forward is not None else r.saved
        ctx.replay = _ReplayCtx(saved, r.attributes, tuple(isinstance(a, _Tensor) for a in inputs))

    return setup_context
