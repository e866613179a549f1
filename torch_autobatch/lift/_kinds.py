"""Arguments of a lifted ``autograd.Function``: each one's kind, and the schema type that holds it.

NOTE [Lifting an autograd.Function] (lift/_lifted.py): each combination of kinds is one overload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch

from ._objects import constants_of, resolve

_Tensor = torch.Tensor
_NoneType = type(None)

# Kinds of arguments, with the schema type each becomes. A list or tuple kind
# is a (container, element kind) pair.
_SCALAR_SCHEMA = {
    "Tensor": "Tensor",
    "None": "Tensor?",
    "bool": "bool",
    "int": "SymInt",
    "float": "float",
    "str": "str",
    "dtype": "ScalarType",
    "device": "Device",
    "layout": "Layout",
    "memory_format": "MemoryFormat",
    "object": "int",  # a handle: NOTE [Python objects as arguments of a lifted Function] (lift/_objects.py)
}
_LIST_SCHEMA = {
    "Tensor": "Tensor[]",
    "Tensor?": "Tensor?[]",
    "bool": "bool[]",
    "int": "SymInt[]",
    "float": "float[]",
}
_EXACT_KINDS: dict[type, str] = {
    _Tensor: "Tensor",
    torch.nn.Parameter: "Tensor",
    _NoneType: "None",
    bool: "bool",
    int: "int",
    float: "float",
    str: "str",
    torch.dtype: "dtype",
    torch.device: "device",
    torch.layout: "layout",
    torch.memory_format: "memory_format",
}
_CONTAINERS: dict[type, str] = {list: "list", tuple: "tuple", torch.Size: "size"}
_OBJECT = "object"  # the kind of a value no schema holds: a constant of the call, kept out of the schema


def _scalar_kind(value: Any) -> Optional[str]:
    kind = _EXACT_KINDS.get(type(value))
    if kind is not None:
        return kind
    if isinstance(value, _Tensor):
        return "Tensor"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return None  # no schema holds it


def _kind(value: Any) -> Any:
    """The kind of one argument: a string (``"object"`` where no schema holds it), or a (container, element kind) pair."""
    kind = _EXACT_KINDS.get(type(value))
    if kind is not None:
        return kind
    container = _CONTAINERS.get(type(value))
    if container is None:
        for base, name in _CONTAINERS.items():
            if isinstance(value, base) and not hasattr(value, "_fields"):  # a namedtuple has meaning
                container = name
                break
        else:
            return _scalar_kind(value) or _OBJECT
    elements = {_scalar_kind(v) for v in value}
    if None in elements:
        return _OBJECT
    if not elements:
        element = "int"  # an empty list: any list type holds it
    elif elements == {"Tensor"}:
        element = "Tensor"
    elif elements <= {"Tensor", "None"}:
        element = "Tensor?"
    elif elements == {"bool"}:
        element = "bool"
    elif elements == {"int"}:
        element = "int"
    elif elements <= {"int", "float"}:
        element = "float"
    else:
        return _OBJECT
    return (container, element)


def _schema_type(kind: Any) -> str:
    return _SCALAR_SCHEMA[kind] if isinstance(kind, str) else _LIST_SCHEMA[kind[1]]


def _kind_token(kind: Any) -> str:
    if isinstance(kind, str):
        return kind
    container, element = kind
    return f"{container}_{element.replace('?', 'opt')}"


def _restore(kinds: tuple[Any, ...], args: tuple[Any, ...], what: str = "") -> tuple[Any, ...]:
    """The arguments as ``forward`` was given them: a tuple (or torch.Size) again where the schema made a list,
    the object again where the schema holds its handle (``what`` names the op in the error of a stale one)."""
    out = list(args)
    for i, kind in enumerate(kinds):
        if kind == _OBJECT:
            if type(out[i]) is int:  # (the call's own value where apply's arguments are restored)
                out[i] = resolve(out[i], i, what or "a lifted autograd.Function")
        elif not isinstance(kind, str):
            container = kind[0]
            if container == "tuple":
                out[i] = tuple(out[i])
            elif container == "size":
                out[i] = torch.Size(out[i])
            elif kind[1] == "float":  # a float list of ints and floats: the ints stay ints
                pass
    return tuple(out)


def needs_restore(kinds: tuple[Any, ...]) -> bool:
    """Does ``forward`` get some argument other than the schema gives it (a tuple, an object)?"""
    return any(not isinstance(k, str) or k == _OBJECT for k in kinds)


def restoring_setup_context(setup_context: Callable[..., Any], kinds: tuple[Any, ...]) -> Callable[..., Any]:
    """``setup_context`` given the inputs as apply was (a tuple again where the schema made a list)."""
    if not needs_restore(kinds):
        return setup_context

    objects = tuple(i for i, k in enumerate(kinds) if k == _OBJECT)

    def restored(ctx: Any, inputs: tuple[Any, ...], output: Any) -> Any:
        out = setup_context(ctx, _restore(kinds, tuple(inputs)), output)
        constants = constants_of(tuple(inputs), objects) if objects else None
        if constants is not None and constants.tracked:  # NOTE [Python objects as arguments of a lifted Function]
            constants.check_kept(ctx, getattr(setup_context, "__qualname__", "setup_context"))
        return out

    restored.__qualname__ = getattr(setup_context, "__qualname__", "setup_context")
    return restored


def restoring_vmap_rule(rule: Callable[..., Any], kinds: tuple[Any, ...]) -> Callable[..., Any]:
    """A vmap staticmethod given the arguments as apply was (a tuple again where the schema made a list)."""
    if not needs_restore(kinds):
        return rule

    def restored(info: Any, in_dims: Any, *args: Any) -> Any:
        return rule(info, in_dims, *_restore(kinds, args))

    restored.__qualname__ = getattr(rule, "__qualname__", "vmap")
    return restored
