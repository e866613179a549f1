"""``torch.compile`` of a lifted ``autograd.Function``: Dynamo records one call of it, which runs as our op.

NOTE [Dynamo and a lifted Function]
Dynamo never calls ``FunctionClass.apply`` for an ``autograd.Function``
subclass: it traces the class's ``forward`` and ``backward`` itself, so the
``apply`` that ``autobatch`` installs (NOTE [Lifting in place], lift/_lifted.py) is
not seen. Under a torch.func transform in a compiled region that silently
drops the class's rules: ``torch.compile(grad(f))`` differentiates
``forward`` by autograd (a backward that is not the derivative of the
forward is ignored; a forward that leaves torch, numpy, differentiates to
zero). And a ``from_function`` callable that Dynamo traces into defines its
overloads there, which Dynamo cannot trace (``fullgraph=True`` fails on a
first call under compile). So both are allowed in the graph
(``torch._dynamo.allow_in_graph``: the class, and the callable): Dynamo
records one call, which AOTAutograd, ``torch.export`` and ``backend="eager"``
then run as our op, rules included (fused by Inductor where the forward is
torch ops).

Dynamo first runs that call on fake tensors (``torch.compiler.is_compiling()``
holds for the whole compile session, AOTAutograd's trace included). Where the
op cannot be recorded there, the call raises Dynamo's graph break, so it
runs eagerly between compiled graphs (``fullgraph=True`` reports the reason):
its forward leaves torch and it has no fake kernel, some of its arguments
are Python objects (NOTE [Python objects as arguments of a lifted Function],
lift/_objects.py), or its rules read tensor constants (NOTE [A traced rule
cannot read a tensor constant], core/_closure.py; ``torch.export`` keeps the op
whole and traces no rule, so it records the op there). The eager run of that
call is a frame Dynamo would compile again: the code of the function called
(``apply``, ``LiftedFunction.__call__``) is marked for Dynamo to skip, with
every frame it calls.

Registering needs ``torch._dynamo``, which ``import torch_autobatch`` does
not import (about 1 s): what is lifted before it is imported is registered
by a one-shot import hook when ``torch._dynamo`` finishes importing. A class
whose lifting is undone (``del FunctionClass.apply``) stays in the graph:
the recorded call then runs torch's own ``apply``, as the class defines it.
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, Optional

import torch

from ..op._custom_op import _PLAIN_ERRORS

__all__ = ["allow_in_graph", "traced_call"]

_DYNAMO = "torch._dynamo"
_lock = threading.Lock()
_pending: list[tuple[weakref.ref[Any], Callable[..., Any]]] = []  # (what is called, the function it runs)
_hook: Optional[_AfterImport] = None


def allow_in_graph(obj: Any, fn: Callable[..., Any]) -> None:
    """Dynamo records calls of ``obj`` (which run ``fn``) as graph nodes, now or when torch._dynamo is imported."""
    global _hook
    module = sys.modules.get(_DYNAMO)
    if module is not None and hasattr(module, "allow_in_graph"):
        _register(obj, fn)
        return
    with _lock:
        _pending.append((weakref.ref(obj), fn))
        if _hook is None:
            _hook = _AfterImport(_DYNAMO, _register_pending)
            sys.meta_path.insert(0, _hook)


def traced_call(lifted: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, in_place: bool) -> Any:
    """A lifted call run by a compiler (Dynamo on fake tensors, AOTAutograd, export): the op, or a graph break."""
    exporting = torch.compiler.is_exporting()
    who = _who(lifted, in_place)
    objects = lifted.object_arguments(args, kwargs)
    if objects:
        _graph_break(
            who,
            f"its arguments {', '.join(objects)} are Python objects, which a graph cannot hold "
            f"(NOTE [Python objects as arguments of a lifted Function])",
            "pass only tensors, numbers, strings, dtypes and lists of those",
        )
    try:
        op = lifted.overload_for(*args, **kwargs)  # defined now if new: its forward runs on the fake arguments
        if op._ab.eager_under_compile is not None and not exporting:
            _graph_break(
                who,
                f"{op._qualname}'s rules read tensors that are not its arguments "
                f"(NOTE [A traced rule cannot read a tensor constant])",
                "pass those tensors as arguments",
            )
        return lifted._run(args, kwargs)
    except _PLAIN_ERRORS as e:
        # torch's own control-flow exceptions (data-dependent output, ...) are subclasses: they go on
        if exporting or type(e) not in _PLAIN_ERRORS:
            raise
        where = f"{lifted.function_class.__qualname__}.apply.lifted" if in_place else "lifted"
        _graph_break(
            who,
            f"it cannot run on fake tensors: {str(e).splitlines()[0]}",
            f"register a fake kernel for it ({where}.overload_for(*example_arguments).register_fake(fn)) "
            f"where nothing differentiates it; "
            f"where something does, its forward itself must run on fake tensors (its residuals are "
            f"what its backward reads)",
        )


def _who(lifted: Any, in_place: bool) -> str:
    cls = lifted.function_class
    return f"{cls.__qualname__}.apply" if in_place else f"{cls.__qualname__} lifted as {lifted._qualname}"


def _graph_break(who: str, why: str, fix: str) -> None:
    from torch._dynamo.exc import unimplemented

    unimplemented(
        gb_type="torch_autobatch: a lifted autograd.Function runs eagerly",
        context=who,
        explanation=f"torch_autobatch: {who} runs eagerly between compiled graphs: {why} "
        f"(NOTE [Dynamo and a lifted Function]).",
        hints=[f"To compile it into the graph, {fix}."],
    )


def _register(obj: Any, fn: Callable[..., Any]) -> None:
    import torch._dynamo

    torch._dynamo.allow_in_graph(obj)
    try:  # the eager run after a graph break: no frame of it is compiled again
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        set_code_exec_strategy(fn.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))
    except ImportError:  # a torch without it compiles that frame, and fails there with the reason
        pass


def _register_pending() -> None:
    global _hook
    with _lock:
        pending, _pending[:] = list(_pending), []
        if _hook in sys.meta_path:
            sys.meta_path.remove(_hook)
        _hook = None
    for ref, fn in pending:
        obj = ref()
        if obj is not None:
            _register(obj, fn)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``callback`` once the module ``name`` has been executed (an import hook that finds nothing itself)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self._name = name
        self._callback = callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self._name:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader, callback = spec.loader, self._callback
        exec_module = loader.exec_module

        def exec_then_register(module: Any) -> None:
            exec_module(module)
            callback()

        loader.exec_module = exec_then_register  # type: ignore[method-assign]  # this spec's loader only
        return spec
