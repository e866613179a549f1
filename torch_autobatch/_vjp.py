"""``register_vjp(fwd, bwd)``: a backward that receives the forward's intermediates.

NOTE [Residuals of register_vjp] (csrc/op_state.h) is the C++ half: a kernel
of ours that is about to make the op's grad node opens a thread-local request
for the call; whatever runs the op below it (the backend function wrapped
here, the fake kernel, Inductor's decomposition) takes the request, runs
``fwd`` instead of the function, and answers it with the residuals. The
op's internal ``setup_context`` reads them back, saves their tensors with
``save_for_backward`` (so they are version-checked, seen by
``saved_tensors_hooks``, batched per level under vmap, and freed with the
graph), and the internal backward rebuilds the residuals for ``bwd``.

NOTE [Second derivatives through residuals]
A residual computed by ``fwd`` (``t = tanh(x)``) is a function of the inputs,
but it was computed below autograd: differentiating ``bwd``'s result again
would miss d(residual)/d(input) and be silently wrong. So the backward
refuses, naming the op, when that could happen: it runs with grad mode on
(``create_graph=True``, or a torch.func level) and an input is tracked by a
differentiation outside the node's own level (at the base: the input requires
grad; under torch.func: the input, one grad level down, is still tracked by a
transform). Residuals that are inputs themselves (``w`` passed through) carry
their own history and never refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from . import _C, _compile

if TYPE_CHECKING:
    from ._custom_op import CustomOpDef

__all__ = ["register", "take_request_and_run_fwd", "wrap_kernel"]


def _fwd_name(op: CustomOpDef) -> str:
    fwd = op._ab.vjp_fwd
    return getattr(fwd, "__qualname__", None) or repr(fwd)


def run_fwd(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``fwd(*args, **kwargs)``, checked: the op's output and the residuals."""
    assert op._ab.vjp_fwd is not None
    result = op._ab.vjp_fwd(*args, **kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"torch_autobatch: the fwd of {op._qualname} ({_fwd_name(op)}) must return "
            f"(output, residuals), a tuple of two; it returned {type(result).__name__}"
            f"{'' if not isinstance(result, tuple) else f' of {len(result)}'}."
        )
    out, residuals = result
    n = op._ab.num_returns
    outs = (out,) if n == 1 else out
    if not isinstance(outs, tuple) or len(outs) != n:
        raise TypeError(
            f"torch_autobatch: the fwd of {op._qualname} ({_fwd_name(op)}) returned an output "
            f"of structure {pytree.tree_structure(out)}, but the op returns {n} value(s) "
            f"({op._opoverload._schema.returns}). Return them as the op's function does."
        )
    return out, residuals


