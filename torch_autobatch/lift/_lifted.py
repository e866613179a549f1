"""``autobatch(FunctionClass)`` / ``from_function``: an ``autograd.Function`` class as a torch_autobatch op.

NOTE [Lifting an autograd.Function]
Kernel libraries ship ``autograd.Function`` classes, most written the legacy
way (``forward(ctx, *args)`` saving on ``ctx``), which torch.func refuses. A
class becomes one of our ops, with its own derivatives, without editing it:

- **Legacy** (no ``setup_context``): what ``forward`` leaves on its ``ctx``
  (saved tensors, attributes, ``mark_non_differentiable``,
  ``set_materialize_grads``) are its residuals. That is ``register_vjp``'s
  contract (NOTE [Residuals of register_vjp] in op/_vjp.py): ``fwd`` runs
  ``forward`` on a recording ctx and returns (output, residuals); ``bwd``
  rebuilds a ctx from the residuals and calls ``backward`` on it. ``forward``
  runs once when differentiated, and the residual tensors are saved by our
  grad node, so they are batched per level under vmap, version-checked, and
  differentiated again through ``forward`` for second derivatives.
- **New-style** (``setup_context``): ``forward(*args)`` is the op's function,
  ``setup_context``/``backward`` its ``register_autograd`` rule.
- A ``jvp`` staticmethod becomes ``register_jvp`` (for a legacy class its ctx
  is rebuilt by running ``forward`` again on a recording ctx: forward mode
  only), a ``vmap`` staticmethod ``register_vmap``.

``Function.apply`` takes any Python values; a schema does not. Each call's
arguments are classified (:func:`_kind`: tensor, None, number, string,
dtype, lists and tuples of those) and each combination of kinds is one
overload of the op, defined on first use (``torch.ops.ns.name.<kinds>``):
the schema types are exact, so a compiled or exported graph holds the op
whole. A tuple comes back to ``forward`` as a tuple (the schema's lists are
lists). An argument no schema holds (a callable, a module, a config object)
is a constant of the call, kept out of the schema (NOTE [Python objects as
arguments of a lifted Function], lift/_objects.py).

What a combination returns is learned before its overload is defined, by
running ``forward`` once on meta copies of the arguments (a forward made of
torch ops runs there and changes nothing); where that fails (the forward
leaves torch, or reads values), on a copy of one example's real values. The
meta run also decides ``vmap="auto"``: a forward that ran on meta tensors is
made of torch ops and is batched by our free rule; one that did not is run
once per example (``vmap="loop"``), unless the class has a ``vmap`` rule.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch._library.utils import RegistrationHandle

from ..core._types import no_fast_call
from ..vmap import _presets as _vmap_presets
from . import _dynamo, _outputs
from ._ctx import Residuals, _mark_dirty_message, _MarkDirty, _RecordingCtx, _residuals
from ._eager import note_inputs_in_objects
from ._kinds import (
    _OBJECT,
    _kind,
    _kind_token,
    _restore,
    _schema_type,
    needs_restore,
    restoring_setup_context,
    restoring_vmap_rule,
)
from ._objects import call_with_objects, constants_of
from ._outputs import fresh_outputs, fresh_vmap_rule
from ._probe import _Probe, _probe
from ._rules import (
    _apply_marks,
    _counted,
    _legacy_backward,
    _legacy_jvp,
    _legacy_jvp_setup_context,
    backward_as_eager,
    jvp_as_eager,
    once_checked,
)
from ._transpose import legacy_transposed_jvp, new_style_transposed_jvp

__all__ = ["LiftedFunction", "autobatch_function", "from_function"]

FunctionClass = type[torch.autograd.Function]
_is_compiling = torch.compiler.is_compiling
_BOUND_METHODS = (types.MethodType, types.BuiltinMethodType)

_Tensor = torch.Tensor
# (OpOverload, returns a 1-tuple, the positions of Python objects, the op's
# fast_call: NOTE [The unbatched call's fast path] in csrc/fast_call.cpp)
_Entry = tuple[Any, bool, tuple[int, ...], Callable[[tuple[Any, ...]], Any]]
_TENSORS = ("Tensor", "Tensor?")  # the element kinds of a list of tensors


# ------------------------------------------------------------------- classes
def _defined_by_user(cls: FunctionClass, name: str) -> bool:
    """Does ``cls`` (or a base of it outside torch.autograd) define ``name``?"""
    for klass in cls.__mro__:
        if name in vars(klass):
            return not klass.__module__.startswith("torch.autograd")
    return False


def _check_class(cls: Any, api: str) -> None:
    if not (isinstance(cls, type) and issubclass(cls, torch.autograd.Function)):
        raise TypeError(f"torch_autobatch.{api}: expected an autograd.Function subclass, got {cls!r}.")
    if not _defined_by_user(cls, "forward"):
        raise TypeError(f"torch_autobatch.{api}({cls.__qualname__}): the class defines no forward.")
    if not (_defined_by_user(cls, "backward") or _defined_by_user(cls, "vjp")):
        raise TypeError(
            f"torch_autobatch.{api}({cls.__qualname__}): the class defines no backward; "
            f"an autograd.Function without one has nothing for torch_autobatch to honour."
        )


def _is_new_style(cls: FunctionClass) -> bool:
    return bool(torch.autograd.function._is_setup_context_defined(cls.setup_context))


_IDENTIFIER = re.compile(r"[^0-9A-Za-z_]")
_NAMES_LOCK = threading.Lock()
_TAKEN: set[str] = set()


def _default_name(cls: FunctionClass) -> str:
    namespace = _IDENTIFIER.sub("_", cls.__module__).strip("_") or "lifted"
    name = _IDENTIFIER.sub("_", cls.__qualname__.replace(".<locals>.", "_"))
    return f"{namespace}::{name}"


def _unique(qualname: str) -> str:
    with _NAMES_LOCK:
        candidate, n = qualname, 1
        while candidate in _TAKEN or _defined(candidate):
            n += 1
            candidate = f"{qualname}_{n}"
        _TAKEN.add(candidate)
    return candidate


def _defined(qualname: str) -> bool:
    """Does an operator of this name exist already (any overload)?"""
    return bool(torch._C._jit_get_schemas_for_operator(qualname))


# -------------------------------------------------------------- the callable
class LiftedFunction:
    """An ``autograd.Function`` class as torch_autobatch ops: call it as ``FunctionClass.apply``.

    Made by :func:`torch_autobatch.from_function` (and used by
    ``torch_autobatch.autobatch(FunctionClass)``). Each combination of
    argument kinds (tensors, None, numbers, strings, dtypes, lists/tuples of
    those) is one overload of the operator ``torch.ops.<ns>.<name>``, defined
    on first use; :attr:`ops` lists those defined so far.
    """

    def __init__(self, cls: FunctionClass, qualname: str, vmap: str, compile: str) -> None:
        self._cls: FunctionClass = cls
        self._qualname = qualname
        self._vmap = vmap
        self._compile = compile
        self._new_style = _is_new_style(cls)
        self._forward = cls.forward
        self._signature = _apply_signature(cls)
        # kinds -> (OpOverload, returns a 1-tuple, the positions of Python objects)
        self._ops: dict[tuple[Any, ...], _Entry] = {}
        # the same entries by the arguments' types, where no argument is a list or tuple (their
        # types then fix their kinds): a call's lookup without a Python call per argument
        self._by_types: dict[tuple[type, ...], _Entry] = {}
        self._n = len(self._signature.parameters) if self._signature is not None else -1
        self._names = _positional_names(cls)  # (error messages)
        self._sets_attributes = False  # some overload's forward hangs attributes on its outputs
        self._defs: dict[str, Any] = {}  # overload name -> CustomOpDef
        self._lock = threading.Lock()
        self.__name__ = cls.__name__
        self.__qualname__ = cls.__qualname__
        self.__doc__ = cls.__doc__
        self.__wrapped__ = cls

    @property
    def ops(self) -> dict[str, Any]:
        """The overloads defined so far, by overload name (each a :class:`torch_autobatch.CustomOpDef`)."""
        return dict(self._defs)

    def overload_for(self, *args: Any, **kwargs: Any) -> Any:
        """The :class:`torch_autobatch.CustomOpDef` a call with these arguments runs (defined now if new).

        ``lifted.overload_for(x, 3, None)`` is the op of ``lifted(x, 3, None)``
        (``torch.ops.ns.name.Tensor_int_None``), without running it.
        """
        if kwargs or len(args) != self._n:
            args = self._bind(args, kwargs)
        kinds = tuple(map(_kind, args))
        overload = (self._ops.get(kinds) or self._define(kinds, args))[0]
        return self._defs[overload._overloadname]

    def object_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """The names of the arguments of this call that no schema holds (Python objects)."""
        if kwargs or len(args) != self._n:
            args = self._bind(args, kwargs)
        return [self._arg_name(i) for i, a in enumerate(args) if _kind(a) == _OBJECT]

    def _arg_name(self, i: int) -> str:
        names = self._names
        return names[i] if i < len(names) else f"args[{i - len(names)}]"

    @property
    def function_class(self) -> FunctionClass:
        """The ``autograd.Function`` class this runs."""
        return self._cls

    def __repr__(self) -> str:
        return f"<torch_autobatch lifted {self._cls.__module__}.{self._cls.__qualname__} as {self._qualname}>"

    def _bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        sig = self._signature
        if sig is None:
            if kwargs:
                raise TypeError(f"{self._cls.__qualname__}.apply takes no keyword arguments (forward has *args).")
            return args
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._cls.__qualname__}.apply: {e}") from None
        bound.apply_defaults()
        return bound.args

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _is_compiling():  # NOTE [Dynamo and a lifted Function]
            return _dynamo.traced_call(self, args, kwargs, in_place=False)
        return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call: the overload for these arguments' kinds (defined on first use), or torch's apply."""
        if kwargs or len(args) != self._n:
            args = self._bind(args, kwargs)
        entry = self._by_types.get(tuple(map(type, args)))
        if entry is None:
            kinds = tuple(map(_kind, args))
            entry = self._ops.get(kinds)
            if entry is None:
                if _OBJECT in kinds and not torch._C._are_functorch_transforms_active():
                    return _torch_apply(self._cls, *args)  # (no overload defined for an eager call)
                entry = self._define(kinds, args)
            if all(isinstance(k, str) for k in kinds):
                self._by_types[tuple(map(type, args))] = entry
        overload, returns_1_tuple, objects, fast_call = entry
        if self._sets_attributes:  # NOTE [Attributes a forward sets on its outputs]
            _outputs.pending.spec = None
        if objects:  # NOTE [Python objects as arguments of a lifted Function] (lift/_objects.py)
            if not torch._C._are_functorch_transforms_active():
                return _torch_apply(self._cls, *args)
            names = [self._arg_name(i) for i in range(len(args))]
            out, _constants = call_with_objects(overload, args, objects, names, f"{self._cls.__qualname__}.apply")
        else:  # what CustomOpDef.__call__ does, a frame less
            out = fast_call(args)
            if out is NotImplemented:
                out = overload(*args)
        if self._sets_attributes and _outputs.pending.spec is not None:
            _outputs.apply_attributes(_outputs.pending.spec, out, args, f"{self._cls.__qualname__}.apply")
        return (out,) if returns_1_tuple else out

    def _define(self, kinds: tuple[Any, ...], args: tuple[Any, ...]) -> _Entry:
        probe = _probe(self, kinds, args)
        with self._lock:
            entry = self._ops.get(kinds)
            if entry is None:
                op = _define_overload(self, kinds, probe)
                self._defs[op._opoverload._overloadname] = op
                objects = tuple(i for i, k in enumerate(kinds) if k == _OBJECT)
                entry = (op._opoverload, probe.returns_tuple and probe.num_outputs == 1, objects, op._ab.fast_call)
                self._ops[kinds] = entry
                # NOTE [A redefined op's old object is stale]: then the op's own call, which raises
                op._lib._registration_handles.append(
                    RegistrationHandle(functools.partial(_forget, weakref.ref(self), op))
                )
        return entry


