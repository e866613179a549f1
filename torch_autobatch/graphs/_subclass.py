"""What a ``__torch_dispatch__`` tensor subclass with no rule for an op receives: the op's function.

NOTE [Subclasses receive the function]
A subclass (DTensor, a jagged NestedTensor, TwoTensor, a quantized weight)
first sees an op at the Python key, below our Autograd kernel, which has
already attached the op's grad node (the registered backward and jvp). A
subclass that has no rule for the op fails there ("does not have a sharding
strategy registered", ``NotImplementedError(op)``), where the plain function
works, because each aten op in the function has a rule. So when no one
handles the op, the subclass receives the function instead: the op's backend
kernel (``CompositeExplicitAutograd``, or the kernel ``register_kernel``
gave for the tensors' device) is run on the subclass tensors, each aten op
inside goes to the subclass, and nothing inside is recorded by autograd
(below the Python key torch excludes every key above it, autograd, functorch
and functionalization included; ``_ABOVE_PYTHON`` keeps that so). Gradients
and tangents stay the op's own: its rules govern, as on plain tensors.

The op still arrives whole wherever something knows it, in the order torch
asks (Note [__torch_dispatch__ dispatching order] in torch's
python_arg_parser.cpp):
- every dispatch mode (FakeTensorMode, make_fx's proxy mode, torch.export,
  torch.compile's functionalization, a user's mode) is asked before any
  subclass and gets the op whole: the default rule is offered for tensor
  subclasses only, never for a mode;
- a rule registered with ``register_torch_dispatch`` for the class wins: the
  default is offered only when the class has none;
- the class itself is asked next, by dispatching the op again with the
  default rule stood aside for these very arguments: DTensor's C++ path
  (``register_sharding`` strategies, custom handlers, its decomposition
  strategies), a class's own ``__torch_dispatch__`` table, FakeTensor. Only
  when every class declines (raises ``NotImplementedError``, or all return
  ``NotImplemented``) does the function run. A class is never bypassed
  because a predicate guessed it could not handle the op (DTensor is asked
  once per op and then checked with its own tables: NOTE [Asking DTensor
  once]). Asking means dispatching again because DTensor's handler is C++
  that Python cannot call directly; the ask stands aside for the exact
  tensors asked about, so a class that calls the op again on other
  tensors (TwoTensor on its components) gets the default for those.
An op defined with ``subclasses="whole"`` is offered no default: it arrives
whole at the class, which handles it or raises its own error.

Where the function cannot run on the subclass either (it leaves torch), the
error is the class's own, plus one line naming the op and the two ways out.

Why a rule rather than a kernel: a ``CompositeImplicitAutograd`` kernel
would decompose the op above autograd for plain tensors too (and in every
graph), and a kernel at the Python key would run before the modes'
handling is over; both lost the op in ``make_fx`` graphs in the prototype.
A ``__torch_dispatch__`` rule is consulted exactly where a subclass would
be asked, after every mode.

NOTE [The torch internals behind the default rule]
This module is the one place that touches them; re-check it on each torch
release (test/test_subclasses.py fails if one moves).
1. torch's C++ (python_arg_parser.cpp, ``dispatch_on_mode`` and
   ``dispatch_on_subclass``) calls
   ``torch._library.simple_registry.find_torch_dispatch_rule(op, type)``
   for every mode and subclass before their ``__torch_dispatch__`` (for
   DTensor, before its C++ fast path). It looks that *function* up once and
   caches it (a ``gil_safe_call_once_and_store``), so replacing it would be
   seen only by a process that had not dispatched to a subclass yet. The
   function reads ``simple_registry.singleton`` and the op's entry on every
   call, though: each op of ours swaps the class of its entry's
   ``torch_dispatch_rules`` holder (``__class__``, as autobatch() does for an
   op: the object, its registrations and torch's references to it stay)
   for :class:`_RuleHolder`, whose ``find`` adds the default. Other ops are
   untouched and pay nothing.
2. When a rule returns ``NotImplemented``, torch 2.13's ``dispatch_on_subclass``
   goes on to DTensor's fast path for a DTensor, but for any other class it
   calls the *rule* again in place of the class's ``__torch_dispatch__``,
   with that method's arguments ``(func, types, args, kwargs)`` (it assigned
   the rule to the variable holding the method). The rule therefore keeps
   the class it declined for (``_State.passed``) and, called that way,
   calls that class's ``__torch_dispatch__``: what torch would have called.
3. When every handler returns ``NotImplemented`` torch raises a TypeError
   whose text says so (``_ALL_DECLINED``): the one way to tell that case
   from a TypeError raised by a handler.
4. ``OpOverload.redispatch(keyset, ...)`` runs the kernel the dispatcher
   picks for the tensors' backend key: the op's function.
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch._library import simple_registry
from torch._library.utils import RegistrationHandle

if TYPE_CHECKING:
    from ..core._types import CustomOpDef

__all__ = ["SUBCLASS_MODES", "check_mode", "install", "set_mode", "uninstall"]

#: The values of ``custom_op(..., subclasses=...)`` and ``autobatch(..., subclasses=...)``.
SUBCLASS_MODES = ("decompose", "whole")

_C = torch._C
_PYTHON = _C.DispatchKey.Python
#: The keys below the Python key: where the op's backend kernel is found.
_BELOW_PYTHON = _C._dispatch_keyset_full_after(_PYTHON)
#: Every key above the Python key (autograd, ADInplaceOrView, functorch's
#: keys, Functionalize, autocast, PythonTLSSnapshot, PreDispatch, ...),
#: computed from the dispatcher's order rather than listed. torch already
#: excludes them while a subclass handles an op; the function runs with
#: them excluded too, so nothing inside it is recorded by autograd or seen
#: again by a transform the op went through.
_ABOVE_PYTHON = _C._dispatch_keyset_full() - _BELOW_PYTHON - _C.DispatchKeySet(_PYTHON)
#: The text of torch's TypeError when every handler returned NotImplemented.
_ALL_DECLINED = "returned NotImplemented"


class _State(threading.local):
    def __init__(self) -> None:
        #: The calls being put to the classes (op, tensor ids): the default rule stands aside for them.
        self.asking: list[tuple[Any, ...]] = []
        #: (cls, args) the default rule declined for, for torch's second call (NOTE item 2).
        self.passed: Optional[tuple[Any, Any]] = None


_state = _State()


def _call_key(func: Any, args: tuple[Any, ...], kwargs: Optional[dict[str, Any]]) -> tuple[Any, ...]:
    """The op and the identity of its tensor arguments (torch passes the same tensor objects again)."""
    ids: list[int] = []
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, torch.Tensor):
            ids.append(id(value))
        elif isinstance(value, (list, tuple)):
            ids.extend(id(v) for v in value if isinstance(v, torch.Tensor))
    return (func, *ids)


def _backend_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The backend key of the tensors' device (a DTensor on CPU: CPU), where the function is registered.

    From the device rather than the subclass's own keys: a jagged
    NestedTensor carries NestedTensor keys, which the function (a
    ``CompositeExplicitAutograd`` kernel) is not registered for.
    """
    for value in (*args, *kwargs.values()):
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor):
                return _device_keys(t.device.type)
    raise AssertionError("a tensor subclass dispatched an op with no tensor argument")


