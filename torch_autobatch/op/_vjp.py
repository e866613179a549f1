"""``register_vjp(fwd, bwd)``: a backward that receives the forward's intermediates.

NOTE [Residuals of register_vjp] (csrc/op_state.h) is the C++ half: a kernel
of ours that is about to make the op's grad node opens a thread-local request
for the call; whatever runs the op below it (the backend function wrapped
here, Inductor's decomposition) takes the request, runs ``fwd`` instead of
the function, and answers it with the residuals. The op's internal
``setup_context`` reads them back (where nothing answered, as under a
register_vmap rule or the fake kernel, it runs ``fwd`` for them), saves their tensors with
``save_for_backward`` (so they are version-checked, seen by
``saved_tensors_hooks``, batched per level under vmap, and freed with the
graph), and the internal backward rebuilds the residuals for ``bwd``.

NOTE [Second derivatives through residuals]
A residual computed by ``fwd`` (``t = tanh(x)``) is a function of the inputs,
but it was computed below autograd, so it has no history: differentiating
``bwd``'s result again through it would miss d(residual)/d(input) and be
silently wrong (autograd.Function's trap for intermediates saved in
``forward``). So when the backward runs with grad mode on (``create_graph=True``,
or a torch.func level) and an input is tracked by a differentiation that can
differentiate this backward, it runs ``fwd`` again on the inputs it saved,
recorded, and hands ``bwd`` those residuals: the second derivative is
``bwd``'s derivative through ``fwd``, as JAX's ``custom_vjp`` gives. Those
differentiations are: at the base, autograd (the input requires grad); under
torch.func, a transform outside the node's level (the input, one grad level
down, is still tracked); and the node's own level while it is alive, when
the backward keeps its graph (``torch.autograd.grad(..., create_graph=True)``
inside ``torch.func.grad``: the result is differentiated again at that level).
torch.func's own last backward of a level keeps no graph (``retain_graph=False``)
and the level then exits, so ``grad``, ``vmap(grad)`` and ``jacrev`` (whose
level has exited when its pullback runs) never rerun ``fwd``: first derivatives
never pay for it. Residuals that are inputs themselves (``w`` passed through)
carry their own history anyway.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from .. import _C
from ..core import _closure
from ..core._per_example import RandomState, per_example
from ..graphs import _compile
from ..vmap import _presets as _vmap_presets
from . import _sac
from ._vjp_check import check_fwd_output, forget_checks, fwd_name

if TYPE_CHECKING:
    from ._custom_op import CustomOpDef

__all__ = ["register", "wrap_kernel"]


def run_fwd(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any], *, check: bool = True) -> tuple[Any, Any]:
    """``fwd(*args, **kwargs)``, checked (NOTE [fwd returns what the op returns]): the op's output and the residuals."""
    # C++ (Registration.run_fwd) calls fwd and verifies its result's
    # structure and, for arguments whose output was checked before, its
    # output; anything else it hands to ``verify``.
    try:
        return op._ab.registration.run_fwd(op._ab.vjp_fwd, args, kwargs, check)
    except AssertionError as e:  # NOTE [A traced rule cannot read a tensor constant]
        _closure.explain_fake_refusal(op._qualname, "register_vjp fwd", (op._ab.vjp_fwd,), e)
        raise


def verify(
    op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, *, check: bool, keyed: bool
) -> None:
    """Raises if ``result`` (fwd's) is not (output, residuals) with the op's output (with ``check``: its metadata).

    ``keyed``: C++ has a key for these arguments, and records it as checked
    when this returns (NOTE [fwd returns what the op returns]).
    """
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"torch_autobatch: the fwd of {op._qualname} ({fwd_name(op)}) must return "
            f"(output, residuals), a tuple of two; it returned {type(result).__name__}"
            f"{'' if not isinstance(result, tuple) else f' of {len(result)}'}."
        )
    out = result[0]
    n = op._ab.num_returns
    outs = (out,) if n == 1 else out
    if not isinstance(outs, tuple) or len(outs) != n:
        raise TypeError(
            f"torch_autobatch: the fwd of {op._qualname} ({fwd_name(op)}) returned an output "
            f"of structure {pytree.tree_structure(out)}, but the op returns {n} value(s) "
            f"({op._opoverload._schema.returns}). Return them as the op's function does."
        )
    if check and not op._ab.vjp_fwd_is_function:
        check_fwd_output(op, args, kwargs, outs, keyed=keyed)