def _forget(ref: weakref.ref[LiftedFunction], op: Any) -> None:
    """op (some overloads' op) is gone: their calls go through it, and raise, from now on."""
    lifted = ref()  # weak: the op's Library lives for the process, and must not keep the callable
    if lifted is not None:
        with lifted._lock:
            for cache in (lifted._ops, lifted._by_types):
                for key, (overload, returns_1_tuple, objects, _) in list(cache.items()):
                    if overload is op._opoverload:
                        cache[key] = (op, returns_1_tuple, objects, no_fast_call)


def _torch_apply(klass: FunctionClass, *args: Any, **kwargs: Any) -> Any:
    """torch's own ``autograd.Function.apply`` for ``klass`` (a classmethod, or a C builtin on torch >= 2.14)."""
    return inspect.getattr_static(torch.autograd.Function, "apply").__get__(None, klass)(*args, **kwargs)


def _apply_signature(cls: FunctionClass) -> Optional[inspect.Signature]:
    """``apply``'s signature: ``forward``'s, less ``ctx`` for a legacy class; None for ``*args``."""
    sig = inspect.signature(cls.forward)
    params = list(sig.parameters.values())
    if not _is_new_style(cls):
        params = params[1:]  # ctx
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None
    return sig.replace(parameters=params)


def _positional_names(cls: FunctionClass) -> list[str]:
    """The names of ``apply``'s positional parameters before any ``*args``."""
    params = list(inspect.signature(cls.forward).parameters.values())[0 if _is_new_style(cls) else 1 :]
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return names


