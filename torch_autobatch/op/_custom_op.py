"""``torch_autobatch.custom_op``: a Python function as a real dispatcher operator.

Dispatch keys of an operator made here (see NOTE [Why our own Autograd kernel]
in csrc/autograd_kernel.cpp):

- backend (``CompositeExplicitAutograd``, or the device keys of
  ``device_types`` / ``register_kernel``): the user's Python function;
- ``Meta`` / fake: ``register_fake``'s function, or by default the user's
  function itself run on fake tensors;
- ``Autograd``: our C++ kernel, which runs the backend once below autograd,
  attaches a grad node calling the registered backward, and sets output
  tangents in forward mode (NOTE [Forward mode] in csrc/forward_mode.cpp);
- ``FuncTorchBatched``: our C++ kernel, which runs the function once on
  batched tensors and attaches the grad nodes at every level below
  (NOTE [Free batching rule] in csrc/batched_kernel.cpp).

The private methods at the end are the Python half of those kernels.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional, TypeVar, Union, overload

import torch
from torch._library import custom_ops as _torch_custom_ops
from torch._library import simple_registry
from torch._library import utils as _library_utils

from .. import _C
from ..core import _closure, _warn
from ..core._op_identity import OpIdentity
from ..core._schema import schema_of
from ..core._types import OpExtras
from ..core._warn import user_source as _user_source
from ..graphs import _compile, _subclass
from ..vmap import _presets as _vmap_presets
from . import _vjp, _vjp_check
from ._kernel_side import KernelSide, mark_gone, takes_keyword_only_inputs

F = TypeVar("F", bound=Callable[..., Any])
DeviceTypes = Optional[Union[str, Sequence[str]]]


def _undo_registration(qualname: str, op: Any) -> None:
    """A definition that failed halfway leaves nothing registered (torch's kernels, nor ours)."""
    extras = getattr(op, "_ab", None)
    if extras is not None and extras.registration is not None:
        extras.registration.destroy()
    lib = _torch_custom_ops.OPDEF_TO_LIB.get(qualname)
    if lib is not None and lib is getattr(op, "_lib", object()):
        lib._destroy()
        del _torch_custom_ops.OPDEF_TO_LIB[qualname]
    if _torch_custom_ops.OPDEFS.get(qualname) is op:
        del _torch_custom_ops.OPDEFS[qualname]


# NOTE [CustomOpDef is torch's CustomOpDef]
# torch_autobatch.CustomOpDef subclasses torch._library.custom_ops.CustomOpDef
# rather than rewriting its surface, because most of torch.library's contract
# lives in that class or keys off it:
# - torch.library.register_autograd / register_fake / register_vmap /
#   register_kernel / register_autocast / register_torch_dispatch("ns::name")
#   find the op in custom_ops.OPDEFS and call its method (ours, when we
#   override it), so no registration by name can bypass our kernels;
# - torch.library.opcheck and torch.compile accept it as a CustomOpDef;
# - register_kernel, set_kernel_enabled, register_fake, register_autocast,
#   register_torch_dispatch, register_effect are torch's own and keep up with it.
# What we override is exactly what makes the op ours: the Autograd kernel is
# C++ (_register_autograd_dispatcher_impl registers nothing; _C._register_op
# installs ours at Autograd and FuncTorchBatched), register_vmap stores the
# rule for our batched kernel instead of registering torch's Python one, the
# fake kernel defaults to the op's own function, keyword-only tensors are
# allowed, and register_autograd/register_jvp accept our extra forms.
class CustomOpDef(KernelSide, OpIdentity, _torch_custom_ops.CustomOpDef):  # NOTE [An op is a global]
    """An operator made by :func:`custom_op`; call it like the function it wraps.

    It is the same operator as ``torch.ops.<namespace>.<name>``: calling either
    goes through the dispatcher, so every torch.func transform, ``torch.compile``
    and ``torch.library.opcheck`` see one operator, never its decomposition.
    A subclass of torch.library's ``CustomOpDef`` (NOTE [CustomOpDef is torch's
    CustomOpDef]): everything torch.library accepts for one of its ops, it
    accepts for this one.

    Example::

        >>> @torch_autobatch.custom_op("doc_CustomOpDef::double", mutates_args=())
        ... def double(x: torch.Tensor) -> torch.Tensor:
        ...     return 2 * x
        >>> double
        <torch_autobatch.CustomOpDef(doc_CustomOpDef::double(Tensor x) -> Tensor)>
        >>> isinstance(double, torch.library.CustomOpDef)
        True
        >>> double(torch.tensor([1.0, 2.0])), torch.ops.doc_CustomOpDef.double(torch.ones(1))
        (tensor([2., 4.]), tensor([2.]))
    """

    def __init__(
        self,
        namespace: str,
        name: str,
        schema: str,
        fn: Callable[..., Any],
        device_types: DeviceTypes,
        vmap: str = "auto",
        tags: Any = None,
        *,
        define: bool = True,
        compile: str = "fuse",
    ) -> None:
        # define=False: the operator exists already (autobatch()); only our kernels are added to it.
        self._define = define
        source = _user_source()
        try:
            super().__init__(namespace, name, schema, fn, tags)
            if define:
                # torch records where the fake kernel came from and cites it in
                # its errors: the user's definition, as for torch.library's ops.
                self._set_fake_source(source)
                self.register_kernel(device_types)(fn)
            self._install(vmap, compile)
        except BaseException:
            _undo_registration(f"{namespace}::{name}", self)
            raise

    def _install(self, vmap: str, compile: str = "fuse") -> None:
        """Installs our kernels (Autograd, FuncTorchBatched) on this op.

        Also what turns a torch.library CustomOpDef into ours in place
        (NOTE [Upgrading an existing op] in _upgrade.py): it reads the rules
        already registered on it.
        """
        schema_args = self._opoverload._schema.arguments
        # A backward may return gradients for the positional inputs only (as
        # torch.library allows) unless a keyword-only input is a tensor: its
        # gradient must then be returned, never silently dropped.
        self._ab = OpExtras(
            kwarg_only=tuple(a.name for a in schema_args if a.kwarg_only),
            positional_grads_ok=not any(
                a.kwarg_only
                and _library_utils.is_tensorlist_like_type(a.type)
                or a.kwarg_only
                and _library_utils.is_tensor_like_type(a.type)
                for a in schema_args
            ),
            num_returns=len(self._opoverload._schema.returns),
        )
        self._ab.setup_context_kwonly = self._kwonly_form(self._setup_context_fn)
        self._ab.registration = _C._register_op(self._qualname, self)
        self._ab.fast_call = self._ab.registration.fast_call_function()
        # NOTE [Kernels die with their op] (csrc/registration.cpp): the handle
        # holds the op, as torch's kernels on that Library do (OPDEFS is weak).
        self._lib._registration_handles.append(_library_utils.RegistrationHandle(self._destroy_kernels))
        if _vmap_presets.is_preset(vmap):
            self._ab.vmap_preset = vmap  # NOTE [vmap presets: the calling convention]
        self._ab.vmap_loop = vmap == "loop"
        if vmap == "loop":
            self._ab.registration.set_vmap_mode(_C.VmapMode.loop)
        elif self._vmap_fn is not None or self._ab.vmap_preset is not None:
            self._ab.registration.set_vmap_mode(_C.VmapMode.rule)
        _compile.register(self, fuse=compile == "fuse")  # NOTE [Inductor sees the function]
        _subclass.install(self, "decompose")  # NOTE [Subclasses receive the function]
        _closure.refresh(self)  # NOTE [What the function closes over]
        self.__name__ = self._name
        self.__qualname__ = self._name
        self.__doc__ = self._init_fn.__doc__
        # (functools.wraps(op), run by every vmap(op) call, reads it: 0.7 us if missing)
        self.__annotations__ = getattr(self._init_fn, "__annotations__", {})

    def _destroy_kernels(self) -> None:
        """Deregisters our C++ kernels (torch destroying the op's Library calls this)."""
        mark_gone(self)  # NOTE [A redefined op's old object is stale]
        self._ab.registration.destroy()
        _compile.unlist_for_inductor(self)
        _compile.unlist_for_torchscript(self)
        _subclass.uninstall(self)

    # The op's function, for introspection (inspect.signature, inspect.unwrap,
    # help()); properties rather than instance attributes, which vmap(op)
    # would copy on every call (OpExtras).
    @property
    def __wrapped__(self) -> Callable[..., Any]:
        return self._init_fn

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._init_fn)

    def _kwonly_form(self, setup_context: Optional[Callable[..., Any]]) -> bool:
        """Does ``setup_context`` take ``keyword_only_inputs`` (for this op)?"""
        return bool(self._ab.kwarg_only) and takes_keyword_only_inputs(setup_context)

    # ------------------------------------------- torch's CustomOpDef, overridden
    def _register_to_dispatcher(self, tags: Any) -> None:
        if self._define:
            super()._register_to_dispatcher(tags)
            return
        self._opoverload = _library_utils.lookup_op(self._qualname)
        self._is_inplace = _library_utils.is_inplace(self._opoverload)
        self._is_out = _library_utils.is_out(self._opoverload)

    def _validate_schema(self, schema: Any, schema_str: str) -> None:
        pass  # keyword-only tensors are supported; custom_op() checked the rest

    def _register_autograd_dispatcher_impl(self) -> None:
        pass  # ours is C++, installed by _C._register_op after __init__

    def _register_fake_dispatcher_impl(self) -> None:
        self._lib._register_fake(self._name, self._fake_impl, _stacklevel=5)

    def _set_fake_source(self, source: str) -> None:
        kernel = simple_registry.singleton.find(self._qualname).fake_impl.kernel
        if kernel is not None and hasattr(kernel, "source"):
            kernel.source = source

    # ----------------------------------------------------------------- calling
    def __repr__(self) -> str:
        return f"<torch_autobatch.CustomOpDef({self._qualname}{self._schema})>"

    @property
    def opoverload(self) -> torch._ops.OpOverload:
        """``torch.ops.<namespace>.<name>.default``.

        Example::

            >>> @torch_autobatch.custom_op("doc_opoverload::double", mutates_args=())
            ... def double(x: torch.Tensor) -> torch.Tensor:
            ...     return 2 * x
            >>> double.opoverload is torch.ops.doc_opoverload.double.default
            True
            >>> double.opoverload(torch.ones(2))
            tensor([2., 2.])
        """
        return self._opoverload

    # ------------------------------------------------------------- registration
    # torch's returns None; ours returns backward, so it stacks as a decorator.
    @overload  # type: ignore[override]
    def register_autograd(self, backward: F, /, *, setup_context: Optional[Callable[..., Any]] = None) -> F: ...

    @overload
    def register_autograd(
        self, backward: None = None, /, *, setup_context: Optional[Callable[..., Any]] = None
    ) -> Callable[[F], F]: ...

    def register_autograd(
        self,
        backward: Optional[Callable[..., Any]] = None,
        /,
        *,
        setup_context: Optional[Callable[..., Any]] = None,
    ) -> Any:
        """Registers the op's derivative for reverse mode, as :func:`torch.library.register_autograd`.

        ``setup_context(ctx, inputs, output)`` runs after the forward: ``inputs``
        is the tuple of all the op's arguments (schema order), ``output`` its
        return value; for an op with keyword-only arguments torch.library's
        ``setup_context(ctx, inputs, keyword_only_inputs, output)`` works too
        (``inputs``: the positional ones, ``keyword_only_inputs``: a dict).
        ``ctx`` is torch's ``FunctionCtx``: ``save_for_backward``,
        ``mark_non_differentiable``, ``set_materialize_grads``, attributes.
        ``backward(ctx, *grads)`` gets one gradient per output (zeros for
        unused floating outputs unless ``ctx.set_materialize_grads(False)``,
        None for integer ones) and returns one gradient per input (or per
        positional input): a Tensor of the input's dtype and shape (or one
        that broadcasts to it, which is summed as autograd sums it), or None
        (always None for non-tensor inputs). It is honoured by
        ``.backward()``, ``torch.autograd.grad`` and every torch.func reverse
        transform (``grad``, ``vjp``, ``jacrev``, ``hessian``), at any nesting.

        Returns ``backward``, so it can be used as a decorator::

            >>> @torch_autobatch.custom_op("doc_register_autograd::cube", mutates_args=())
            ... def cube(x: torch.Tensor) -> torch.Tensor:
            ...     return x**3
            >>> def setup_context(ctx, inputs, output):
            ...     ctx.save_for_backward(inputs[0])
            >>> @cube.register_autograd(setup_context=setup_context)
            ... def backward(ctx, grad):
            ...     (x,) = ctx.saved_tensors
            ...     return grad * 3 * x**2
            >>> x = torch.tensor([1.0, 2.0])
            >>> torch.func.grad(lambda x: cube(x).sum())(x)
            tensor([ 3., 12.])
            >>> torch.vmap(torch.func.grad(cube))(x)  # per-example gradients
            tensor([ 3., 12.])
        """
        if backward is None:
            return lambda fn: self.register_autograd(fn, setup_context=setup_context)
        if not callable(backward):
            raise TypeError(
                f"{self._qualname}.register_autograd: expected backward to be callable, got {type(backward).__name__}."
            )
        if setup_context is not None and not callable(setup_context):
            raise TypeError(
                f"{self._qualname}.register_autograd: expected setup_context to be "
                f"callable or None, got {type(setup_context).__name__}."
            )
        if self._ab.vjp_fwd is not None:
            raise RuntimeError(
                f"{self._qualname}.register_autograd: the op already has a rule from "
                f"register_vjp(fwd, bwd); an op takes one of register_autograd and register_vjp."
            )
        self._set_autograd_rule(backward, setup_context)
        return backward

    def _set_autograd_rule(self, backward: Callable[..., Any], setup_context: Optional[Callable[..., Any]]) -> None:
        """Installs the reverse-mode rule the grad node calls (register_autograd, register_vjp)."""
        if self._opoverload._schema.is_mutable:
            # torch.library refuses autograd for any mutating op; we differentiate
            # the inputs it does not mutate (NOTE [Mutating ops]).
            self._backward_fn, self._setup_context_fn = backward, setup_context
        else:
            super().register_autograd(backward, setup_context=setup_context)
        self._ab.setup_context_kwonly = self._kwonly_form(setup_context)
        _compile.refresh_cache_key(self)

    def register_fake(self, fn: F, /) -> F:
        """Registers the fake (meta) implementation used by ``torch.compile`` and fake tensors.

        Optional: without it the op's own function runs on fake tensors.
        Register one when that function cannot (it leaves torch, say through
        ``.tolist()``). Returns ``fn``, so it can be used as a decorator::

            >>> import math
            >>> @torch_autobatch.custom_op("doc_register_fake::py_sin", mutates_args=())
            ... def py_sin(x: torch.Tensor) -> torch.Tensor:
            ...     return torch.tensor([math.sin(v) for v in x.tolist()])
            >>> @py_sin.register_fake
            ... def _(x):
            ...     return torch.empty_like(x)
            >>> py_sin(torch.zeros(2)), py_sin(torch.empty(3, device="meta")).shape
            (tensor([0., 0.]), torch.Size([3]))
        """
        if not callable(fn):
            raise TypeError(f"{self._qualname}.register_fake: expected a callable, got {type(fn).__name__}.")
        _warn.call_warning_at_caller(super().register_fake, fn)  # NOTE [torch's warnings point at the user's line]
        self._set_fake_source(_user_source())
        _vjp_check.forget_checks(self)  # fwd's output is checked against the new fake kernel
        _compile.refresh_cache_key(self)
        return fn

    def register_kernel(self, device_types: DeviceTypes, fn: Optional[Callable[..., Any]] = None, /) -> Any:
        """torch.library's ``register_kernel``; the compile cache key follows (NOTE [The compile cache key names the function])."""
        if fn is None:
            return lambda f: self.register_kernel(device_types, f)
        extras = getattr(self, "_ab", None)
        kernel = fn if extras is None or extras.vjp_fwd is None else _vjp.wrap_kernel(self, fn)
        super().register_kernel(device_types, kernel)
        if extras is not None:
            _compile.refresh_cache_key(self)
        return fn

    def register_vjp(self, fwd: Callable[..., Any], bwd: Callable[..., Any], /) -> None:
        """Registers the op's reverse-mode rule as a forward that saves intermediates, and a backward.

        ``fwd(*args, **kwargs) -> (output, residuals)`` takes the op's
        arguments and returns its output and any pytree of tensors and Python
        values; ``bwd(residuals, *grads)`` returns one gradient per input, as
        a :meth:`register_autograd` backward does (``None`` for one not
        needed: a ``bwd`` that declares ``needs_input_grad`` gets it by
        keyword, a bool per input, and can skip those). When the op is
        differentiated (``.backward()``, ``autograd.grad``, every torch.func
        reverse transform, under ``vmap`` too), ``fwd`` runs **instead of** the
        op's function, once, and its residuals are saved like
        ``save_for_backward`` saves tensors; when nothing is differentiated the
        function runs and ``fwd`` does not. A second derivative
        (``create_graph=True``, ``hessian``) differentiates ``bwd`` through
        ``fwd``, as JAX's ``custom_vjp`` does: ``fwd`` runs again, recorded,
        in that backward only (NOTE [Second derivatives through residuals]
        in ``op/_vjp.py``)::

            >>> @torch_autobatch.custom_op("doc_register_vjp::tanh_mul", mutates_args=())
            ... def tanh_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            ...     return torch.tanh(x) * w
            >>> def fwd(x, w):
            ...     t = torch.tanh(x)
            ...     return t * w, (t, w)
            >>> def bwd(residuals, grad):
            ...     t, w = residuals
            ...     return grad * w * (1 - t * t), grad * t
            >>> tanh_mul.register_vjp(fwd, bwd)
            >>> torch.func.grad(lambda x: tanh_mul(x, torch.ones(2)).sum())(torch.zeros(2))
            tensor([1., 1.])
        """
        _vjp.register(self, fwd, bwd)

    @overload
    def register_jvp(self, jvp: F, /, *, setup_context: Optional[Callable[..., Any]] = None) -> F: ...

    @overload
    def register_jvp(
        self, jvp: None = None, /, *, setup_context: Optional[Callable[..., Any]] = None
    ) -> Callable[[F], F]: ...

    def register_jvp(
        self,
        jvp: Optional[Callable[..., Any]] = None,
        /,
        *,
        setup_context: Optional[Callable[..., Any]] = None,
    ) -> Any:
        """Registers the op's derivative for forward mode (``jvp``, ``jacfwd``, dual tensors).

        ``jvp(ctx, *input_tangents)`` returns the output tangent(s), one per
        output (None for a non-differentiable one). ``input_tangents`` holds
        one entry per input: a Tensor, or None for an input without a tangent
        (a zero tangent) and for non-tensors. ``ctx`` comes from
        ``setup_context(ctx, inputs, output)`` given here, or else the one given
        to :meth:`register_autograd`; ``ctx.saved_tensors`` returns what it
        passed to ``ctx.save_for_forward`` (or else ``save_for_backward``).
        ``inputs`` and ``output`` are primals (without tangents).

        Without a registered jvp, forward mode is derived from the op's own
        function (forward-mode AD of its torch ops): correct, never zeros.
        Reverse mode always uses the registered backward. Returns ``jvp``, so
        it can be used as a decorator::

            >>> @torch_autobatch.custom_op("doc_register_jvp::square", mutates_args=())
            ... def square(x: torch.Tensor) -> torch.Tensor:
            ...     return x * x
            >>> def setup_context(ctx, inputs, output):
            ...     ctx.save_for_forward(inputs[0])
            >>> @square.register_jvp(setup_context=setup_context)
            ... def jvp(ctx, x_tangent):
            ...     (x,) = ctx.saved_tensors
            ...     return 2 * x * x_tangent
            >>> torch.func.jvp(square, (torch.tensor([1.0, 2.0]),), (torch.ones(2),))
            (tensor([1., 4.]), tensor([2., 4.]))
        """
        if jvp is None:
            return lambda fn: self.register_jvp(fn, setup_context=setup_context)
        if not callable(jvp):
            raise TypeError(f"{self._qualname}.register_jvp: expected jvp to be callable, got {type(jvp).__name__}.")
        if setup_context is not None and not callable(setup_context):
            raise TypeError(
                f"{self._qualname}.register_jvp: expected setup_context to be "
                f"callable or None, got {type(setup_context).__name__}."
            )
        self._ab.jvp_fn = jvp
        self._ab.jvp_setup_context_fn = setup_context
        self._ab.jvp_setup_context_kwonly = self._kwonly_form(setup_context)
        self._ab.registration.set_has_jvp(True)
        _compile.refresh_cache_key(self)
        return jvp

    def register_vmap(self, rule: Optional[F] = None, /) -> Any:
        """Registers a batching rule that replaces the automatic one, as :func:`torch.library.register_vmap`.

        ``rule(info, in_dims, *args, **keyword_only_args) -> (output, out_dims)``:
        ``info.batch_size`` and ``info.randomness`` describe the vmap;
        ``in_dims`` holds each positional argument's batch dim (None when
        unbatched) and ``args`` the unbatched tensors; ``out_dims`` is an int
        or None per output, or a pytree matching the output. It runs through
        torch's own helper for such rules. You rarely need this: by default
        vmap runs the op's own function once on batched tensors. The
        registered backward still governs gradients. Returns ``rule``, so it
        can be used as a decorator::

            >>> @torch_autobatch.custom_op("doc_register_vmap::scale", mutates_args=())
            ... def scale(x: torch.Tensor, s: float) -> torch.Tensor:
            ...     return x * s
            >>> @scale.register_vmap
            ... def rule(info, in_dims, x, s):
            ...     print("batch size", info.batch_size, "in_dims", in_dims)
            ...     return x * s, in_dims[0]
            >>> torch.vmap(scale, in_dims=(0, None))(torch.ones(4, 2), 3.0).shape
            batch size 4 in_dims (0, None)
            torch.Size([4, 2])
        """
        if rule is None:
            return lambda fn: self.register_vmap(fn)
        if not callable(rule):
            raise TypeError(f"{self._qualname}.register_vmap: expected a callable, got {type(rule).__name__}.")
        self._vmap_fn = rule
        self._ab.registration.set_vmap_mode(_C.VmapMode.rule)
        _closure.refresh(self)
        _compile.refresh_cache_key(self)
        return rule

    # ------------------------------------------ called by torch and _compile
    def _fake_impl(self, *args: Any, **kwargs: Any) -> Any:
        """The fake kernel: ``register_fake``'s function, or by default the op's own function.

        It never answers register_vjp's residual request (they would be fake
        constants of a traced graph): setup_context runs ``fwd``, recorded
        (NOTE [Residuals of register_vjp]).
        """
        if self._abstract_fn is not None:
            return self._abstract_fn(*args, **kwargs)
        try:
            with _compile.constants_allowed(args):  # NOTE [A fake run of the function reads its tensor constants]
                return self._init_fn(*args, **kwargs)
        except _PLAIN_ERRORS as e:
            # torch's own control-flow exceptions (data-dependent output, guards on unbacked symbols) are
            # subclasses: they go on unchanged, for torch to handle.
            if type(e) not in _PLAIN_ERRORS:
                raise
            raise type(e)(
                f"{e}\ntorch_autobatch: {self._qualname} has no fake kernel, so its own "
                f"function ran as one (on fake or meta tensors: torch.compile, "
                f"torch.export, FakeTensorMode, DTensor sharding propagation), and that "
                f"failed (above). Register a fake kernel with "
                f"{self._name}.register_fake(fn): a function of the same arguments "
                f"that returns empty tensors of the output shapes (torch.empty_like, "
                f"x.new_empty)."
            ) from e


