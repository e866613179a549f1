"""Forward-mode AD of a torch_autobatch operator: its Python half.

The C++ side (``csrc/forward_mode.cpp``, NOTE [Forward mode]) decides which
rule governs each level and checks every tangent (NOTE [One gate for every
user tangent]); it calls back here, through the op's
``_run_jvp`` / ``_composite_tangents`` (``op/_kernel_side.py``), for the two
ways of computing output tangents: the registered jvp, or forward-mode AD of
the op's own function.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch

from .. import _C
from ..core._autograd import BackwardContext, check_saveable
from ..vmap import _presets as _vmap_presets
from ._rule_tangents import rule_tangents

if TYPE_CHECKING:
    from ._kernel_side import KernelSide


def run_jvp(
    op: KernelSide,
    inputs: tuple[Any, ...],
    outputs: tuple[Any, ...],
    tangents: tuple[Any, ...],
    needs_input_grad: tuple[bool, ...],
) -> tuple[Any, ...]:
    # NOTE [needs_input_grad counts the arguments passed] (core/_autograd.py): as the backward's ctx.
    ctx = BackwardContext(op._needs_as_passed(inputs, needs_input_grad))
    output = outputs[0] if op._ab.num_returns == 1 else outputs
    setup, kwonly = (
        (op._ab.jvp_setup_context_fn, op._ab.jvp_setup_context_kwonly)
        if op._ab.jvp_setup_context_fn is not None
        else (op._setup_context_fn, op._ab.setup_context_kwonly)
    )
    if setup is not None:
        op._call_setup_context(setup, kwonly, ctx, inputs, output)
    result = _call_jvp(op._ab.jvp_fn, ctx, tangents, op)
    # The C++ side checks every tangent (NOTE [One gate for every user
    # tangent] in csrc/forward_mode.cpp).
    result = (result,) if op._ab.num_returns == 1 and not isinstance(result, tuple) else result
    marked = ctx.non_differentiable
    if marked and isinstance(result, tuple):
        # An output setup_context marked non-differentiable has no tangent,
        # whatever the jvp returned for it: as in reverse mode, where it has
        # no gradient (jacfwd == jacrev there too).
        result = tuple(None if any(o is m for m in marked) else t for o, t in zip(outputs, result))
    return result


# NOTE [A jvp reads ctx.saved_for_forward]
# torch's autograd.Function hands its jvp what setup_context gave
# ctx.save_for_forward two ways: as ctx.saved_tensors and as the attribute
# ctx.saved_for_forward itself, and new-style classes written for torch.func
# read either. So the jvp sees both, holding the same tensors for the call's
# duration (under a vmap preset, the tensors the preset peeled: what it sees
# as ctx.saved_tensors); without save_for_forward, saved_for_forward stays
# None, and saved_tensors is what save_for_backward saved.
def _call_jvp(jvp_fn: Any, ctx: BackwardContext, tangents: tuple[Any, ...], op: KernelSide) -> Any:
    """Calls the user's jvp with what setup_context saved for it."""
    for_forward = ctx.saved_for_forward is not None
    saved = ctx.saved_for_forward
    if saved is None:
        saved = ctx.to_save
        check_saveable("save_for_backward", saved or ())
    ctx.to_save = ctx.saved_for_forward = None
    saved = saved if saved is not None else ()
    if for_forward:  # NOTE [A jvp reads ctx.saved_for_forward]
        jvp_fn = _reading_saved_for_forward(jvp_fn)
    if op._ab.vmap_preset is not None:  # NOTE [vmap presets: the calling convention]
        return _vmap_presets.call_jvp(op, jvp_fn, ctx, saved, tangents)
    return _C._call_with_saved_tensors(jvp_fn, ctx, saved, *tangents)


def _reading_saved_for_forward(jvp_fn: Any) -> Callable[..., Any]:
    """``jvp_fn`` with ``ctx.saved_for_forward == ctx.saved_tensors`` for the call (NOTE [A jvp reads ctx.saved_for_forward])."""

    def jvp(ctx: BackwardContext, *tangents: Any) -> Any:
        ctx.saved_for_forward = tuple(ctx.saved_tensors)
        try:
            return jvp_fn(ctx, *tangents)
        finally:
            ctx.saved_for_forward = None

    jvp.__qualname__ = getattr(jvp_fn, "__qualname__", "jvp")
    return jvp


