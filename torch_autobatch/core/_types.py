"""What lower layers may know of an op: its per-op state, and the attributes they read (:class:`OpBase`).

NOTE [Layers of the package] (docs/design.md): ``core/``, ``vmap/`` and
``graphs/`` are imported by ``op/`` and must not import it back, even for
type hints. They see an op as :class:`OpBase`, which ``op/``'s classes
derive from; :class:`OpExtras` (what we keep per op) lives here so both
sides can name it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    import torch._ops


def no_fast_call(args: tuple[Any, ...]) -> Any:
    """An op without its kernels yet takes the dispatcher's path."""
    return NotImplemented


class OpExtras:
    """What torch_autobatch keeps per op beyond torch's CustomOpDef.

    One slotted attribute rather than several instance attributes: torch's
    vmap copies the op's ``__dict__`` into its wrapper on every ``vmap(op)``
    call (functools.wraps), at ~0.1 us an entry.
    """

    __slots__ = (
        "kwarg_only",
        "positional_grads_ok",
        "num_returns",
        "setup_context_kwonly",
        "jvp_fn",
        "jvp_setup_context_fn",
        "jvp_setup_context_kwonly",
        "registration",
        "inductor_decomposition",
        "vjp_fwd",
        "vjp_bwd",
        "vjp_bwd_takes_needs_input_grad",
        "vjp_checked",
        "vjp_setup_hook",
        "vjp_fwd_is_function",
        "vmap_loop",
        "loop_on_failure",
        "trailing_defaults",
        "vmap_preset",
        "vmapped_companion",
        "_eager_under_compile",
        "gone",
        "guarded",
        "fast_call",
    )

    def __init__(self, kwarg_only: tuple[str, ...], positional_grads_ok: bool, num_returns: int) -> None:
        #: Names of the keyword-only arguments, in schema order.
        self.kwarg_only = kwarg_only
        #: A backward may return gradients for the positional inputs only.
        self.positional_grads_ok = positional_grads_ok
        self.num_returns = num_returns
        #: Does setup_context take ``keyword_only_inputs``?
        self.setup_context_kwonly = False
        self.jvp_fn: Optional[Callable[..., Any]] = None
        self.jvp_setup_context_fn: Optional[Callable[..., Any]] = None
        self.jvp_setup_context_kwonly = False
        self.registration: Any = None  # _C's handle on our kernels' OpState
        #: Its entry in Inductor's table (NOTE [Inductor sees the function]), or None.
        self.inductor_decomposition: Optional[Callable[..., Any]] = None
        #: register_vjp's functions (NOTE [Residuals of register_vjp]), or None.
        self.vjp_fwd: Optional[Callable[..., Any]] = None
        self.vjp_bwd: Optional[Callable[..., Any]] = None
        #: Does ``vjp_bwd`` take ``needs_input_grad=`` (a bool per input)?
        self.vjp_bwd_takes_needs_input_grad = False
        #: The input keys whose fwd output was checked: NOTE [fwd returns what the op returns].
        self.vjp_checked: dict[Any, bool] = {}
        #: Called as ``hook(ctx, output, residuals)`` in register_vjp's setup_context,
        #: or None (a lifted legacy Function's ctx marks: NOTE [Lifting an autograd.Function]).
        self.vjp_setup_hook: Optional[Callable[..., None]] = None
        #: The op's function is fwd's output itself (a lifted legacy Function):
        #: nothing to check (NOTE [fwd returns what the op returns]).
        self.vjp_fwd_is_function = False
        #: vmap="loop": under vmap, register_vjp's fwd runs once per example too
        #: (NOTE [fwd per example under vmap="loop"] in op/_vjp.py).
        self.vmap_loop = False
        #: A call whose function fails on batched tensors runs per example, fwd too
        #: (NOTE [A forward vmap cannot batch runs per example], csrc/batched_kernel.cpp).
        self.loop_on_failure = False
        #: The trailing positional defaults, last first, once known (NOTE
        #: [needs_input_grad counts the arguments passed] in core/_autograd.py).
        self.trailing_defaults: Optional[tuple[Any, ...]] = None
        #: ``vmap="expand_dims"`` / ``"broadcast_all"``, or None (NOTE [vmap presets: the calling convention]).
        self.vmap_preset: Optional[str] = None
        #: vmap(op)'s one node in a graph trace, once defined (NOTE [One node for vmap(op) in a trace]).
        self.vmapped_companion: Any = None
        #: The error a call raises once the op's definition is gone, or None
        #: (NOTE [A redefined op's old object is stale]).
        self.gone: Optional[str] = None
        #: Does a call take the slow path (``eager_under_compile`` or ``gone`` set)?
        self.guarded = False
        #: ``fast_call(args)``: the call without the dispatcher, or NotImplemented
        #: (NOTE [The unbatched call's fast path], csrc/fast_call.cpp).
        self.fast_call: Callable[[tuple[Any, ...]], Any] = no_fast_call
        self._eager_under_compile: Optional[Callable[..., Any]] = None

    @property
    def eager_under_compile(self) -> Optional[Callable[..., Any]]:
        """The op's call, run between compiled graphs where its rules read tensor
        constants, or None (NOTE [A traced rule cannot read a tensor constant])."""
        return self._eager_under_compile

    @eager_under_compile.setter
    def eager_under_compile(self, eager: Optional[Callable[..., Any]]) -> None:
        self._eager_under_compile = eager
        self.guarded = eager is not None or self.gone is not None


class OpBase:
    """What an op (``torch_autobatch.CustomOpDef``) is to the layers below ``op/``: the attributes they read.

    ``op/_kernel_side.py``'s ``KernelSide`` (a base of ``CustomOpDef``) derives from it, so the
    declarations are made once; torch's ``CustomOpDef`` and ours set the attributes.
    """

    _ab: OpExtras
    _qualname: str
    _name: str
    _namespace: str
    _init_fn: Callable[..., Any]
    _opoverload: torch._ops.OpOverload
    _vmap_fn: Optional[Callable[..., Any]]
    _backward_fn: Optional[Callable[..., Any]]
    _setup_context_fn: Optional[Callable[..., Any]]
    _abstract_fn: Optional[Callable[..., Any]]
    _schema: Any  # (torch's CustomOpDef: a FunctionSchema)
    _backend_fns: dict[Any, Callable[..., Any]]

    def _split_args(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Schema-ordered arguments as (positional, keyword-only)."""
        raise NotImplementedError  # KernelSide's


# The names the lower layers annotate an op with.
KernelSide = OpBase
CustomOpDef = OpBase
