"""``torch_autobatch.autobatch``: our kernels on an operator that already exists.

NOTE [Upgrading an existing op]
A library the user does not own defines its ops with torch.library. We give
such an op the free batching rule and the honoured rules without redefining
it: its schema, backend kernels, fake kernel and registered rules stay, and
our C++ kernels take the Autograd and FuncTorchBatched keys (the dispatcher
keeps theirs underneath and restores them if ours are dropped).

- A ``torch.library.custom_op`` op: its ``CustomOpDef`` becomes ours in place
  (``__class__`` is our subclass of it, NOTE [CustomOpDef is torch's
  CustomOpDef]), so the backward, setup_context, vmap rule and fake kernel
  registered on it, before or after, are the ones our kernels call, and every
  reference to it (``torch.ops``, the decorated function, torch.library's
  by-name registrations) is the upgraded op.
- An op defined with ``torch.library.Library``: wrapped by a new
  ``CustomOpDef`` that defines nothing. Its kernels are not Python functions
  we can see, so forward mode needs ``register_jvp``; a backward registered
  on it before (``torch.library.register_autograd``) is hidden in its
  Autograd kernel, so that is refused: register it on the returned op.

Refused with a clear error: torch's own operators, schemas whose outputs
alias inputs, CompositeImplicitAutograd ops (they decompose and already work
under every transform), ops without a backend kernel.
"""

from __future__ import annotations

from typing import Any, TypeVar, Union, cast, overload

import torch
from torch._library import custom_ops as _torch_custom_ops
from torch._library import utils as _library_utils

from .core._schema import check_schema
from .graphs import _compile, _subclass
from .lift import _lifted as _lift
from .op._custom_op import CustomOpDef
from .vmap import _presets as _vmap_presets

FunctionClass = TypeVar("FunctionClass", bound=type)
Operator = Union[_torch_custom_ops.CustomOpDef, torch._ops.OpOverload, torch._ops.OpOverloadPacket, str]


def _qualname(op: Any) -> str:
    if isinstance(op, _torch_custom_ops.CustomOpDef):
        return op._qualname
    if isinstance(op, torch._ops.OpOverload):
        if op._overloadname != "default":
            raise ValueError(
                f"torch_autobatch.autobatch({op}): only an operator's default overload can "
                f"be upgraded (operators torch.library.custom_op makes have one)."
            )
        return op._schema.name
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, str) and "::" in op:
        return op
    raise TypeError(
        f"torch_autobatch.autobatch: expected a torch.library CustomOpDef, an operator "
        f"(torch.ops.ns.name or torch.ops.ns.name.default) or its name 'ns::name'; got "
        f"{type(op).__name__}."
    )


def _refuse(qualname: str, why: str) -> None:
    raise ValueError(f"torch_autobatch.autobatch({qualname!r}): {why}")