_C._install_call_slot(CustomOpDef)  # NOTE [The op's call slot] (csrc/fast_call.cpp)


# The exception types a fake kernel's failure is explained for (exactly these:
# see CustomOpDef._fake_impl).
_PLAIN_ERRORS = (RuntimeError, TypeError, ValueError, NotImplementedError, AttributeError, IndexError)


def custom_op(
    name: str,
    fn: Optional[Callable[..., Any]] = None,
    /,
    *,
    mutates_args: Union[str, Iterable[str]],
    device_types: DeviceTypes = None,
    schema: Optional[str] = None,
    tags: Any = None,
    vmap: str = "auto",
    compile: str = "fuse",
    subclasses: str = "decompose",
) -> Any:
    """Makes a Python function built from torch ops into a dispatcher operator.

    A drop-in for :func:`torch.library.custom_op` whose operator works under
    every torch.func transform with the derivatives you register::

        >>> @torch_autobatch.custom_op("doc_custom_op::softclip", mutates_args=())
        ... def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
        ...     return scale * torch.tanh(x / scale)
        >>> def setup_context(ctx, inputs, output):
        ...     ctx.save_for_backward(inputs[0])
        ...     ctx.scale = inputs[1]
        >>> def backward(ctx, grad):
        ...     (x,) = ctx.saved_tensors
        ...     return grad * (1 - torch.tanh(x / ctx.scale) ** 2), None
        >>> _ = softclip.register_autograd(backward, setup_context=setup_context)
        >>> torch.func.grad(lambda x: softclip(x, 2.0).sum())(torch.zeros(3))
        tensor([1., 1., 1.])
        >>> torch.vmap(softclip, in_dims=(0, None))(torch.randn(1000, 64), 2.0).shape
        torch.Size([1000, 64])

    Args:
        name: ``"namespace::name"``; the op is then ``torch.ops.namespace.name``.
        fn: the implementation; omit it to use ``custom_op`` as a decorator.
        mutates_args: the names of the arguments the function mutates in place
            (``()`` for none), as in :func:`torch.library.custom_op`. A mutated
            argument gets no gradient; the others are differentiated by the
            registered backward.
        device_types: device types ``fn`` implements (default: all).
        schema: the schema string (default: inferred from ``fn``'s type hints).
        tags: ``torch.Tag`` s for the op, as in :func:`torch.library.custom_op`.
        vmap: ``"auto"`` (default): ``fn`` runs once on batched tensors.
            ``"loop"`` (``"sequential"``): once per example (``.item()``,
            ``.numpy()``). ``"expand_dims"`` / ``"broadcast_all"``: an opaque
            kernel (and its rules) called once per vmap level with the batch
            in a leading dim (docs/api.md, "vmap presets").
        compile: ``"fuse"`` (default): Inductor fuses the function's torch
            ops, with the registered rules; ``"opaque"``: one extern call.
        subclasses: ``"decompose"`` (default): a tensor subclass with no
            rule for the op (DTensor, a jagged NestedTensor) receives ``fn``'s
            torch ops below autograd, the registered rules governing;
            ``"whole"``: it always gets the op whole (docs/api.md, "Tensor subclasses").
    """
    vmap = _vmap_presets.normalize(f"torch_autobatch.custom_op({name!r})", vmap)
    if compile not in _compile.COMPILE_MODES:
        raise ValueError(f"torch_autobatch.custom_op({name!r}): compile must be 'fuse' or 'opaque', got {compile!r}.")
    _subclass.check_mode(f"torch_autobatch.custom_op({name!r})", subclasses)

    def inner(f: Callable[..., Any]) -> CustomOpDef:
        if "::" not in name:
            raise ValueError(
                f"torch_autobatch.custom_op: expected name of the form "
                f"'namespace::name' (e.g. 'mylib::softclip'), got {name!r}."
            )
        namespace, opname = name.split("::", 1)
        op_schema = schema_of(name, f, schema, mutates_args, tags)
        op = CustomOpDef(namespace, opname, op_schema, f, device_types, vmap, tags, compile=compile)
        _subclass.set_mode(op, subclasses)
        return op

    return inner if fn is None else inner(fn)
