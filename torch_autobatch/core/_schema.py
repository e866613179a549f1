"""An op's schema: inferred from the function's type hints or given, and checked."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Optional, Union

import torch
from torch._library import custom_ops as _torch_custom_ops
from torch._library.infer_schema import infer_schema


def schema_of(
    name: str,
    fn: Callable[..., Any],
    schema: Optional[str],
    mutates_args: Union[str, Iterable[str]],
    tags: Any,
) -> str:
    """The schema of ``custom_op(name, fn, schema=schema, ...)``, checked (``check_schema``).

    A given schema must mutate exactly ``mutates_args`` (unless ``"unknown"``).
    """
    # (tags: torch.Tag.inplace / out give the return's aliasing, as in torch.library)
    op_schema = (
        schema
        if schema is not None
        else infer_schema(fn, mutates_args=mutates_args, tags=_torch_custom_ops._normalize_tags(tags))
    )
    check_schema(name, op_schema)
    if schema is not None:
        parsed = torch._C.parse_schema(name + schema)
        written = {a.name for a in parsed.arguments if a.alias_info is not None and a.alias_info.is_write}
        declared = {mutates_args} if isinstance(mutates_args, str) else set(mutates_args)
        if declared != {"unknown"} and written != declared:
            raise ValueError(
                f"torch_autobatch.custom_op({name!r}): mutates_args={mutates_args!r} "
                f"but the schema {schema!r} mutates {sorted(written)}; make them agree."
            )
    return op_schema


def check_schema(qualname: str, schema: str) -> None:
    """Refuses what our kernels cannot honour.

    Mutation (``Tensor(a!)``) is fine, and so is returning a mutated argument
    (``(Tensor(a!) x) -> Tensor(a!)``: ``tags=torch.Tag.inplace`` / ``out``);
    a view of an input (``(Tensor(a) x) -> Tensor(a)``) is not.
    """
    parsed = torch._C.parse_schema(qualname + schema)
    mutated_sets = {
        frozenset(a.alias_info.before_set)
        for a in parsed.arguments
        if a.alias_info is not None and a.alias_info.is_write
    }
    aliasing = [a for a in parsed.arguments if a.alias_info is not None and not a.alias_info.is_write]
    returns_a_view = any(
        r.alias_info is not None and not (r.alias_info.is_write and frozenset(r.alias_info.before_set) in mutated_sets)
        for r in parsed.returns
    )
    if aliasing or returns_a_view:
        raise NotImplementedError(
            f"torch_autobatch.custom_op({qualname!r}): the schema {schema!r} declares "
            f"an output that is a view of an input (Tensor(a)), which is not supported; "
            f"return new tensors, or return a mutated argument (Tensor(a!) with "
            f"mutates_args and tags=torch.Tag.inplace or torch.Tag.out)."
        )