# ------------------------------------------------------------- one overload
class _Kernel:
    """One overload's function (the object itself) and register_vjp ``fwd``: ``forward`` as ``apply`` runs it.

    An object, not closures: the kernels check what an op's function closes
    over on every call (NOTE [What the function closes over]); for a lifted
    class that is what ``forward`` closes over (``_closure._user_code``).
    """

    def __init__(self, lifted: LiftedFunction, kinds: tuple[Any, ...], num_outputs: int, names: list[str]) -> None:
        self.cls = lifted._cls
        self.forward = lifted._forward
        self.new_style = lifted._new_style
        self.kinds = kinds
        self.restore = needs_restore(kinds)  # a list, tuple or object argument
        self.objects = tuple(i for i, k in enumerate(kinds) if k == _OBJECT)
        self.tensor_args = tuple(k == "Tensor" for k in kinds)  # a legacy forward's ctx.needs_input_grad
        self.tensor_positions = tuple(i for i, k in enumerate(kinds) if k == "Tensor")
        self.tensor_lists = tuple(i for i, k in enumerate(kinds) if not isinstance(k, str) and k[1] in _TENSORS)
        self.single = num_outputs == 1
        # what the op shows of its function (inspect.signature, help(), error messages)
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
        )
        self.__name__ = self.cls.__name__
        self.__qualname__ = self.cls.__qualname__
        self.__doc__ = self.cls.__doc__
        self.lifted_class = self.cls  # (error messages name the class)
        self.extras: Any = None  # the op's OpExtras, once it is defined
        self.sets_attributes = False  # NOTE [Attributes a forward sets on its outputs] (lift/_outputs.py)

    def fwd(self, *args: Any) -> tuple[Any, Residuals]:
        """register_vjp's ``fwd``: forward on a recording ctx, which becomes the residuals."""
        real = _restore(self.kinds, args, self.__qualname__) if self.restore else args
        ctx = _new(_RecordingCtx)
        ctx.needs_input_grad = self.tensor_args  # True for every tensor argument: _RecordingCtx.__init__ says why
        out = self.forward(ctx, *real)
        returned = out if isinstance(out, tuple) else (out,)
        if self.sets_attributes:
            _outputs.note_attributes(returned, real)
        # NOTE [A lifted op's outputs alias nothing] (lift/_outputs.py)
        outs = fresh_outputs(returned, args, self.tensor_positions, self.tensor_lists)
        if ctx.dirty_tensors:
            raise _MarkDirty(_mark_dirty_message(self.cls))
        if ctx.non_differentiable or not ctx.materialize_grads:
            # ctx's marks, applied by a hook in setup_context from the first call that makes any
            self.extras.vjp_setup_hook = _apply_marks
        kept = ctx.__dict__  # (needs_input_grad and, where forward saved tensors, to_save: no object)
        if len(kept) > 2 or (len(kept) == 2 and "to_save" not in kept):  # NOTE [Inputs inside ctx objects]
            note_inputs_in_objects(kept, real)
        if self.objects:  # the residuals keep the call's objects while fwd may run again
            constants = constants_of(args, self.objects)
            if constants is not None and constants.tracked:
                constants.check_kept(ctx, f"{self.cls.__qualname__}.apply")
            ctx.__dict__["_torch_autobatch_constants"] = constants
        # (marks name the tensors forward returned: they are found among those, not the copies)
        return (outs[0] if self.single else outs), _residuals(ctx, returned)

    def __call__(self, *args: Any) -> Any:
        """The op's function."""
        if not self.new_style:
            return self.fwd(*args)[0]  # nothing differentiated: the residuals are dropped
        real = _restore(self.kinds, args, self.__qualname__) if self.restore else args
        out = self.forward(*real)
        returned = out if isinstance(out, tuple) else (out,)
        if self.sets_attributes:
            _outputs.note_attributes(returned, real)
        outs = fresh_outputs(returned, args, self.tensor_positions, self.tensor_lists)
        return outs[0] if self.single else outs