def take_request_and_run_fwd(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fwd``'s output if a kernel asked for the op's residuals on this thread, else ``NotImplemented``."""
    reg = op._ab.registration
    if op._ab.vjp_fwd is None or reg is None or not reg.take_residual_request():
        return NotImplemented
    out, residuals = run_fwd(op, args, kwargs)
    reg.deliver_residuals(residuals)
    return out


def wrap_kernel(op: CustomOpDef, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as the op's backend kernel: ``fwd`` instead where residuals are asked for."""

    def kernel(*args: Any, **kwargs: Any) -> Any:
        out = take_request_and_run_fwd(op, args, kwargs)
        return fn(*args, **kwargs) if out is NotImplemented else out

    kernel.__qualname__ = getattr(fn, "__qualname__", "kernel")
    kernel.__name__ = getattr(fn, "__name__", "kernel")
    return kernel


def _tensors(values: tuple[Any, ...]) -> list[torch.Tensor]:
    return [t for v in values for t in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(t, torch.Tensor)]


def _below_levels(x: torch.Tensor) -> torch.Tensor:
    """``x`` without its functorch grad wrappers: the tensor the op's kernel below autograd saw."""
    functorch = torch._C._functorch
    while functorch.is_gradtrackingtensor(x):
        x = functorch.get_unwrapped(x)
    return x


def _setup_context(op: CustomOpDef) -> Callable[..., None]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        reg = op._ab.registration
        residuals = reg.current_residuals()
        if residuals is None:
            # The op's output came from elsewhere (a register_vmap rule, a
            # kernel registered by name): fwd runs now for its residuals.
            positional, kwargs = op._split_args(inputs)
            with torch.no_grad():
                _, residuals = run_fwd(op, positional, kwargs)
        leaves, spec = pytree.tree_flatten(residuals)
        tensor_inputs = _tensors(inputs)
        # A residual that is an input (fwd saw it below the levels: unwrapped)
        # is saved as the input this level sees, so it keeps its history.
        as_input = {id(_below_levels(x)): x for x in tensor_inputs}
        at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        computed = False
        for i in at:
            if id(leaves[i]) in as_input:
                leaves[i] = as_input[id(leaves[i])]
            else:
                computed = True
        ctx.save_for_backward(*[leaves[i] for i in at], *tensor_inputs)
        ctx.vjp_record = (spec, [None if i in at else leaf for i, leaf in enumerate(leaves)], at, computed)

    return setup_context


def _tracked_outside(x: torch.Tensor, level: int) -> bool:
    """Is input ``x`` of a node of functorch ``level`` (0: the base) tracked by a differentiation outside it?

    NOTE [Second derivatives through residuals]. In the backward, ``x`` is a
    TensorWrapper of the node's level while that level is alive (its value,
    one level down, then tells), or already the outer level's tensor (the
    node's level has exited, as after ``vjp``); at the base, a tensor that
    requires grad under ``create_graph=True``.
    """
    functorch = torch._C._functorch
    while functorch.is_batchedtensor(x):
        x = functorch.get_unwrapped(x)
    if level > 0 and functorch.is_gradtrackingtensor(x) and functorch.maybe_get_level(x) >= level:
        x = functorch.get_unwrapped(x)
        while functorch.is_batchedtensor(x):
            x = functorch.get_unwrapped(x)
    return functorch.is_gradtrackingtensor(x) or x.requires_grad


def _backward(op: CustomOpDef) -> Callable[..., Any]:
    def backward(ctx: Any, *grads: Any) -> Any:
        spec, leaves, at, computed = ctx.vjp_record
        saved = ctx.saved_tensors
        level = _C._backward_level()
        if computed and torch.is_grad_enabled() and any(_tracked_outside(x, level) for x in saved[len(at) :]):
            raise RuntimeError(
                f"torch_autobatch: {op._qualname} is being differentiated twice (create_graph=True, "
                f"hessian, jacrev(jacrev), grad(grad), jacfwd(jacrev)), through residuals its fwd "
                f"computed below autograd: the second derivative would miss how they depend on the "
                f"inputs, so it is refused. Register the derivative with "
                f"{op._name}.register_autograd(backward, setup_context=...) instead, or return "
                f"only inputs as residuals."
            )
        values = list(leaves)
        for k, i in enumerate(at):
            values[i] = saved[k]
        assert op._ab.vjp_bwd is not None
        return op._ab.vjp_bwd(pytree.tree_unflatten(values, spec), *grads)

    return backward


def register(op: CustomOpDef, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
    """``CustomOpDef.register_vjp``: checks, the rule, and the kernels wrapped to run ``fwd`` on request."""
    for what, f in (("fwd", fwd), ("bwd", bwd)):
        if not callable(f):
            raise TypeError(f"{op._qualname}.register_vjp: expected {what} to be callable, got {type(f).__name__}.")
    if op._backward_fn is not None and op._ab.vjp_fwd is None:
        raise RuntimeError(
            f"{op._qualname}.register_vjp: the op already has a backward from "
            f"register_autograd; an op takes one of register_autograd and register_vjp."
        )
    if op._ab.vjp_fwd is not None:
        op._ab.vjp_fwd, op._ab.vjp_bwd = fwd, bwd  # kernels are wrapped already
        _compile.refresh_cache_key(op)
        return
    _install(op, fwd, bwd)
    for device_type, kernel in list(op._backend_fns.items()):
        torch._library.custom_ops.CustomOpDef.register_kernel(op, device_type, wrap_kernel(op, kernel))
    op._ab.registration.set_has_vjp(True)
    _compile.refresh_cache_key(op)


def _install(op: CustomOpDef, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
    """Makes ``fwd``/``bwd`` the op's reverse-mode rule (``CustomOpDef.register_vjp`` then wraps its kernels)."""
    op._ab.vjp_fwd, op._ab.vjp_bwd = fwd, bwd
    backward, setup_context = _backward(op), _setup_context(op)
    backward.__qualname__ = getattr(bwd, "__qualname__", "bwd")
    op._set_autograd_rule(backward, setup_context)
