"""What deployment sees of an op: ONNX export decomposes it, AOTInductor names it when it stays Python.

NOTE [ONNX export sees the function]
``torch.onnx.export(..., dynamo=True)`` exports the program with
``torch.export``, where the op is one node (NOTE [Inductor sees the
function]), then runs ``run_decompositions()`` with a table it builds itself:
every decomposition in ``torch.export.default_decompositions()`` and
``torch._decomp.decomposition_table`` for an op that has no ONNX function in
its registry (torch/onnx/_internal/exporter/_decomp.py,
``create_onnx_friendly_decomposition_table``, called through its module by
``_fx_passes.decompose_with_registry``). A fused op is added to that table,
with the decomposition Inductor gets, so its node becomes its function's
aten ops and those the ONNX ops of the plain function. An op that has an
ONNX function in the registry (the user's ``custom_translation_table``) is
left out, as torch leaves out an aten op with one: the user's translation
applies, for a fused op too. A ``compile="opaque"`` op is never added: it
stays one node, which exports only through a translation table. A function
that cannot be traced (it leaves torch) returns ``NotImplemented`` and the op
stays one node as well.

torch offers no public hook for this table; ``torch._decomp.decomposition_table``,
which the exporter also reads, is read by others too (DTensor's sharding
propagation, ``TorchRefsMode``), which would then decompose the op. So the
exporter's function is wrapped, in :func:`_wrap_onnx_table` only, once the
module is imported (never by us: ``import torch_autobatch`` must not import
torch.onnx, NOTE [Lazy heavy imports]). The constraint: the exporter must call
``_decomp.create_onnx_friendly_decomposition_table`` through the module
attribute, with the set of ops its registry implements, and run the table it
returns (torch 2.13-2.15); test/test_onnx.py fails if it stops doing so.

NOTE [AOTInductor names a Python op]
An op that reaches Inductor's lowering as a node (``compile="opaque"``; a
function that leaves torch, whose decomposition returned ``NotImplemented``;
Inductor's debug ``config.fallback_random``) becomes an extern call of
``torch.ops.ns.name``. In an AOTInductor package that call goes through the
dispatcher, where the op's kernel is the Python function: the package then
loads only in a Python process that has imported the op's module, never from
libtorch alone. Each op has an entry in Inductor's ``user_lowerings``
(torch/_inductor/lowering.py), which ``GraphLowering.call_function`` runs
before the op's lowering and falls back to it when the entry returns None;
ours warns when ``V.graph.aot_mode`` holds, naming the op, why, and what the
package needs, and returns None. The entry is put there once
``torch._inductor.lowering`` is imported (by Inductor itself), and only where
no one else put one (``register_custom_op_autotuning`` puts its own).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..core import _import_hook

if TYPE_CHECKING:
    from ..core._types import CustomOpDef

__all__ = ["register", "unregister"]

_ONNX_DECOMP = "torch.onnx._internal.exporter._decomp"
_INDUCTOR_LOWERING = "torch._inductor.lowering"

_lock = threading.Lock()
# The op now registered under each overload, and its decomposition (None: opaque).
_ops: dict[torch._ops.OpOverload, tuple[weakref.ref[CustomOpDef], Optional[Callable[..., Any]]]] = {}
# Each op's entry in Inductor's user_lowerings, to remove only our own.
_lowerings: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
_hooked = False


def register(opdef: CustomOpDef, decomposition: Optional[Callable[..., Any]]) -> None:
    """Lists the op for ONNX export (with its ``decomposition``, a fused op)
    and for the AOTInductor check (NOTE [ONNX export sees the function])."""
    global _hooked
    overload = opdef._opoverload
    with _lock:
        _ops[overload] = (weakref.ref(opdef), decomposition)
        hook, _hooked = not _hooked, True
    if hook:
        _import_hook.after_import(_ONNX_DECOMP, _wrap_onnx_table)
        _import_hook.after_import(_INDUCTOR_LOWERING, _add_lowerings)
    else:
        module = _import_hook.is_loaded(_INDUCTOR_LOWERING)
        if module is not None:
            _add_lowerings(module, [overload])


def unregister(opdef: CustomOpDef) -> None:
    """Removes the op's entries (its definition is gone), not those of a redefinition under its name."""
    overload = opdef._opoverload
    with _lock:
        entry = _ops.get(overload)
        if entry is None or entry[0]() not in (opdef, None):
            return
        del _ops[overload]
        ours = _lowerings.pop(overload, None)
    module = _import_hook.is_loaded(_INDUCTOR_LOWERING)
    if module is not None and ours is not None and module.user_lowerings.get(overload) is ours:
        del module.user_lowerings[overload]