_new = object.__new__


def _define_overload(lifted: LiftedFunction, kinds: tuple[Any, ...], probe: _Probe) -> Any:
    from ..op._custom_op import CustomOpDef, custom_op  # noqa: F401  (import cycle: _upgrade imports us)

    cls = lifted._cls
    sig = lifted._signature
    names = list(sig.parameters) if sig is not None else [f"arg{i}" for i in range(len(kinds))]
    names = [n if n not in ("self", "out") else f"{n}_" for n in names]
    overload = "_".join(_kind_token(k) for k in kinds) or "noargs"
    returns = "Tensor" if probe.num_outputs == 1 else "(" + ", ".join(["Tensor"] * probe.num_outputs) + ")"
    schema = "(" + ", ".join(f"{_schema_type(k)} {n}" for k, n in zip(kinds, names)) + ") -> " + returns
    vmap = lifted._vmap
    if vmap == "auto" and not probe.torch_ops and not _defined_by_user(cls, "vmap"):
        vmap = "loop"
    n_in = len(kinds)
    kernel = _Kernel(lifted, kinds, probe.num_outputs, names)
    kernel.sets_attributes = probe.sets_attributes
    lifted._sets_attributes = lifted._sets_attributes or probe.sets_attributes
    fwd = kernel.fwd
    op = custom_op(
        f"{lifted._qualname}.{overload}", kernel, mutates_args=(), schema=schema, vmap=vmap, compile=lifted._compile
    )
    backward = cls.backward if _defined_by_user(cls, "backward") else cls.vjp
    has_jvp = _defined_by_user(cls, "jvp")
    # NOTE [Forward mode of a lifted class is its backward's transpose] (lift/_transpose.py): no jvp
    # staticmethod, forward mode from the backward; user functions get tuples back (_restore)
    if lifted._new_style:
        setup_context = restoring_setup_context(cls.setup_context, kinds)
        # NOTE [A backward torch.func cannot run runs as eager .backward() runs it] (lift/_eager.py)
        as_eager = backward_as_eager(once_checked(backward, cls), f"{cls.__qualname__}.backward")
        op.register_autograd(_counted(as_eager, n_in), setup_context=setup_context)
        if has_jvp:
            op.register_jvp(jvp_as_eager(cls.jvp, f"{cls.__qualname__}.jvp"), setup_context=setup_context)
        else:
            jvp, jvp_setup_context = new_style_transposed_jvp(cls, backward, n_in, kinds)
            op.register_jvp(jvp, setup_context=jvp_setup_context)
    else:
        bwd = _legacy_backward(backward, n_in, cls)
        kernel.extras = op._ab
        op.register_vjp(fwd, bwd)
        op._ab.vjp_fwd_is_function = True  # the function is fwd's output: nothing to check
        if has_jvp:
            op.register_jvp(_legacy_jvp(cls.jvp, cls), setup_context=_legacy_jvp_setup_context(fwd))
        else:
            jvp, jvp_setup_context = legacy_transposed_jvp(cls, backward, fwd, n_in)
            op.register_jvp(jvp, setup_context=jvp_setup_context)
        # (either setup_context runs forward again: csrc/forward_mode.h, NOTE [A jvp that reruns the
        # forward draws the primal's random numbers])
        op._ab.registration.set_jvp_reruns_forward(True)
    if _defined_by_user(cls, "vmap"):
        rule = restoring_vmap_rule(cls.vmap, kinds)
        op.register_vmap(fresh_vmap_rule(rule, kernel.tensor_positions, kernel.tensor_lists))
    op._ab.registration.set_cast_grad_dtypes(True)  # as autograd casts a Function's gradients
    if vmap == "auto":  # NOTE [A forward vmap cannot batch runs per example] (csrc/batched_kernel.cpp)
        op._ab.loop_on_failure = True
        op._ab.registration.set_loop_on_failure(True)
    return op


