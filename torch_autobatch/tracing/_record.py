"""The record of a trace as Python sees it: values, inputs, groups and entries.

Shared by :mod:`._tracer` (``Trace``: the listing) and :mod:`._trace_fx`
(``Trace.to_fx()``: the replay); it imports neither. :func:`read_record`
turns the C++ record's snapshot (``_C._TraceImpl.snapshot()``, csrc/trace_bindings.cpp)
into these objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple, Optional

import torch

from .. import _C

__all__ = ["read_record"]

_Tensor = torch.Tensor


class _Value:
    """One recorded tensor value, as the listing and ``to_fx`` see it.

    Values are SSA: an in-place op's output is a new value of the same tensor.
    ``num >= 0``: the output numbered ``num`` (``%num``); ``num < 0``: an input
    (:class:`_Input`). ``node``: the index of the traced autograd node that is
    the tensor's grad_fn, or None. Compared and hashed by identity.
    """

    __slots__ = ("num", "shape", "dtype", "node")
    num: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    node: Optional[int]

    def __str__(self) -> str:
        return f"%{self.num}"

    __repr__ = __str__


class _Input(_Value):
    """A tensor that no recorded op made; calling it gives the tensor, or None if freed."""

    __slots__ = ("name", "requires_grad", "_get")
    name: str
    requires_grad: bool
    _get: Callable[[], Optional[_Tensor]]

    def __str__(self) -> str:
        return self.name

    def __call__(self) -> Optional[_Tensor]:
        return self._get()


class _Group:
    """The header recorded ops are listed under: the forward, or one run of one node."""

    __slots__ = ("pass_no", "name", "index")

    def __init__(self, pass_no: int, name: str, index: Any = None) -> None:
        self.pass_no = pass_no  # 0: forward; k: the k-th backward call that ran this trace
        self.name = name
        self.index = index  # a traced node's index in the trace, or an AccumulateGrad's leaf

    @property
    def label(self) -> str:
        if self.index is None:
            return self.name
        if isinstance(self.index, _Value):
            return f"{self.name} ({self.index})"
        return f"{self.name} (node {self.index})"


class _Accumulate:
    """The pseudo-op of an ``AccumulateGrad`` run: ``leaf.grad += grad``."""

    def __repr__(self) -> str:
        return "accumulate_grad"


_ACCUMULATE = _Accumulate()
_EMPTY: dict[str, Any] = {}  # shared "no kwargs"; never mutated


class _Entry(NamedTuple):
    """One recorded op, or one ``AccumulateGrad`` run (``func is _ACCUMULATE``)."""

    group: _Group
    func: Any  # the op's OpOverload, or _ACCUMULATE
    kwargs: dict[str, Any]  # the keyword-only arguments not at their default (_EMPTY if none)
    outs: Any  # a _Value; a tuple of _Values and other returns; another return; None
    args: list[Any]  # the positional arguments a caller passes; AccumulateGrad: [leaf, grad]


# _new_entry(_Entry, fields) makes the same _Entry as _Entry(*fields), without
# NamedTuple's Python-level __new__: per entry, about 60 ns more than the list it
# replaces instead of 190 ns (read_record makes one per recorded op).
_new_entry = tuple.__new__


class _OpInfo:
    """An op the recorder saw: its ``OpOverload`` and how to split its arguments."""

    __slots__ = ("func", "kwarg_only", "defaults")

    _by_id: dict[int, _OpInfo] = {}

    def __init__(self, op_id: int) -> None:
        qualname, overload = _C._op_name(op_id)
        ns, name = qualname.split("::", 1)
        packet = getattr(getattr(torch.ops, ns), name)
        self.func = getattr(packet, overload or "default")
        args = self.func._schema.arguments
        self.kwarg_only = [a.name if a.kwarg_only else None for a in args]
        self.defaults = [(True, a.default_value) if a.has_default_value() else (False, None) for a in args]

    @classmethod
    def of(cls, op_id: int) -> _OpInfo:
        info = cls._by_id.get(op_id)
        if info is None:
            info = cls._by_id[op_id] = cls(op_id)
        return info

    def split(self, args: list[Any]) -> tuple[list[Any], dict[str, Any]]:
        """Schema-ordered ``args`` -> (positional, kwargs), leaving out defaults as a caller would."""
        pos, kwargs = [], {}
        for a, kw, (has_default, default) in zip(args, self.kwarg_only, self.defaults):
            if kw is None:
                pos.append(a)
            elif not (has_default and _same(a, default)):
                kwargs[kw] = a
        n = len(pos)
        while n and self.defaults[n - 1][0] and _same(pos[n - 1], self.defaults[n - 1][1]):
            n -= 1
        return pos[:n], kwargs or _EMPTY


def _same(a: Any, default: Any) -> bool:
    if (
        isinstance(a, _Value)
        or type(a) is not type(default)
        and not (isinstance(a, (int, float)) and isinstance(default, (int, float)))
    ):
        return a is default
    try:
        return bool(a == default)
    except Exception:
        return False


def _input_getter(impl: Any, k: int) -> Callable[[], Optional[_Tensor]]:
    ref = weakref.ref(impl)

    def get() -> Optional[_Tensor]:
        alive = ref()
        return None if alive is None else alive.input_tensor(k)

    return get


def read_record(
    impl: Any,
) -> tuple[list[_Value], list[_Input], list[_Group], list[_Entry]]:
    """(values, inputs, groups, entries) of the C++ record ``impl`` (a ``_C._TraceImpl``) now."""
    raw_values, raw_inputs, raw_groups, raw_entries = impl.snapshot()
    values: list[_Value] = []
    for num, shape, dtype, node in raw_values:
        v = _Input() if num < 0 else _Value()
        v.num, v.shape, v.dtype, v.node = num, shape, dtype, node
        values.append(v)
    inputs = []
    for k, (value, name, requires_grad) in enumerate(raw_inputs):
        v = values[value]
        v.name, v.requires_grad = name, requires_grad
        v._get = _input_getter(impl, k)
        inputs.append(v)
    groups = [_Group(p, name, node if value is None else values[value]) for p, name, node, value in raw_groups]
    entries = []
    for group, op_id, args, outs, refs in raw_entries:
        for out, pos, elem, value in refs:
            where = outs if out else args
            if elem < 0:
                where[pos] = values[value]
            else:
                where[pos][elem] = values[value]
        if op_id < 0:
            entries.append(_new_entry(_Entry, (groups[group], _ACCUMULATE, _EMPTY, None, args)))
            continue
        info = _OpInfo.of(op_id)
        pos_args, kwargs = info.split(args)
        if len(outs) == 1:
            o = outs[0]
            out_value = tuple(o) if type(o) is list else o
        else:
            out_value = tuple(outs) if outs else None
        entries.append(_new_entry(_Entry, (groups[group], info.func, kwargs, out_value, pos_args)))
    return values, inputs, groups, entries