def onnx_decompositions() -> dict[torch._ops.OpOverload, Callable[..., Any]]:
    """The fused ops' decompositions, for the ONNX exporter's table."""
    with _lock:
        return {overload: fn for overload, (ref, fn) in _ops.items() if fn is not None and ref() is not None}


def _wrap_onnx_table(module: ModuleType) -> None:
    """Adds the fused ops to the ONNX exporter's decomposition table (NOTE [ONNX export sees the function])."""
    original = module.create_onnx_friendly_decomposition_table
    if getattr(original, "_torch_autobatch", False):
        return

    @functools.wraps(original)
    def create_onnx_friendly_decomposition_table(onnx_registered_ops: Any) -> dict[Any, Callable[..., Any]]:
        table = original(onnx_registered_ops)
        for overload, fn in onnx_decompositions().items():
            if overload not in onnx_registered_ops:  # a translation table's op keeps its translation
                table.setdefault(overload, fn)
        return table

    create_onnx_friendly_decomposition_table._torch_autobatch = True  # type: ignore[attr-defined]
    setattr(module, "create_onnx_friendly_decomposition_table", create_onnx_friendly_decomposition_table)  # noqa: B010


def _add_lowerings(module: ModuleType, overloads: Optional[list[torch._ops.OpOverload]] = None) -> None:
    """Puts each op's AOTInductor check in Inductor's ``user_lowerings`` (NOTE [AOTInductor names a Python op])."""
    with _lock:
        todo = {o: _ops[o] for o in (overloads if overloads is not None else list(_ops)) if o in _ops}
    for overload, (ref, _) in todo.items():
        lowering = functools.partial(_check_aot, ref)
        with _lock:
            current = module.user_lowerings.get(overload)
            if current is not None and current is not _lowerings.get(overload):
                continue  # someone else's lowering
            module.user_lowerings[overload] = _lowerings[overload] = lowering


def _check_aot(ref: weakref.ref[CustomOpDef], *args: Any, **kwargs: Any) -> None:
    """Inductor lowers the op as an extern call: in an AOTInductor package, warn (NOTE [AOTInductor names a Python op])."""
    from torch._inductor import config
    from torch._inductor.virtualized import V

    opdef = ref()
    if opdef is None or not getattr(V.graph, "aot_mode", False):
        return None
    with _lock:
        entry = _ops.get(opdef._opoverload)
    if entry is None or entry[1] is None:
        why = 'it was defined with compile="opaque"'
    elif config.fallback_random:
        why = "Inductor's config.fallback_random keeps it an extern call"
    else:
        why = (
            "its function could not be traced into the graph (it leaves torch: .numpy(), "
            "Python control flow on tensor values)"
        )
    module = getattr(opdef._init_fn, "__module__", None) or "<unknown>"
    warnings.warn(
        f"torch_autobatch: AOTInductor keeps op {opdef._qualname} a Python call, not compiled into the "
        f"package: {why}. The package calls torch.ops.{opdef._namespace}.{opdef._name} through the "
        f"dispatcher, so it loads only in a Python process that has imported the op's module "
        f"({module}) first, never from libtorch (C++) alone. An op whose function is made of torch "
        f'ops, with compile="fuse" (the default), is compiled into the package.',
        UserWarning,
        stacklevel=2,
    )
    return None