# --------------------------------------------------------------- public API
_LIFTED: dict[type, LiftedFunction] = {}


def from_function(
    cls: FunctionClass, /, *, name: Optional[str] = None, vmap: str = "auto", compile: str = "fuse"
) -> LiftedFunction:
    """An ``autograd.Function`` class as a torch_autobatch operator; the class is not changed.

    Returns a callable with ``cls.apply``'s signature that works under every
    torch.func transform with the class's own derivatives::

        >>> class Cube(torch.autograd.Function):  # the legacy style torch.func refuses
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x ** 3
        ...     @staticmethod
        ...     def backward(ctx, grad):
        ...         (x,) = ctx.saved_tensors
        ...         return grad * 3 * x ** 2
        >>> cube = torch_autobatch.from_function(Cube, name="doc_from_function::cube")
        >>> torch.vmap(torch.func.grad(lambda x: cube(x).sum()))(torch.ones(4, 2))
        tensor([[3., 3.],
                [3., 3.],
                [3., 3.],
                [3., 3.]])
        >>> torch.ops.doc_from_function.cube.Tensor(torch.ones(2))  # the operator: one overload per argument kinds
        tensor([1., 1.])

    Args:
        cls: the ``autograd.Function`` subclass, legacy (``forward(ctx, ...)``)
            or with ``setup_context``.
        name: ``"ns::name"``: the operator is ``torch.ops.ns.name``, with one
            overload per combination of argument kinds it is called with
            (``Tensor``, ``Tensor_int_None``, ...). Default: from the class's
            module and name.
        vmap: ``"auto"`` (default): the class's ``vmap`` staticmethod if it
            has one; else, if ``forward`` is made of torch ops (it runs on meta
            tensors), our free batching rule (``forward`` once on the batch);
            else one call per example. ``"loop"`` (``"sequential"``): always
            one call per example. ``"expand_dims"`` / ``"broadcast_all"``: an
            opaque forward and backward that take leading batch dims, called
            once per vmap level (as in :func:`torch_autobatch.custom_op`).
        compile: as in :func:`torch_autobatch.custom_op`.
    """
    from ..graphs import _compile

    _check_class(cls, "from_function")
    vmap = _vmap_presets.normalize(f"torch_autobatch.from_function({cls.__qualname__})", vmap)
    if compile not in _compile.COMPILE_MODES:
        raise ValueError(
            f"torch_autobatch.from_function({cls.__qualname__}): compile must be 'fuse' or 'opaque', got {compile!r}."
        )
    if name is None:
        qualname = _unique(_default_name(cls))
    else:
        if "::" not in name or "." in name:
            raise ValueError(
                f"torch_autobatch.from_function({cls.__qualname__}): name must be 'namespace::name' "
                f"(no overload: each combination of argument kinds is one), got {name!r}."
            )
        with _NAMES_LOCK:
            if name in _TAKEN:
                raise ValueError(f"torch_autobatch.from_function: the name {name!r} is taken by another lifted class.")
            _TAKEN.add(name)
        qualname = name
    lifted = LiftedFunction(cls, qualname, vmap, compile)
    _dynamo.allow_in_graph(lifted, LiftedFunction.__call__)  # NOTE [Dynamo and a lifted Function]
    return lifted


