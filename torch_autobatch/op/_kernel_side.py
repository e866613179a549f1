"""The Python half of each C++ kernel: the methods csrc/ calls on an op.

NOTE [The Python side of the kernels] (csrc/python_interop.h) lists every
name the C++ looks up; ``_C._python_side_names()`` returns them with the
number of arguments each call passes, and test_contract.py checks that
:class:`KernelSide` defines exactly those methods with those signatures, so a
rename on either side fails a test rather than a kernel at run time.
:class:`torch_autobatch.CustomOpDef` inherits them; nothing here is public.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch._functorch.autograd_function import custom_function_call_vmap_helper
from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter
from torch._library import utils as _library_utils

from ..core import _closure
from ..core._autograd import BackwardContext, num_passed, trailing_defaults
from ..core._types import OpBase
from ..graphs import _compile
from ..vmap import _presets as _vmap_presets
from ..vmap import _traced as _traced_vmap
from ..vmap._check import checked_rule
from . import _forward_mode, _vjp

if TYPE_CHECKING:
    import torch._ops

_is_compiling = torch.compiler.is_compiling


def fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def takes_keyword_only_inputs(setup_context: Optional[Callable[..., Any]]) -> bool:
    """Is ``setup_context`` torch.library's 4-argument form for ops with keyword-only args?

    ``setup_context(ctx, inputs, keyword_only_inputs, output)``; otherwise
    ``setup_context(ctx, inputs, output)`` with ``inputs`` holding every argument.
    """
    if setup_context is None:
        return False
    try:
        inspect.signature(setup_context).bind(None, (), {}, None)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): torch.library's rule
        return True
    return True


# NOTE [A redefined op's old object is stale]
# torch.library lets an op's name be defined again: custom_op destroys the old
# definition's Library, and the dispatcher frees the old operator entry once
# nothing is registered on it. The old op object, and every OpOverload taken
# from it, still points there: torch.library.custom_op's own object, called
# after a redefinition, reads freed memory (a segfault, or garbage in an
# error). Ours learns that its definition is gone from the teardown that
# deregisters our kernels (NOTE [Kernels die with their op]), and from then on
# every way a call of ours reaches the dispatcher through it raises a clear
# error naming the op and what to call instead: the op's __call__ (so
# vmap(op), grad(op), ...), a lifted class's cached overloads (lift/_lifted.py), and
# the companion of a graph recorded before the redefinition (vmap/_traced.py).
# Registering a rule on the old object raises the same error (the rule would
# reach no operator). An OpOverload the user keeps (torch.ops.ns.name.default across a
# redefinition) is torch's, with torch's behaviour.
def mark_gone(op: KernelSide) -> None:
    """The op's definition is gone: calls of this object raise from now on."""
    namespace, name = op._qualname.split("::")
    lifted = getattr(op._init_fn, "lifted_class", None)
    what = f" (lifting {lifted.__qualname__}.apply)" if lifted is not None else ""
    op._ab.gone = (
        f"torch_autobatch: this object of the operator {op._qualname}{what} is stale: the operator was defined "
        f"again, or the torch.library.Library that defined it was destroyed, after the object was made. torch "
        f"frees the old definition, so the object cannot call it any more. Call the object the new definition "
        f"returned, or torch.ops.{namespace}.{name}; do not define two operators of one name in one process."
    )
    op._ab.guarded = True

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(op._ab.gone)

    for method in _REGISTRATIONS:  # instance attributes: they shadow the methods on this object only
        setattr(op, method, refuse)


_REGISTRATIONS: tuple[str, ...] = (
    "register_autograd",
    "register_fake",
    "register_kernel",
    "register_vjp",
    "register_jvp",
    "register_vmap",
    "register_autocast",
    "register_torch_dispatch",
    "set_kernel_enabled",
)


def check_live(op: KernelSide) -> None:
    """Raises if the op's definition is gone (NOTE [A redefined op's old object is stale])."""
    if op._ab.gone is not None:
        raise RuntimeError(op._ab.gone)