@overload
def autobatch(op: FunctionClass, /, *, vmap: str = "auto", compile: str = "fuse") -> FunctionClass: ...
@overload
def autobatch(
    op: Operator, /, *, vmap: str = "auto", compile: str = "fuse", subclasses: str = "decompose"
) -> CustomOpDef: ...
def autobatch(op: Any, /, *, vmap: str = "auto", compile: str = "fuse", subclasses: str = "decompose") -> Any:
    """Gives an existing operator torch_autobatch's kernels, in place; returns it as a :class:`CustomOpDef`.

    For an operator made with :func:`torch.library.custom_op` (say, by a
    library you do not own), or defined with ``torch.library.Library`` with
    a backend kernel made of torch ops: from then on it runs once, batched,
    under ``vmap``, and works under every torch.func transform with the
    rules registered on it (``register_autograd``, ``register_vmap``,
    ``register_fake``), before or after this call::

        >>> @torch.library.custom_op("doc_autobatch::softclip", mutates_args=())
        ... def softclip(x: torch.Tensor) -> torch.Tensor:
        ...     return torch.tanh(x)
        >>> softclip.register_autograd(
        ...     lambda ctx, g: g * (1 - torch.tanh(ctx.x) ** 2),
        ...     setup_context=lambda ctx, inputs, output: setattr(ctx, "x", inputs[0]))
        >>> op = torch_autobatch.autobatch(softclip)  # or torch.ops.doc_autobatch.softclip
        >>> op is softclip, isinstance(op, torch_autobatch.CustomOpDef)
        (True, True)
        >>> torch.func.grad(lambda x: softclip(x).sum())(torch.zeros(3))
        tensor([1., 1., 1.])

    Args:
        op: the operator: its ``CustomOpDef``, ``torch.ops.ns.name`` (or its
            ``.default``), or ``"ns::name"``.
        vmap: as in :func:`custom_op`: ``"auto"``, ``"loop"`` (``"sequential"``),
            ``"expand_dims"`` or ``"broadcast_all"``.
        compile: as in :func:`custom_op`: ``"fuse"`` or ``"opaque"``.
        subclasses: as in :func:`custom_op`: ``"decompose"`` or ``"whole"``
            (for an operator; a lifted ``autograd.Function`` always
            decomposes on subclasses, as the Function ran on them).
    """
    _subclass.check_mode("torch_autobatch.autobatch", subclasses)
    if isinstance(op, type) and issubclass(op, torch.autograd.Function):
        if subclasses != "decompose":
            raise ValueError(
                "torch_autobatch.autobatch: subclasses='whole' is for operators, not an autograd.Function."
            )
        return _lift.autobatch_function(op, vmap=vmap, compile=compile)  # NOTE [Lifting in place]
    vmap = _vmap_presets.normalize("torch_autobatch.autobatch", vmap)
    if compile not in _compile.COMPILE_MODES:
        raise ValueError(f"torch_autobatch.autobatch: compile must be 'fuse' or 'opaque', got {compile!r}.")
    qualname = _qualname(op)
    opdef = _torch_custom_ops._maybe_get_opdef(qualname)
    if isinstance(opdef, CustomOpDef):
        return opdef  # already ours
    namespace, name = qualname.split("::", 1)
    if namespace in ("aten", "prim", "prims"):
        _refuse(qualname, "torch's own operators have batching rules and derivatives already.")
    try:
        overload = _library_utils.lookup_op(qualname)
    except (AttributeError, RuntimeError):
        _refuse(qualname, "no such operator; define it first (torch.library.custom_op).")
    schema = str(overload._schema)[len(qualname) :]
    check_schema(qualname, schema)
    if opdef is not None:
        # torch's pyobj fast path (torch >= 2.14) is for torch's kernels: go
        # through the dispatcher, where ours now are.
        if getattr(opdef._opoverload, "_is_pyobj_dispatcher_enabled", lambda: False)():
            opdef._opoverload._enable_pyobj_dispatch(False)  # type: ignore[attr-defined]  # torch >= 2.14
        opdef.__class__ = CustomOpDef
        ours = cast(CustomOpDef, opdef)
        ours._install(vmap, compile)
        _subclass.set_mode(ours, subclasses)
        return ours

    _check_library_op(qualname)

    def kernel_not_visible(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"torch_autobatch: {qualname}'s kernel is not a Python function torch_autobatch "
            f"can run for forward-mode AD. Register a jvp with "
            f"torch_autobatch.autobatch(...).register_jvp(jvp)."
        )

    kernel_not_visible.__qualname__ = name
    made = CustomOpDef(namespace, name, schema, kernel_not_visible, None, vmap, define=False, compile=compile)
    _subclass.set_mode(made, subclasses)
    return made


def _check_library_op(qualname: str) -> None:
    """Refuses a ``torch.library.Library`` op whose kernels we could not stand in for."""
    has = lambda key: torch._C._dispatch_has_kernel_for_dispatch_key(qualname, key)  # noqa: E731
    if has("CompositeImplicitAutograd"):
        _refuse(
            qualname,
            "it is CompositeImplicitAutograd: it decomposes into torch ops, which "
            "already work under every torch.func transform.",
        )
    if not any(has(k) for k in ("CompositeExplicitAutograd", "CPU", "CUDA")):
        _refuse(
            qualname,
            "it has no backend kernel (CompositeExplicitAutograd, CPU or CUDA) for torch_autobatch to run batched.",
        )
    if has("Autograd") or has("AutogradCPU") or has("AutogradCUDA"):
        _refuse(
            qualname,
            "it has an Autograd kernel whose backward torch_autobatch cannot see. "
            "Upgrade the op before registering its backward, and register it on "
            "the op autobatch returns (or define the op with torch.library.custom_op).",
        )