def autobatch_function(cls: FunctionClass, /, *, vmap: str = "auto", compile: str = "fuse") -> FunctionClass:
    """``torch_autobatch.autobatch(FunctionClass)``: ``FunctionClass.apply`` becomes the lifted op, in place.

    NOTE [Lifting in place]
    ``apply`` is replaced on the class itself (a classmethod in its own
    ``__dict__``), so every call site, inside the library too, gets the op;
    ``del FunctionClass.apply`` undoes it (``autograd.Function.apply`` is
    inherited again). A subclass of the class keeps torch's ``apply`` for
    itself (its ``forward`` is another function). A second call is a no-op.
    An alias the library took at import (``sparsemax = SparsemaxFunction.apply``,
    a global of a module of the class's package) is bound to torch's
    ``apply`` and would never see the change: it is rebound to a function
    that looks ``FunctionClass.apply`` up on each call, so it follows the
    lifting and its undoing.
    """
    _check_class(cls, "autobatch")
    if cls in _LIFTED and "apply" in vars(cls):
        return cls
    if "apply" in vars(cls):
        raise TypeError(
            f"torch_autobatch.autobatch({cls.__qualname__}): the class defines its own apply, which "
            f"autobatch would replace; use torch_autobatch.from_function({cls.__qualname__}) and call "
            f"what it returns instead."
        )
    lifted = _LIFTED.get(cls) or from_function(cls, vmap=vmap, compile=compile)
    _LIFTED[cls] = lifted
    original = _torch_apply

    def apply(klass: type, *args: Any, **kwargs: Any) -> Any:
        if klass is not cls:  # a subclass: its own forward
            return original(klass, *args, **kwargs)
        if _is_compiling():  # NOTE [Dynamo and a lifted Function]
            return _dynamo.traced_call(lifted, args, kwargs, in_place=True)
        return lifted._run(args, kwargs)

    apply.__wrapped__ = original  # type: ignore[attr-defined]
    apply.lifted = lifted  # type: ignore[attr-defined]
    cls.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    _dynamo.allow_in_graph(cls, apply)
    _rebind_aliases(cls)
    return cls


def _rebind_aliases(cls: FunctionClass) -> None:
    """Globals of the class's package bound to torch's ``cls.apply`` call ``cls.apply`` instead (NOTE [Lifting in place])."""
    package = cls.__module__.split(".")[0]

    def apply(*args: Any, **kwargs: Any) -> Any:
        return cls.apply(*args, **kwargs)

    apply.__qualname__ = apply.__name__ = f"{cls.__qualname__}.apply"
    for name, module in list(sys.modules.items()):
        if module is None or (name != package and not name.startswith(package + ".")):
            continue
        try:
            globals_ = list(vars(module).items())
        except TypeError:  # an object in sys.modules without a __dict__
            continue
        for attr, value in globals_:
            # a bound method of torch's apply (a classmethod, or a C builtin on torch >= 2.14); only
            # the type is asked of other values (an attribute lookup may run their code)
            if type(value) in _BOUND_METHODS and value.__self__ is cls and value.__name__ == "apply":
                setattr(module, attr, apply)
