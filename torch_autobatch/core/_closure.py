"""What an op's user code closes over, for the kernels' check (NOTE [What the function closes over], csrc/closure.cpp)."""

from __future__ import annotations

import builtins
import dis
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from ._types import KernelSide

_MISSING = object()


def _static_attr(obj: Any, name: str) -> Any:
    """``obj.name`` where it is stored data (a module's or instance's dict, an ``nn.Module``'s tensors), else ``_MISSING``.

    No property, ``__getattr__`` or descriptor runs: the kernels look chains up
    on every call, and user code must not run there.
    """
    if isinstance(obj, torch.Tensor):
        return _MISSING  # its attributes are properties (.T, .grad, .data)
    if isinstance(obj, torch.nn.Module):
        state = obj.__dict__
        for store in ("_parameters", "_buffers", "_modules"):
            if name in state.get(store, ()):
                return state[store][name]  # functional_call swaps its wrappers in here
        return state.get(name, _MISSING)
    stored = getattr(obj, "__dict__", None) if isinstance(obj, (types.ModuleType, type)) else vars_of(obj)
    return stored.get(name, _MISSING) if stored is not None else _MISSING


def vars_of(obj: Any) -> Optional[Any]:
    """An instance's own ``__dict__``, or None (slots, builtins)."""
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None


class Chain:
    """Resolves ``var.a.b`` from ``var``'s value as far as stored data goes, for the C++ check (called per op call)."""

    def __init__(self, attrs: tuple[str, ...]) -> None:
        self.attrs = attrs

    def __call__(self, value: Any) -> Any:
        for attr in self.attrs:
            found = _static_attr(value, attr)
            if found is _MISSING:
                return value
            value = found
        return value


def _checked_attrs(value: Any, attrs: tuple[str, ...]) -> tuple[str, ...]:
    """The part of the chain worth checking: up to a tensor it reaches below its root, or a slot one may fill later.

    Empty when the chain reaches nothing of the kind (a function, a number).
    """
    for depth, attr in enumerate(attrs):
        if isinstance(value, torch.Tensor):
            return attrs[:depth]  # .shape, .T: the tensor itself is what is checked
        found = _static_attr(value, attr)
        if found is _MISSING:
            # unset on an instance whose class does not define it: set later
            unset = vars_of(value) is not None and not isinstance(value, (type, types.ModuleType))
            return attrs if unset and not hasattr(type(value), attr) else ()
        value = found
    if value is None or isinstance(value, torch.Tensor):
        return attrs
    return attrs if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value) else ()


# Reading these off a tensor gives nothing differentiable: a variable read only
# for them (`W.shape`, `model.weight.detach()`) is not checked.
_METADATA = frozenset(
    "shape dtype device ndim layout is_cuda is_sparse requires_grad size dim numel nelement stride "
    "element_size is_contiguous is_floating_point is_complex data_ptr storage_offset names detach data "
    "item tolist new_zeros new_ones new_empty new_full new_tensor get_device is_leaf".split()
)


def _loads(code: types.CodeType) -> Iterator[tuple[str, str, tuple[str, ...]]]:
    """Each global or closure variable ``code`` loads as a tensor may be, with the attributes read off it (kind, name, attrs).

    Loads read only for metadata (``_METADATA``) are left out.
    """
    instructions = list(dis.get_instructions(code))
    for i, ins in enumerate(instructions):
        if ins.opname not in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF"):
            continue
        attrs: list[str] = []
        metadata = False
        for nxt in instructions[i + 1 :]:
            is_attr = nxt.opname == "LOAD_ATTR"
            # LOAD_METHOD (3.11) or LOAD_ATTR's method flag (3.12+): the method called is not data
            method = nxt.opname == "LOAD_METHOD" or (
                is_attr and sys.version_info >= (3, 12) and bool((nxt.arg or 0) & 1)
            )
            if not (is_attr or method):
                break
            metadata = nxt.argval in _METADATA
            if metadata or method:
                break
            attrs.append(nxt.argval)
        if metadata:
            continue
        yield ("global" if ins.opname == "LOAD_GLOBAL" else "cell"), ins.argval, tuple(attrs)
    for const in code.co_consts:  # a comprehension's or lambda's code reads the same globals
        if isinstance(const, types.CodeType):
            yield from (load for load in _loads(const) if load[0] == "global")