@functools.cache
def _device_keys(device_type: str) -> Any:
    return _C.DispatchKeySet(getattr(_C.DispatchKey, _C._dispatch_key_for_device(device_type)))


class _RuleHolder(simple_registry.GenericTorchDispatchRuleHolder):
    """torch's holder of an op's ``register_torch_dispatch`` rules, plus the default for subclasses.

    Registered rules are kept and found as before; a tensor subclass with
    none is offered the default rule (NOTE [Subclasses receive the function]),
    a mode never is.
    """

    _ab_rule: Optional[Callable[..., Any]]
    _ab_op: weakref.ref[CustomOpDef]  # the op whose holder this is now (a redefinition replaces it)

    def register(self, torch_dispatch_class: type, func: Callable[..., Any]) -> Any:
        # torch's register, whose duplicate check calls find (which would see the default).
        if torch_dispatch_class in self._data:
            raise RuntimeError(
                f"{torch_dispatch_class} already has a `__torch_dispatch__` rule registered for {self.qualname}"
            )
        self._data[torch_dispatch_class] = func
        data = self._data
        return RegistrationHandle(lambda: data.pop(torch_dispatch_class, None))

    def find(self, torch_dispatch_class: type) -> Optional[Callable[..., Any]]:
        rule = self._data.get(torch_dispatch_class)
        if rule is None and isinstance(torch_dispatch_class, type) and issubclass(torch_dispatch_class, torch.Tensor):
            return self._ab_rule
        return rule


