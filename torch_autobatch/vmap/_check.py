"""The check of what a ``register_vmap`` rule returns, naming the op and the rule.

NOTE [A vmap rule's return is checked]
torch's helper (``custom_function_call_vmap_helper``) runs the rule, then
checks its return in words about "the autograd.Function's vmap
staticmethod", naming neither the op nor the rule; an out_dim out of range
or not an int fails later, in ``_add_batch_dim``, as a bare IndexError or
TypeError; and an out_dim whose dimension is not the batch's size silently
makes a result of that size. So ``KernelSide._run_vmap_rule`` hands the
helper :func:`checked_rule` instead of the rule: it calls the rule and
checks the return first, on every path the rule runs (``vmap``, nested
``vmap``, ``vmap(grad)``, ``grad(vmap)``, once per call and vmap level). A
wrong return is an error of the type torch raises for it (RuntimeError for
the structure, TypeError for an out_dim's type, IndexError for its range),
naming the op (``ns::name``), the rule (its ``__qualname__`` and
``file:line``), what was expected and what came back. The output's structure
is checked against the op's schema returns (:func:`_check_returns`): one
Tensor, a list of tensors (``Tensor[]``), or a tuple with one value per
return; torch's helper takes any structure and, wrapped back, a wrong one
failed in the op's kernel as ``Unable to cast (BatchedTensor(...), ...) to
Tensor``, or, for an op with several returns given one tensor, was split
along its first dim. An exception the rule raises itself passes through
untouched. An output that is one of the rule's input tensors is exempt
from the range and size checks: torch's helper returns the batched input
for it and ignores its out_dim. Also ``vmap(jvp)`` runs the rule through
this check (NOTE [Derived tangents differentiate the vmap rule]).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

_EXPECTED = (
    "expected (output, out_dims): out_dims an int (the dimension that holds the batch) or None (no batch) "
    "per output, in the output's structure (one for the whole output, or e.g. (0, None) for two outputs)"
)


def checked_rule(
    qualname: str, rule: Callable[..., Any], info: Any, in_dims: Any, *args: Any, **kwargs: Any
) -> tuple[Any, Any]:
    """``rule(info, in_dims, *args, **kwargs)``, its return checked (NOTE [A vmap rule's return is checked])."""
    result = rule(info, in_dims, *args, **kwargs)
    if type(result) is tuple and len(result) == 2:
        output, out_dims = result
        _check_returns(qualname, rule, output)
        if type(out_dims) is int and isinstance(output, torch.Tensor):  # the common case, in short
            _check_dim(qualname, rule, info, args, output, out_dims, None)
        else:
            _check_structure(qualname, rule, info, args, output, out_dims)
        return result
    raise RuntimeError(
        f"{_whose(qualname, rule)} returned {_describe(result)}; {_EXPECTED}. "
        f"Return a pair: `return output, out_dims`, e.g. `return result, 0` for a result batched along dim 0."
    )


def _schema(qualname: str) -> Any:
    """The op's schema (``ns::name`` or ``ns::name.overload``); None where it is not registered."""
    name, _, overload = qualname.partition(".")
    try:
        return torch._C._get_schema(name, overload)
    except RuntimeError:  # gone (a stale op): its kernel refuses the call itself
        return None


def _fits(value: Any, kind: Any) -> bool:
    """Can ``value`` be a return of type ``kind`` (a schema return's type)?"""
    optional = isinstance(kind, torch.OptionalType)
    if optional:
        if value is None:
            return True
        kind = kind.getElementType()
    if isinstance(kind, torch.TensorType):
        return isinstance(value, torch.Tensor)
    if isinstance(kind, torch.ListType):
        element = kind.getElementType()
        if isinstance(element, torch.OptionalType):
            element = element.getElementType()
            if not isinstance(element, torch.TensorType):
                return True
            return isinstance(value, (list, tuple)) and all(v is None or isinstance(v, torch.Tensor) for v in value)
        if not isinstance(element, torch.TensorType):
            return True
        return isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value)
    return not isinstance(value, torch.Tensor)  # a number, a bool: never a tensor


def _check_returns(qualname: str, rule: Callable[..., Any], output: Any) -> None:
    """The rule's output has the structure of the op's returns (NOTE [A vmap rule's return is checked])."""
    schema = _schema(qualname)
    if schema is None:
        return
    returns = schema.returns
    if len(returns) == 1:
        kind = returns[0].type
        if isinstance(output, torch.Tensor) and isinstance(kind, torch.TensorType):  # the common case, in short
            return
        if _fits(output, kind):
            return
    elif type(output) in (tuple, list) and len(output) == len(returns):
        if all(_fits(o, r.type) for o, r in zip(output, returns)):
            return
    declared = str(schema).rpartition(") -> ")[2]
    if len(returns) == 1:
        expected = _expected(returns[0].type)
        example = "[a, b], 0" if expected.startswith("a list") else "result, 0"
        fix = f"return {expected} as the output, e.g. `return {example}`"
    else:
        expected = f"a tuple of {len(returns)} ({', '.join(_expected(r.type) for r in returns)})"
        fix = "return a tuple with one value per return as the output, e.g. `return (a, b), (0, 0)`"
    raise RuntimeError(
        f"{_whose(qualname, rule)} returned as its output {_describe(output)}, but {qualname} returns "
        f"{declared}, so the output must be {expected}. Give the output the op's structure: {fix}."
    )


def _expected(kind: Any) -> str:
    """A schema return's type in words, for an error."""
    if isinstance(kind, torch.OptionalType):
        return f"{_expected(kind.getElementType())} or None"
    if isinstance(kind, torch.TensorType):
        return "a Tensor"
    if isinstance(kind, torch.ListType):
        element = kind.getElementType()
        optional = isinstance(element, torch.OptionalType)
        if optional:
            element = element.getElementType()
        if isinstance(element, torch.TensorType):
            return f"a list of Tensors{' or None' if optional else ''}"
    return f"a {kind.annotation_str}"


def _whose(qualname: str, rule: Callable[..., Any]) -> str:
    name = getattr(rule, "__qualname__", None) or repr(rule)
    code = getattr(inspect.unwrap(rule), "__code__", None)
    where = f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"torch_autobatch: the register_vmap rule of {qualname} ({name}{where})"


def _describe(value: Any) -> str:
    """A short description of a value for an error: its type, tensors with their shape."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        items = ", ".join(_describe(v).removeprefix("a ").removeprefix("an ") for v in value)
        return f"a {type(value).__name__} of {len(value)} ({items})"
    if value is None:
        return "None"
    return f"a {type(value).__name__} ({value!r})"


def _check_structure(
    qualname: str, rule: Callable[..., Any], info: Any, args: tuple[Any, ...], output: Any, out_dims: Any
) -> None:
    flat_outputs, spec = pytree.tree_flatten(output)
    flat_dims = pytree._broadcast_to_and_flatten(out_dims, spec)
    if flat_dims is None:
        raise RuntimeError(
            f"{_whose(qualname, rule)} returned out_dims={out_dims!r}, which does not match the structure of "
            f"its output, {_describe(output)}; {_EXPECTED}. Return out_dims shaped like the output."
        )
    single = len(flat_outputs) == 1
    for i, (out, dim) in enumerate(zip(flat_outputs, flat_dims)):
        where = None if single else i
        if dim is not None and type(dim) is not int:
            raise TypeError(
                f"{_whose(qualname, rule)} returned out_dims={out_dims!r}: the out_dim {dim!r} of "
                f"{_which(where)}, {_describe(out)}, is a {type(dim).__name__}; {_EXPECTED}. "
                f"Return an int or None for it."
            )
        if dim is not None and isinstance(out, torch.Tensor):
            _check_dim(qualname, rule, info, args, out, dim, where)


def _which(where: int | None) -> str:
    return "the output" if where is None else f"output {where}"


def _check_dim(
    qualname: str,
    rule: Callable[..., Any],
    info: Any,
    args: tuple[Any, ...],
    out: torch.Tensor,
    dim: int,
    where: int | None,
) -> None:
    """An int out_dim of a tensor output: in range, and of the batch's size."""
    ndim = out.dim()
    if -ndim <= dim < ndim:
        size, batch = out.size(dim), info.batch_size
        # Only plain ints are compared: a symbolic size would add a guard.
        if type(size) is not int or type(batch) is not int or size == batch or _is_an_input(out, args):
            return
        raise RuntimeError(
            f"{_whose(qualname, rule)} returned out_dim {dim} for {_which(where)}, {_describe(out)}, whose "
            f"dimension {dim} has size {size}, not the vmap's batch size {batch}; {_EXPECTED}. Return the "
            f"dimension that holds the batch (info.batch_size = {batch}), or None for an output that has none."
        )
    if _is_an_input(out, args):
        return
    raise IndexError(
        f"{_whose(qualname, rule)} returned out_dim {dim} for {_which(where)}, {_describe(out)}, which has "
        f"no dimension {dim} (it has {ndim}: out_dims must lie in [{-ndim}, {ndim - 1}]); {_EXPECTED}. "
        f"Return the dimension that holds the batch."
    )


def _is_an_input(out: torch.Tensor, args: tuple[Any, ...]) -> bool:
    """Is ``out`` one of the rule's input tensors (whose out_dim torch's helper ignores)?"""
    return any(out is leaf for leaf in pytree.tree_leaves(args))