def _closure_of(fn: Optional[Callable[..., Any]]) -> list[tuple[Any, ...]]:
    """``fn``'s entries for the check: (function, variable, cell or globals or value[, Chain, shown name])."""
    fn = getattr(fn, "__func__", fn)  # a bound method's function
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "its function"))
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    entries: list[tuple[Any, ...]] = [(name, var, cell) for var, cell in cells.items()]
    defaults = getattr(fn, "__defaults__", None) or ()
    positional = code.co_varnames[: code.co_argcount]
    for var, value in zip(positional[len(positional) - len(defaults) :], defaults):
        if isinstance(value, torch.Tensor):
            entries.append((name, var, value))
    # Globals are read by name at each call: the module's dict is handed over,
    # for the names that hold a tensor now or may later (None, or not yet defined).
    module_globals = getattr(fn, "__globals__", None) or {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for kind, var, attrs in _loads(code):
        if kind == "cell" and var not in cells:
            continue
        if kind == "global":
            holder: Any = module_globals
            value = module_globals.get(var, _MISSING)
            if value is _MISSING and hasattr(builtins, var):
                continue
            unknown = value is _MISSING or value is None  # defined or set after the op
            if (var, ()) not in seen and (unknown or isinstance(value, torch.Tensor)):
                entries.append((name, var, holder))
            seen.add((var, ()))
        else:
            holder = cells[var]
            value = _cell_value(holder)
            unknown = value is _MISSING or value is None
        attrs = attrs if unknown else _checked_attrs(value, attrs)
        if attrs and (var, attrs) not in seen:
            entries.append((name, var, holder, Chain(attrs), ".".join((var, *attrs))))
        seen.add((var, attrs))
    return entries


def _cell_value(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # empty
        return _MISSING


def refresh(op: KernelSide) -> None:
    """Hands the C++ check what the op's function, fwd and vmap rule close over now."""
    entries = [e for fn in (op._init_fn, op._ab.vjp_fwd, op._vmap_fn) for e in _closure_of(_user_code(fn))]
    op._ab.registration.set_closure(tuple(entries))


def _user_code(fn: Any) -> Any:
    """The user's function behind ``fn``: a lifted ``autograd.Function``'s ``forward`` for its kernel (lift/_lifted.py)."""
    kernel = getattr(fn, "__self__", fn)  # the kernel's bound fwd
    return kernel.forward if hasattr(kernel, "lifted_class") else fn


# NOTE [A traced rule cannot read a tensor constant]
# torch.compile traces the op's registered rules (backward, setup_context,
# register_vjp's fwd and bwd, jvp) into the compiled graph, with fake tensors.
# A rule that reads a real tensor that is not an argument (a module-level
# table, a closed-over matrix) would make it a constant of the graph, which a
# later rebinding or in-place change of the tensor would not reach: Dynamo
# guards and passes in the tensors it sees, and it sees the op, not its rules.
# So where a rule reads names that hold a tensor when it is registered (global
# names, closure cells, attribute chains: _closure_of), a call of the op under
# torch.compile (not torch.export, which traces no rule and keeps the op as
# one node) runs eagerly, between compiled graphs (a graph break at the
# op, through torch.compiler.disable with a reason naming the op and the
# tensors: fullgraph=True reports it): the rules then read the current
# tensors, as in eager mode. What is still traced with one (a name that held
# no tensor at registration; a call of torch.ops.ns.name itself, which no
# Python of ours wraps) fails with FakeTensorMode's "Please convert all Tensors
# to FakeTensors first": that error is replaced by one naming the op, the rule,
# the tensor and the fix. The op's function may read such tensors (NOTE [A
# fake run of the function reads its tensor constants], graphs/_compile.py).
def refresh_eager_under_compile(op: KernelSide) -> None:
    """Sets ``op._ab.eager_under_compile`` from what the op's rules read now."""
    ab = op._ab
    rules = [op._setup_context_fn, op._backward_fn, ab.jvp_fn, ab.jvp_setup_context_fn, ab.vjp_fwd, ab.vjp_bwd]
    lifted = getattr(op._init_fn, "lifted_class", None)
    if lifted is not None:  # a lifted class's rules are its own staticmethods
        rules += [getattr(lifted, "backward", None), getattr(lifted, "jvp", None)]
    names = []
    for rule in rules:
        for entry in _closure_of(_user_code(rule)):
            value = _entry_value(entry)
            if isinstance(value, (tuple, list)):
                value = next((v for v in value if isinstance(v, torch.Tensor)), None)
            if isinstance(value, torch.Tensor):
                names.append(f"'{entry[4] if len(entry) > 3 else entry[1]}'")
    if not names:
        ab.eager_under_compile = None
        return
    overload = op._opoverload

    def eager(*args: Any, **kwargs: Any) -> Any:
        return overload(*args, **kwargs)

    ab.eager_under_compile = torch.compiler.disable(
        eager,
        reason=f"torch_autobatch: {op._qualname}'s rules read {', '.join(dict.fromkeys(names))}, tensors that are not "
        f"arguments of the op: it runs eagerly between compiled graphs, so that they read the current tensors "
        f"(NOTE [A traced rule cannot read a tensor constant]). Pass them to the op as arguments to compile it "
        f"into the graph.",
    )


_FAKE_REFUSAL = "Please convert all Tensors to FakeTensors first"


def is_fake_refusal(error: BaseException) -> bool:
    """Is ``error`` FakeTensorMode's refusal of a real tensor among fake ones?"""
    return _FAKE_REFUSAL in str(error)


def explain_fake_refusal(qualname: str, what: str, rules: tuple[Any, ...], error: BaseException) -> None:
    """Raises the clear error for FakeTensorMode's refusal of a real tensor in a traced rule; returns otherwise."""
    if not is_fake_refusal(error):
        return
    names = []
    for rule in rules:
        for entry in _closure_of(rule):
            value = _entry_value(entry)
            if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
                names.append(f"'{entry[4] if len(entry) > 3 else entry[1]}' ({entry[0]})")
    read = ", ".join(dict.fromkeys(names)) or "a tensor that is not one of its arguments"
    raise RuntimeError(
        f"torch_autobatch: {qualname}: its {what} reads {read}, a real tensor that is not an argument of the op, "
        f"and torch.compile / torch.export trace the {what} with fake tensors, where it could only become a "
        f"constant of the graph (a later rebinding or in-place change of it would not be seen). Pass it to the op "
        f"as an argument, and return None as its gradient (NOTE [A traced rule cannot read a tensor constant]); "
        f"the op's function itself may read it."
    ) from error


def _entry_value(entry: tuple[Any, ...]) -> Any:
    holder = entry[2]
    if isinstance(holder, dict):
        value = holder.get(entry[1])
    elif type(holder).__name__ == "cell":
        value = _cell_value(holder)
    else:
        value = holder
    return entry[3](value) if len(entry) > 3 and value is not _MISSING else value