def _holder(op: CustomOpDef) -> simple_registry.GenericTorchDispatchRuleHolder:
    return simple_registry.singleton.find(op._qualname).torch_dispatch_rules


def install(op: CustomOpDef, mode: str) -> None:
    """Makes the op's function what a subclass with no rule for it receives (``mode="decompose"``)."""
    holder = _holder(op)
    holder.__class__ = _RuleHolder
    assert isinstance(holder, _RuleHolder)
    holder._ab_op = weakref.ref(op)
    set_mode(op, mode)


def check_mode(caller: str, mode: str) -> None:
    if mode not in SUBCLASS_MODES:
        raise ValueError(f"{caller}: subclasses must be 'decompose' or 'whole', got {mode!r}.")


def set_mode(op: CustomOpDef, mode: str) -> None:
    """``"decompose"``: a subclass with no rule for the op receives its function; ``"whole"``: never."""
    holder = _holder(op)
    if isinstance(holder, _RuleHolder):
        holder._ab_rule = _default_rule(weakref.ref(op)) if mode == "decompose" else None


def uninstall(op: CustomOpDef) -> None:
    """Gives the op's entry back to torch (its definition is gone: NOTE [Kernels die with their op])."""
    holder = _holder(op)
    if isinstance(holder, _RuleHolder) and holder._ab_op() in (op, None):
        holder.__class__ = simple_registry.GenericTorchDispatchRuleHolder  # type: ignore[assignment]
        del holder._ab_rule, holder._ab_op


def _default_rule(op_ref: weakref.ref[CustomOpDef]) -> Callable[..., Any]:
    # The classes that declined the op, with their error (type, text), while
    # nothing they consult has changed: NOTE [Asking DTensor once].
    declined_by: dict[type, tuple[type[BaseException], str]] = {}

    def rule(*call: Any) -> Any:
        if not isinstance(call[0], type):
            return _class_dispatch(*call)  # torch's second call: NOTE item 2
        cls, func, types, args = call[:4]
        kwargs = call[4] if len(call) > 4 and call[4] is not None else {}
        op = op_ref()
        key = _call_key(func, args, kwargs)
        if op is None or key in _state.asking:
            _state.passed = (cls, args)
            return NotImplemented  # to the class: what torch does without a rule
        declined = declined_by.get(cls)
        if declined is not None and not _dtensor_may_handle(func):
            return _run_function(op, cls, func, args, kwargs, declined)
        _state.asking.append(key)
        try:
            return func(*args, **kwargs)  # the modes and classes, as if the op had no default
        except Exception as e:
            dtensor_without_rule = _is_dtensor(cls, exactly=True) and not _dtensor_may_handle(func)
            if not (_declines(e) or dtensor_without_rule):
                raise
            declined = (type(e), str(e))
        finally:
            _state.asking.pop()
            _state.passed = None
        if dtensor_without_rule:
            declined_by[cls] = declined
        return _run_function(op, cls, func, args, kwargs, declined)

    return rule


def _declines(error: BaseException) -> bool:
    """Is this how a class says it has no rule for an op (raising NotImplementedError, or all returning NotImplemented)?"""
    return isinstance(error, NotImplementedError) or (isinstance(error, TypeError) and _ALL_DECLINED in str(error))