def composite_tangents(
    op: KernelSide, positional: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[Optional[torch.Tensor], ...]:
    """Forward-mode AD of the op's own function on dual inputs: the output tangents.

    Or of its vmap rule, where that made the primal: NOTE [Derived tangents
    differentiate the vmap rule] (op/_rule_tangents.py).
    """
    from_rule = rule_tangents(op, positional, kwargs)
    if from_rule is not None:
        return from_rule
    try:
        out = op._init_fn(*positional, **kwargs)
    except (RuntimeError, NotImplementedError) as e:
        # torch's own errors are exactly these types; a user's exception
        # (even a subclass of them) goes on unchanged.
        if type(e) not in (RuntimeError, NotImplementedError) or not any(
            k in str(e) for k in ("forward", "Forward", "data pointer", "storage")
        ):
            raise
        # torch's message first, as for the plain function.
        raise type(e)(
            f"{e}\ntorch_autobatch: forward-mode AD through {op._qualname} needs the "
            f"forward-mode derivative of its function, which failed (above). "
            + (
                f"Give {lifted.__qualname__} a jvp staticmethod (jvp(ctx, *input_tangents)), "
                f"or register one on its op with {op._name}.register_jvp(jvp)."
                if (lifted := getattr(op._init_fn, "lifted_class", None)) is not None
                else f"Register a jvp with {op._name}.register_jvp(jvp)."
            )
        ) from e
    outs = out if isinstance(out, tuple) else (out,)
    flat = [t for o in outs for t in (o if isinstance(o, list) else (o,))]
    tangents = tuple(_tangent(t) for t in flat)
    if op._ab.vjp_fwd is None and op._setup_context_fn is not None and any(t is not None for t in tangents):
        marked = _marked_non_differentiable(op, positional, kwargs, outs)
        if marked:
            tangents = tuple(None if k in marked else t for k, t in enumerate(tangents))
    if (
        all(t is None for t in tangents)
        and any(_is_differentiable(t) for t in flat)
        and not _outputs_come_from_inputs(op._init_fn, positional, kwargs)
    ):
        raise RuntimeError(
            f"torch_autobatch: forward-mode AD through {op._qualname} got no "
            f"tangent from its function: it is not differentiable in forward mode "
            f"(it leaves torch, e.g. through .numpy(), .item() or .tolist()). "
            f"Returning zeros would be silently wrong. Register a jvp with "
            f"{op._name}.register_jvp(jvp)."
        )
    return tangents


def _primal(t: Any) -> Any:
    return torch.autograd.forward_ad.unpack_dual(t, level=0).primal if isinstance(t, torch.Tensor) else t


def _marked_non_differentiable(
    op: KernelSide, positional: tuple[Any, ...], kwargs: dict[str, Any], outs: tuple[Any, ...]
) -> set[int]:
    """Which of the op's (flat) outputs its setup_context marks non-differentiable."""
    # NOTE [Forward mode honours mark_non_differentiable]: reverse mode gives
    # an output setup_context marks no gradient; forward mode derived from the
    # function must give it no tangent, or jacfwd and jacrev disagree. The
    # marks are the setup_context's, so it runs once on the primal values
    # (forward mode only, and only for ops with register_autograd).
    setup = op._setup_context_fn
    assert setup is not None  # (the caller checked)
    values = _with_defaults(op, positional, kwargs)
    if values is None:
        return set()
    inputs = tuple(_primal(a) for a in values)
    ctx = BackwardContext(tuple(isinstance(a, torch.Tensor) for a in inputs))
    primals = tuple([_primal(t) for t in o] if isinstance(o, list) else _primal(o) for o in outs)
    with torch.no_grad():
        op._call_setup_context(
            setup,
            op._ab.setup_context_kwonly,
            ctx,
            inputs,
            primals[0] if op._ab.num_returns == 1 else primals,
        )
    marked = ctx.non_differentiable or ()
    flat = [t for o in primals for t in (o if isinstance(o, list) else (o,))]
    return {k for k, t in enumerate(flat) if any(t is m for m in marked)}


def _with_defaults(op: KernelSide, positional: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[list[Any]]:
    """Every argument in schema order, as setup_context receives them (torch leaves trailing defaults out).

    None where a default left out is a dtype, layout or memory format: the
    schema keeps those as ints, and setup_context must not see an int.
    """
    values = list(positional)
    for a in op._opoverload._schema.arguments[len(positional) :]:
        if a.kwarg_only and a.name in kwargs:
            values.append(kwargs[a.name])
            continue
        if a.default_value is not None and any(k in str(a.real_type) for k in _ENUM_TYPES):
            return None
        values.append(a.default_value)
    return values


_ENUM_TYPES = ("ScalarType", "Layout", "MemoryFormat")


def _is_differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


class _FromInputs(torch.overrides.TorchFunctionMode):
    """Marks every tensor a torch function computes from the inputs, or from a marked tensor."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.keep = list(inputs)  # ids stay unique while we hold the tensors
        self.marked = {id(t) for t in inputs}

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        flat_in = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and id(t) in self.marked for t in flat_in):
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.keep.append(t)
                    self.marked.add(id(t))
        return out


def _outputs_come_from_inputs(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """NOTE [Zero tangents]: whether ``fn``'s differentiable outputs are computed by
    torch functions from its inputs (through any chain of torch functions).

    Forward-mode AD gives an output no tangent both when it does not depend on
    the inputs' tangents (scatter_reduce's "prod" where the tangent cancels, a
    detach, an integer path: torch's jvp of the plain function gives zeros,
    which is right) and when the function leaves torch (``.numpy()``,
    ``.item()``, ``.tolist()`` and back: zeros would be silently wrong). Run
    again under a TorchFunctionMode that follows values from the inputs, the
    two differ: a value that went through numpy or Python numbers comes back as
    a tensor no torch function computed from an input. Only on the path that
    would otherwise raise.
    """
    inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    mode = _FromInputs(inputs)
    with mode:
        out = fn(*args, **kwargs)
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if _is_differentiable(t)]
    return bool(outs) and all(id(t) in mode.marked for t in outs)


def _tangent(t: Any) -> Optional[torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return None
    return torch.autograd.forward_ad.unpack_dual(t, level=0).tangent