class KernelSide(OpBase):
    """The methods our C++ kernels call on an op (NOTE [The Python side of the kernels]).

    A mixin of :class:`torch_autobatch.CustomOpDef`, which provides the
    attributes :class:`OpBase` declares (torch's ``CustomOpDef`` and ours).
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the op (as torch's ``CustomOpDef``); under torch.compile between graphs where its rules read constants."""
        ab = self._ab
        if ab.guarded:  # one flag for the cases below: the common call reads nothing else
            check_live(self)  # NOTE [A redefined op's old object is stale]
            eager = ab.eager_under_compile
            # NOTE [A traced rule cannot read a tensor constant] (export traces no rule)
            if eager is not None and torch.compiler.is_compiling() and not torch.compiler.is_exporting():
                return eager(*args, **kwargs)
        elif not kwargs and not _is_compiling():  # Dynamo traces the op whole
            out = ab.fast_call(args)  # NOTE [The unbatched call's fast path] (csrc/fast_call.cpp)
            if out is not NotImplemented:
                return out
        return self._opoverload(*args, **kwargs)

    def _split_args(self, args: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Schema-ordered arguments as (positional, keyword-only)."""
        n = len(args) - len(self._ab.kwarg_only)
        return args[:n], dict(zip(self._ab.kwarg_only, args[n:]))

    def _run_vmap_rule(self, positional: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The register_vmap rule on the batched arguments, by torch's helper; one value per return."""
        # Called by the batched kernel with a vmap level on top, and only
        # when register_vmap set the rule (VmapMode.rule).
        if self._vmap_fn is None:  # NOTE [vmap presets: the calling convention]
            return _vmap_presets.run_forward(self, positional, kwargs)
        interpreter = retrieve_current_functorch_interpreter()
        out = custom_function_call_vmap_helper(
            interpreter,  # type: ignore[arg-type]  # a VmapInterpreter here
            functools.partial(checked_rule, self._qualname, self._vmap_fn),  # NOTE [A vmap rule's return is checked]
            self._opoverload,
            *positional,
            **kwargs,
        )
        return (out,) if self._ab.num_returns == 1 else tuple(out)

    def _dissolves_in_trace(self) -> bool:
        """Vmap under a graph tracer: may the op's function stand for it (NOTE [A trace keeps the op])?"""
        # A preset calls the op itself, once per level: the trace keeps it.
        preset = self._ab.vmap_preset is not None and self._vmap_fn is None
        # Inside a vmapped companion's own function or rules, the op is what they are made of.
        if preset or _traced_vmap.inside_rules() or _compile.dissolves_in_trace(self._opoverload):
            return True
        # NOTE [AOTAutograd traces vmap(op) as eager runs it]
        return not self._ab.vmap_loop and _compile.traced_by_aot_autograd()

    def _run_vmapped_companion(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """vmap of the op under a graph tracer as one node (NOTE [One node for vmap(op) in a trace]); one value per return."""
        return _traced_vmap.run(self, args)

    def _check_aliasing(self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any) -> None:
        """torch.library's aliasing check, as its backend kernel runs it (NOTE [Calling the composite directly])."""
        check = getattr(_library_utils, "_c_check_aliasing_constraint", None)
        if check is not None:
            check(self._name, args, kwargs, result, lambda: inspect.getmodule(self._init_fn))

    def _call_setup_context(
        self,
        setup: Callable[..., Any],
        kwonly_form: bool,
        ctx: BackwardContext,
        inputs: tuple[Any, ...],
        output: Any,
    ) -> None:
        try:
            if kwonly_form:
                positional, kwargs = self._split_args(inputs)
                setup(ctx, positional, kwargs, output)
            else:
                setup(ctx, inputs, output)
        except AttributeError as e:
            self._reraise_assigned_saved_tensors(e, setup, ctx)
            raise
        if ctx.dirty_tensors:
            self._reject_dirty(setup)

    def _reject_dirty(self, setup: Callable[..., Any]) -> None:
        raise RuntimeError(
            f"torch_autobatch: the setup_context of {self._qualname} "
            f"({fn_name(setup)}) called ctx.mark_dirty, but {self._qualname} "
            f"mutates no input (mutates_args=()). Return new tensors instead."
        )

    def _reraise_assigned_saved_tensors(
        self, e: AttributeError, setup: Callable[..., Any], ctx: BackwardContext
    ) -> None:
        """ctx.saved_tensors is read-only (its descriptor raised ``e``): say so, naming the op."""
        if getattr(e, "name", None) == "saved_tensors" and getattr(e, "obj", None) is ctx:
            raise AttributeError(
                f"torch_autobatch: the setup_context of {self._qualname} "
                f"({fn_name(setup)}) assigned ctx.saved_tensors, which is read-only. "
                f"Call ctx.save_for_backward(*tensors) instead."
            ) from None

    # NOTE [The per-call Python of a grad node]
    # _setup_autograd (forward) and _run_backward (backward) are the only
    # Python our Autograd kernel and grad node run around the user's
    # functions: two frames forward (_setup_autograd, _call_setup_context:
    # one home for setup_context's checks, on every path), one backward; the
    # saved tensors come from C (NOTE [Saved tensors belong to the call]).
    # Six frames less (ctx.__init__, the save_for_backward override and its
    # check, the saved_tensors property, two helpers) took 2.6% of the
    # instructions off a small op's forward + backward
    # (benchmarks/bench_instructions.py).
    def _setup_autograd(
        self, inputs: tuple[Any, ...], output: Any, needs_input_grad: tuple[bool, ...]
    ) -> BackwardContext:
        ctx = object.__new__(BackwardContext)
        defaults = self._ab.trailing_defaults
        if defaults is None or defaults:  # NOTE [needs_input_grad counts the arguments passed]
            needs_input_grad = self._needs_as_passed(inputs, needs_input_grad)
        ctx.needs_input_grad = needs_input_grad
        setup = self._setup_context_fn
        if setup is not None:
            self._call_setup_context(setup, self._ab.setup_context_kwonly, ctx, inputs, output)
        return ctx

    def _needs_as_passed(self, inputs: tuple[Any, ...], needs_input_grad: tuple[bool, ...]) -> tuple[bool, ...]:
        """``needs_input_grad`` as torch.library sizes it (NOTE [needs_input_grad counts the arguments passed])."""
        ab = self._ab
        if ab.trailing_defaults is None:
            ab.trailing_defaults = trailing_defaults(self._opoverload._schema)
        if not ab.trailing_defaults or ab.vjp_fwd is not None:
            return needs_input_grad
        return needs_input_grad[: num_passed(inputs, ab.trailing_defaults)]

    def _run_backward(self, ctx: BackwardContext, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """Calls the user's backward; the C++ node checks what it returns.

        The node has made its saved tensors ``ctx.saved_tensors`` for this
        call (NOTE [Saved tensors belong to the call] in csrc/grad_node.cpp).
        As torch.library allows, a backward may return one gradient per
        positional input only (keyword-only inputs then get None), or one per
        entry of ``ctx.needs_input_grad`` or more (the inputs left to their
        defaults then get None: NOTE [needs_input_grad counts the arguments passed]).
        """
        backward = self._backward_fn
        if backward is None:
            raise RuntimeError(
                f"torch_autobatch: {self._qualname} has no backward. Register one with "
                f"{self._name}.register_autograd(backward, setup_context=setup_context) "
                f"to differentiate through it."
            )
        try:
            if self._ab.vmap_preset is None:
                result = backward(ctx, *grads)
            else:  # NOTE [vmap presets: the calling convention]
                result = _vmap_presets.call_backward(self, backward, ctx, grads)
        except AssertionError as e:  # NOTE [A traced rule cannot read a tensor constant]
            _closure.explain_fake_refusal(self._qualname, "backward", (backward, self._ab.vjp_bwd), e)
            raise
        if not isinstance(result, tuple):
            result = (result,)
        kwarg_only = self._ab.kwarg_only
        if kwarg_only and self._ab.positional_grads_ok and len(result) == len(ctx.needs_input_grad) - len(kwarg_only):
            result += (None,) * len(kwarg_only)
        elif self._ab.trailing_defaults and len(ctx.needs_input_grad) <= len(result) < (
            n := len(self._opoverload._schema.arguments)
        ):
            result += (None,) * (n - len(result))
        return result

    def _verify_vjp_fwd(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], result: Any, check: bool, keyed: bool
    ) -> None:
        """Raises if register_vjp's fwd returned what the op does not (C++ could not tell: ``_vjp.verify``)."""
        _vjp.verify(self, args, kwargs, result, check=check, keyed=keyed)  # type: ignore[arg-type]  # a CustomOpDef

    @property
    def _backward_fn_name(self) -> str:
        return fn_name(self._backward_fn)

    @property
    def _jvp_fn_name(self) -> str:
        return fn_name(self._ab.jvp_fn)

    def _run_jvp(
        self,
        inputs: tuple[Any, ...],
        outputs: tuple[Any, ...],
        tangents: tuple[Any, ...],
        needs_input_grad: tuple[bool, ...],
    ) -> tuple[Any, ...]:
        """The registered jvp's output tangents, one per output (``_forward_mode.run_jvp``)."""
        return _forward_mode.run_jvp(self, inputs, outputs, tangents, needs_input_grad)

    def _composite_tangents(
        self, positional: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Optional[torch.Tensor], ...]:
        """The output tangents from the function's own forward-mode AD (``_forward_mode.composite_tangents``)."""
        return _forward_mode.composite_tangents(self, positional, kwargs)