def _class_dispatch(func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    """The ``__torch_dispatch__`` of the class the default rule just declined for (NOTE item 2)."""
    passed = _state.passed
    _state.passed = None
    if passed is None or passed[1] is not args:
        raise RuntimeError(
            f"torch_autobatch: internal error: the default __torch_dispatch__ rule of {func} was called "
            f"as a class's __torch_dispatch__ for a call it did not decline "
            f"(NOTE [The torch internals behind the default rule] in torch_autobatch/graphs/_subclass.py: torch's dispatch changed?)."
        )
    return passed[0].__torch_dispatch__(func, types, args, kwargs)


# NOTE [Asking DTensor once]
# Asking DTensor costs more than the op: before it finds that it has no
# strategy, its sharding propagation runs the op's fake kernel (the function,
# on fake tensors) to learn the output's metadata, on every call (a failure
# is not cached): ~2 ms for a four-op function against ~0.3 ms for the whole
# forward and backward. So after DTensor (the class itself; a subclass of
# it is asked each time) has declined an op, it is asked again only when one
# of the places its dispatch looks for the op holds it: its custom handlers,
# the propagator's strategies and rules (register_sharding adds there), and
# its decomposition strategies (_dtensor_may_handle). Those are read at each
# call, so a sharding rule registered later wins from the next call on.
# While none holds the op, any error of DTensor's counts as declining: its
# dispatch would end in "does not have a sharding strategy registered", and
# an earlier error comes from that metadata pass (a function that leaves
# torch fails on fake tensors, and may still run on DTensors, where
# ``.tolist()`` works). Every other class is asked on every call. A torch
# that moves these tables makes _dtensor_may_handle answer True: DTensor is
# then asked every time and only NotImplementedError counts (slow, never
# wrong).


def _dtensor_may_handle(func: Any) -> bool:
    """Could DTensor's dispatch find ``func`` in one of its tables (NOTE [Asking DTensor once])?

    Read at each call (a table may be replaced, as a test's patch does).
    """
    found = _dtensor_classes()
    if found is None:
        return True
    dtensor, has_decomp = found
    try:
        dispatcher = dtensor._op_dispatcher
        propagator = dispatcher.sharding_propagator
        return (
            func in dispatcher._custom_op_handlers
            or func in propagator.op_strategy_funcs  # register_sharding adds here
            or func in propagator.op_single_dim_strategy_funcs
            or func in propagator.op_to_rules
            or has_decomp(func)
        )
    except AttributeError:
        return True


@functools.cache
def _dtensor_classes() -> Optional[tuple[Any, Any]]:
    """DTensor, and its test for an op it propagates through a decomposition; None where torch moved them."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._decompositions import DecompShardingStrategy

        return DTensor, DecompShardingStrategy.has_decomp
    except (ImportError, AttributeError):
        return None


def _run_function(
    op: CustomOpDef,
    cls: type,
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    declined: tuple[type[BaseException], str],
) -> Any:
    """The op's backend kernel on the subclass tensors, below the Python key."""
    try:
        with _C._ExcludeDispatchKeyGuard(_ABOVE_PYTHON):
            return func.redispatch(_backend_keys(args, kwargs), *args, **kwargs)
    except Exception as e:
        raise _explained(op, cls, declined, e) from e


def _explained(
    op: CustomOpDef, cls: type, declined: tuple[type[BaseException], str], error: BaseException
) -> BaseException:
    """The class's own error plus one line: the op, and the ways out."""
    name = cls.__name__
    first = next(iter(str(error).strip().splitlines()), "")
    ways = f"torch.library.register_torch_dispatch('{op._qualname}', {name}, rule)"
    if _is_dtensor(cls):
        ways += (
            f", or a sharding rule: torch.distributed.tensor.experimental.register_sharding"
            f"(torch.ops.{op._namespace}.{op._name}.default)"
        )
    line = (
        f"torch_autobatch: {op._qualname} has no rule for {name}, and its function could not run on "
        f"{name} tensors ({type(error).__name__}: {first}); give it one with {ways}."
    )
    error_type, text = declined
    try:
        return error_type(f"{text}\n{line}")
    except Exception:
        return RuntimeError(f"{error_type.__name__}: {text}\n{line}")


def _is_dtensor(cls: type, exactly: bool = False) -> bool:
    # Never imported here: NOTE [Lazy heavy imports]. Not imported yet, no DTensor exists.
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None:
        return False
    return cls is dtensor if exactly else issubclass(cls, dtensor)