def wrap_kernel(op: CustomOpDef, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as the op's backend kernel: ``fwd`` instead where a kernel of ours asked for the op's residuals."""
    ab = op._ab

    def kernel(*args: Any, **kwargs: Any) -> Any:
        # NOTE [Residuals of register_vjp]: (output,) when fwd ran for a request.
        answered = ab.registration.answer_residual_request(ab.vjp_fwd, args, kwargs)
        return fn(*args, **kwargs) if answered is None else answered[0]

    kernel.__qualname__ = getattr(fn, "__qualname__", "kernel")
    kernel.__name__ = getattr(fn, "__name__", "kernel")
    return kernel


def _setup_context(op: CustomOpDef) -> Callable[..., None]:
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        answered = op._ab.registration.current_residuals()
        if torch._C._len_torch_dispatch_stack():  # NOTE [Selective checkpointing of register_vjp ops]
            answered = _sac.residuals(op, inputs, answered)
        if op._ab.vmap_preset is not None and op._vmap_fn is None:
            # fwd is opaque too (NOTE [vmap presets: the calling convention]).
            residuals = _vmap_presets.vjp_residuals(op, inputs, answered)
        elif answered is not None:
            (residuals,) = answered
        else:
            # The op's output came from elsewhere (a register_vmap rule, the
            # fake kernel, a kernel registered by name): fwd runs now.
            positional, kwargs = op._split_args(inputs)
            with torch.no_grad():
                if op._ab.vmap_loop:
                    residuals = _residuals_per_example(op, positional, kwargs)
                else:
                    residuals = _fwd_or_per_example(op, positional, kwargs)
        # The tensor inputs are saved too, for a backward that is itself
        # differentiated (NOTE [Second derivatives through residuals]); a
        # residual that is an input (fwd saw it below the levels) shares the
        # input's slot, so it is saved once and keeps its history. ctx keeps
        # the call's _VjpCall (how to rebuild both); setting to_save is what
        # save_for_backward does, a frame less.
        ctx.to_save, ctx.vjp_call = _C._vjp_save(inputs, residuals)
        hook = op._ab.vjp_setup_hook
        if hook is not None:
            hook(ctx, output, residuals)

    return setup_context


def _backward(op: CustomOpDef) -> Callable[..., Any]:
    ab = op._ab

    def backward(ctx: Any, *grads: Any) -> Any:
        saved, call = ctx.saved_tensors, ctx.vjp_call
        rebuilt = call.residuals(saved)
        if rebuilt is not None:
            (residuals,) = rebuilt
        else:  # NOTE [Second derivatives through residuals]
            residuals = _residuals_with_history(op, call.inputs(saved))
        assert ab.vjp_bwd is not None
        if ab.vjp_bwd_takes_needs_input_grad:
            return ab.vjp_bwd(residuals, *grads, needs_input_grad=ctx.needs_input_grad)
        return ab.vjp_bwd(residuals, *grads)

    return backward


def _residuals_per_example(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fwd``'s residuals for a batched call of a vmap="loop" op: fwd once per example, residuals stacked.

    NOTE [fwd per example under vmap="loop"]
    A vmap="loop" op's function cannot run on batched tensors (it leaves
    torch), and neither can its register_vjp ``fwd``. Where setup_context
    must run fwd itself (the loop answered no residual request), it runs it
    the way the loop ran the function: per example (NOTE [Once per example,
    in Python] in core/_per_example.py). A Python value in the residuals must be
    the same for every example (it cannot be batched).
    """
    return per_example(lambda a, k: run_fwd(op, a, k)[1], (args, kwargs), f"the fwd of {op._qualname} ({fwd_name(op)})")


def _fwd_or_per_example(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``fwd``'s residuals; per example where the op loops because its function could not run batched.

    NOTE [A forward vmap cannot batch runs per example] (csrc/batched_kernel.cpp):
    fwd fails on batched tensors as the function did.
    """
    try:
        return run_fwd(op, args, kwargs)[1]
    except (RuntimeError, NotImplementedError) as e:
        if not op._ab.loop_on_failure or type(e) not in (RuntimeError, NotImplementedError) or "randomness" in str(e):
            raise
    # (with no batched argument, fwd runs once more and raises as above)
    return _residuals_per_example(op, args, kwargs)


def _residuals_with_history(op: CustomOpDef, inputs: tuple[Any, ...]) -> Any:
    """``fwd`` run again on the inputs this backward sees, recorded: residuals that are functions of them.

    NOTE [Second derivatives through residuals]: only when the backward is
    itself differentiated w.r.t. the inputs, so first derivatives never pay.
    """
    positional, kwargs = op._split_args(inputs)
    leaves = pytree.tree_leaves(inputs)
    before = RandomState(leaves)
    with torch.enable_grad():
        try:
            _, residuals = run_fwd(op, positional, kwargs, check=False)  # checked when it first ran
        except (RuntimeError, NotImplementedError) as e:
            # NOTE [A forward vmap cannot batch runs per example]: fwd fails on batched tensors as the
            # function did; once per example, its residuals keep their history at the base
            loops = op._ab.loop_on_failure or op._ab.vmap_loop  # NOTE [fwd per example under vmap="loop"]
            if type(e) is RuntimeError and str(e).startswith(_DREW_IN_ERROR_MODE):
                # (under a vmap with randomness="error": jacrev's own, inside hessian)
                raise _draws_again(op) from e
            if not loops or type(e) not in (RuntimeError, NotImplementedError) or "randomness" in str(e):
                raise
            residuals = _residuals_per_example(op, positional, kwargs)
    if before.changed(leaves):
        # NOTE [Second derivatives through residuals]: the rerun is fwd's forward again; one that
        # drew random numbers differentiates other draws than the forward's (a silent wrong value)
        before.restore()
        raise _draws_again(op)
    return residuals


_DREW_IN_ERROR_MODE = "vmap: called random operation while in randomness error mode"


def _draws_again(op: CustomOpDef) -> RuntimeError:
    return RuntimeError(
        f"torch_autobatch: the fwd of {op._qualname} ({fwd_name(op)}) draws random numbers, and its "
        f"backward is being differentiated again (create_graph=True, grad(grad), hessian, jacrev(jacrev)), "
        f"which runs fwd again to give its residuals their history: it would draw other numbers than "
        f"the forward did, and the derivative would belong to them. Draw the random numbers outside the "
        f"op and pass them to it as an argument, or take first derivatives only."
    )


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
    op._ab.vjp_bwd_takes_needs_input_grad = _takes_keyword(bwd, "needs_input_grad")
    forget_checks(op)  # a new fwd is checked anew
    if op._ab.vjp_fwd is not None:
        op._ab.vjp_fwd, op._ab.vjp_bwd = fwd, bwd  # kernels are wrapped already
        _compile.refresh_cache_key(op)
        return
    _install(op, fwd, bwd)
    for device_type, kernel in list(op._backend_fns.items()):
        # torch's wrapper of a registered kernel is torch._disable_dynamo
        # around the set_kernel_enabled check around the function; the kernel
        # registered now gets the same wrapper, which governs (NOTE [Calling
        # the composite directly], csrc/run_backend.cpp). Inside it, a second
        # _disable_dynamo would only cost a call that runs the function (~6k
        # instructions: every call that differentiates nothing).
        inner = getattr(kernel, "__wrapped__", kernel)
        torch._library.custom_ops.CustomOpDef.register_kernel(op, device_type, wrap_kernel(op, inner))
    op._ab.registration.set_has_vjp(True)
    _closure.refresh(op)  # NOTE [What the function closes over]
    _compile.refresh_cache_key(op)


def _takes_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Does ``fn`` declare a parameter ``name`` that can be passed by keyword?"""
    try:
        param = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return param is not None and param.kind in (param.KEYWORD_ONLY, param.POSITIONAL_OR_KEYWORD)


def _install(op: CustomOpDef, fwd: Callable[..., Any], bwd: Callable[..., Any]) -> None:
    """Makes ``fwd``/``bwd`` the op's reverse-mode rule (``CustomOpDef.register_vjp`` then wraps its kernels)."""
    op._ab.vjp_fwd, op._ab.vjp_bwd = fwd, bwd
    backward, setup_context = _backward(op), _setup_context(op)
    backward.__qualname__ = getattr(bwd, "__qualname__", "bwd")
    op._set_autograd_rule(backward, setup_context)
