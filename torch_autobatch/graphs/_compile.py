"""What graph tracers and compilers see of an op: its node, or its function.

NOTE [Inductor sees the function]
``torch.compile``'s AOTAutograd traces the op through our Autograd kernel,
which attaches the op's grad node (the registered backward and jvp) before
the op reaches the tracer's mode at the Python key; the tracer then records
the op as one node, or, when the op is in the tracer's decomposition table,
the aten ops of the function. Inductor cannot fuse through a node it must
run as an extern kernel (the Python function, eagerly), so each op is listed
in Inductor's decomposition table, and in no other: torch.export and
make_fx keep the op as one node, and ``run_decompositions()`` decomposes it
only where the user's table lists it. By the time Inductor's table applies,
the rules are already in the joint graph (or, for an inference graph, never
needed: a compiled graph is never differentiated again), so the user's
rules are what the compiled backward runs.

Inductor's module costs seconds to import, and its table is built when it
is: the ops are listed once it is imported (a one-shot import hook if it is
not yet), in the table ``select_decomp_table()`` returns (under Inductor's
debug ``config.fallback_random`` the ops stay extern calls). A marker op listed there too
tells the batched kernel that a trace is Inductor's (NOTE [A trace keeps the
op], csrc/vmap_loop.h). ``compile="opaque"`` keeps an op out of the table:
it stays one extern call.

NOTE [The compile cache key names the function]
AOTAutograd's cache keys a compiled graph by Dynamo's graph, where the op is
one node named ``ns.name``: a fused op's function, and the registered
rules traced into the joint graph, are not in that key, and a later process
whose op has another function under the same name would be served the old
compiled code. Inductor's ``unsafe_marked_cacheable_functions`` (keyed by
``torch.ops.ns.name``) is part of every cache key; each op puts
a fingerprint there (an opaque op too: its rules are traced into the joint
graph): the source of its function and of each registered
rule, and what the global and closure names they use are (a module, a
function by name and source, a value by repr, a tensor by its bytes). It is
taken when Inductor is imported and again at each registration, so a global
rebound between a registration and a compile is not seen. A mutable global
described by value (a dict of counters) moves the fingerprint when it
changes: a cache miss, never a stale hit. The fingerprint also holds a
digest of this package (its Python sources and its built extension): how an
op is traced into a graph is this package's code, and a process running
another build of it must not be served graphs the old one traced.

A function that cannot be traced (it leaves torch: ``.item()``, ``.numpy()``,
Python control flow on values) makes the decomposition return
``NotImplemented``, and the tracer records the op as one node instead.

NOTE [TorchScript sees the op]
``torch.jit.script`` looks a Python value it calls up in ``torch.jit``'s
builtin table (``torch.jit._builtins``: ``torch.add`` -> ``aten::add``) by
``id()``; a value not there it calls back into Python: for torch.library's
``CustomOpDef`` a ``python_value`` node that ``torch.jit.save`` cannot
serialize, for ours an internal assert (its ``__signature__`` is the
function's, its ``__call__`` takes ``*args``). Each op is in that table as
its operator ``ns::name``, so a scripted function or module that calls it
(a global ``op(x)`` or an attribute ``self.op = op``) holds the op's node, as
with ``torch.ops.ns.name(x)``, and saves and loads as one. Keyed by ``id()``,
the entry goes with the op's definition (NOTE [Kernels die with their op]),
while the op is alive: a later object with the same id is not taken for it.
Two other readers of the table see the op as ``torch.ops.ns.name`` too:
torch.fx's ``get_signature_for_torch_op`` (its schema's signature), and
``torch.distributed.rpc``, which runs it on the worker as a builtin (the
worker must have imported the op's definition, as for ``torch.ops``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import marshal
import os
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.utils import _pytree as pytree

from .. import _C
from ..core import _closure, _import_hook
from . import _deploy

if TYPE_CHECKING:
    from ..core._types import CustomOpDef

__all__ = [
    "COMPILE_MODES",
    "dissolves_in_trace",
    "fingerprint",
    "refresh_cache_key",
    "register",
    "traced_by_aot_autograd",
    "unlist_for_inductor",
    "unlist_for_torchscript",
]

#: The values of ``custom_op(..., compile=...)``.
COMPILE_MODES = ("fuse", "opaque")

_INDUCTOR_DECOMPOSITION = "torch._inductor.decomposition"
_lock = threading.Lock()
# The decompositions to list in Inductor's table, keyed by op overload;
# filled before Inductor is imported, applied when it is.
_pending: dict[torch._ops.OpOverload, Callable[..., Any]] = {}
# Every op (listed or opaque), for its cache-key fingerprint (NOTE [The
# compile cache key names the function]).
_ops: weakref.WeakSet[CustomOpDef] = weakref.WeakSet()
_hook_installed = False

_MARKER_LIB = torch.library.Library("torch_autobatch", "FRAGMENT")  # noqa: TOR901
_MARKER_LIB.define("_inductor_marker(Tensor x) -> Tensor")
#: Listed in Inductor's table only: its presence identifies that table.
_MARKER = torch.ops.torch_autobatch._inductor_marker.default


def _inductor_table(module: ModuleType) -> dict[Any, Callable[..., Any]]:
    """The dict ``select_decomp_table()`` returns by default, on torch 2.13-2.15.

    ``fast_random_decomps()`` is a ``functools.cache``: the same dict on each
    call. Inductor also checks that no op it runs as an extern kernel is
    listed in it, so an op whose decomposition returned ``NotImplemented`` is
    taken out (``_list``).
    """
    return module.fast_random_decomps()


def _apply(module: ModuleType, ops: Optional[list[CustomOpDef]] = None) -> None:
    """Lists ``ops`` (default: every op so far) in Inductor's table, the fused ones, and fingerprints them."""
    with _lock:
        if ops is None:
            ops = list(_ops)
            entries = dict(_pending)
        else:
            entries = {op._opoverload: _pending[op._opoverload] for op in ops if op._opoverload in _pending}
    for opdef in ops:
        refresh_cache_key(opdef)
    table = _inductor_table(module)
    table.update(entries)
    table[_MARKER] = _marker_decomposition
    # config.fallback_random returns ``decompositions`` itself: the marker
    # only (the ops stay extern calls there).
    module.decompositions[_MARKER] = _marker_decomposition


def _marker_decomposition(x: torch.Tensor) -> torch.Tensor:
    return x


def _sync(opdef: CustomOpDef) -> None:
    global _hook_installed
    module = sys.modules.get(_INDUCTOR_DECOMPOSITION)
    if module is not None and hasattr(module, "fast_random_decomps"):
        _apply(module, [opdef])
        return
    refresh_cache_key(opdef)  # Inductor's config may be loaded without its table
    with _lock:
        install, _hook_installed = not _hook_installed, True
    if install and module is None:  # imported later: every op is listed then
        _import_hook.after_import(_INDUCTOR_DECOMPOSITION, _apply)


def register(opdef: CustomOpDef, fuse: bool) -> None:
    """Fingerprints ``opdef`` for the compile caches and, with ``fuse``, lists
    it in Inductor's decomposition table (NOTE [Inductor sees the function]);
    TorchScript then scripts a call of it as its operator (NOTE [TorchScript sees the op])."""
    with _lock:
        _ops.add(opdef)
    if fuse:
        _list(opdef)
    _sync(opdef)
    # NOTE [ONNX export sees the function], NOTE [AOTInductor names a Python op]
    _deploy.register(opdef, opdef._ab.inductor_decomposition if fuse else None)
    _torchscript_builtins()[id(opdef)] = opdef._opoverload._schema.name  # "ns::name"


def _torchscript_builtins() -> dict[int, str]:
    """``torch.jit``'s table of Python callables it scripts as operators (NOTE [TorchScript sees the op])."""
    return torch.jit._builtins._get_builtin_table()


def unlist_for_torchscript(opdef: CustomOpDef) -> None:
    """Removes the op's TorchScript entry (its definition is gone: NOTE [TorchScript sees the op])."""
    _torchscript_builtins().pop(id(opdef), None)


def _list(opdef: CustomOpDef) -> None:
    ref = weakref.ref(opdef)
    overload = opdef._opoverload

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        op = ref()
        out = NotImplemented if op is None else decompose(op, args, kwargs)
        if out is NotImplemented:
            # Inductor refuses to run as an extern kernel an op its table
            # lists: unlisted, the op stays opaque from now on.
            _unlist(overload, decomposition)
        return out

    decomposition.__name__ = f"torch_autobatch_{opdef._name}"
    opdef._ab.inductor_decomposition = decomposition
    with _lock:
        _pending[overload] = decomposition


def unlist_for_inductor(opdef: CustomOpDef) -> None:
    """Removes the op's entries, Inductor's and ONNX's (its definition is gone: NOTE [Kernels die with their op])."""
    _deploy.unregister(opdef)
    decomposition = opdef._ab.inductor_decomposition
    if decomposition is not None:
        _unlist(opdef._opoverload, decomposition)


def _unlist(overload: torch._ops.OpOverload, decomposition: Callable[..., Any]) -> None:
    # Only this op's own entry: a redefinition under the same name may have
    # listed the new op's already.
    tables: list[dict[Any, Callable[..., Any]]] = [_pending]
    module = sys.modules.get(_INDUCTOR_DECOMPOSITION)
    if module is not None and hasattr(module, "fast_random_decomps"):
        tables.append(_inductor_table(module))
    with _lock:
        for table in tables:
            if table.get(overload) is decomposition:
                del table[overload]


def refresh_cache_key(opdef: CustomOpDef) -> None:
    """Puts the op's fingerprint in Inductor's cache keys, once Inductor is imported."""
    _closure.refresh_eager_under_compile(opdef)  # (also at each registration)
    config = sys.modules.get("torch._inductor.config")
    if config is None or opdef not in _ops:
        return
    key = f"torch.ops.{opdef._namespace}.{opdef._name}"
    # Inductor's config module sets its attributes at import: mypy cannot see them.
    marked = dict(config.unsafe_marked_cacheable_functions)
    marked[key] = fingerprint(opdef)
    config.unsafe_marked_cacheable_functions = marked  # type: ignore[attr-defined]


def fingerprint(opdef: CustomOpDef) -> str:
    """A digest of what the op computes: its function and rules (NOTE [The compile cache key names the function]).

    Where a value cannot be described, a digest of this process only: the
    op's compiled graphs are then not reused by another process.
    """
    ab = opdef._ab
    rules = [
        opdef._init_fn,
        *opdef._backend_fns.values(),
        opdef._backward_fn,
        opdef._setup_context_fn,
        ab.jvp_fn,
        ab.jvp_setup_context_fn,
        opdef._vmap_fn,
        opdef._abstract_fn,
        ab.vjp_fwd,
        ab.vjp_bwd,
    ]
    h = hashlib.sha256(f"{opdef._qualname}{opdef._schema}".encode())
    h.update(_package_digest())
    try:
        for rule in rules:
            h.update(_describe(rule, depth=2).encode())
    except Exception:
        h.update(_PROCESS_NONCE)
    return h.hexdigest()[:32]


_PROCESS_NONCE = os.urandom(16)


@functools.cache
def _package_digest() -> bytes:
    """A digest of this package's code: its Python sources and its extension's file (by size and time)."""
    h = hashlib.sha256()
    package = Path(__file__).resolve().parent.parent
    for path in sorted(package.rglob("*.py")):
        h.update(str(path.relative_to(package)).encode() + path.read_bytes())
    stat = os.stat(_C.__file__)
    h.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
    return h.digest()


# Containers and tensors are described up to these sizes (larger ones by type and shape).
_MAX_ITEMS, _MAX_NUMEL = 64, 1 << 16


def _describe(obj: Any, depth: int) -> str:
    """A process-independent description of ``obj`` for :func:`fingerprint`."""
    obj = inspect.unwrap(obj) if callable(obj) else obj
    if isinstance(obj, types.FunctionType):
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            text = marshal.dumps(obj.__code__).hex()
        if depth <= 0:
            return f"fn:{obj.__qualname__}:{text}"
        parts = [text]
        for name in sorted(_names(obj.__code__)):
            if name in obj.__globals__:
                parts.append(f"{name}={_describe(obj.__globals__[name], depth - 1)}")
        for cell in obj.__closure__ or ():
            try:
                parts.append(_describe(cell.cell_contents, depth - 1))
            except ValueError:  # an empty cell
                parts.append("<empty>")
        return "fn:" + "|".join(parts)
    if isinstance(obj, types.ModuleType):
        return f"module:{obj.__name__}"
    if isinstance(obj, torch.Tensor):
        return _describe_tensor(obj)
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes, torch.dtype)):
        return repr(obj)
    if isinstance(obj, (tuple, list)):
        if len(obj) > _MAX_ITEMS:
            return f"{type(obj).__name__}:{len(obj)}"
        return "[" + ",".join(_describe(v, depth) for v in obj) + "]"
    qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(qualname, str):  # a class, a builtin, a torch function
        return f"{getattr(obj, '__module__', '')}.{qualname}"
    text = repr(obj)
    return type(obj).__qualname__ if " at 0x" in text else f"{type(obj).__qualname__}:{text[:256]}"


def _describe_tensor(t: torch.Tensor) -> str:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) or torch._C._functorch.is_functorch_wrapped_tensor(t):
        return f"tensor:{type(t).__qualname__}"  # a subclass or a transform's wrapper (escaped from it)
    head = f"tensor:{t.dtype}:{tuple(t.shape)}"
    if t.device.type == "meta" or t.numel() > _MAX_NUMEL:
        return head
    data = t.detach().cpu().contiguous().view(-1).view(torch.uint8)
    return f"{head}:{hashlib.sha256(data.numpy().tobytes()).hexdigest()}"


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


# NOTE [A fake run of the function reads its tensor constants]
# A function may read tensors that are not its arguments: a module-level
# lookup table, a constant matrix in a closure. Run as the op's fake kernel
# (torch.compile's and torch.export's fake tensors), those are real tensors
# among fake ones, which FakeTensorMode refuses ("Please convert all Tensors
# to FakeTensors first"); the plain function compiles. A fake run computes
# metadata only, so for it the mode converts them to fake tensors: nothing of
# their values enters a graph, which keeps the op as one node whose kernel
# reads them when it runs (the current tensor, after a rebinding or an
# in-place change). The op's fake kernel, and its function run once on
# batched fake tensors (Dynamo's propagation of vmap(op)), get this; never a
# run a graph tracer records (Inductor's decomposition of the op, NOTE
# [Inductor sees the function]): there the function fails on such a tensor,
# so the op stays an extern call.
@contextlib.contextmanager
def constants_allowed(args: Any) -> Iterator[None]:
    """FakeTensorMode takes real tensors as constants here, unless a graph tracer records what runs."""
    mode = allow_constants(args)
    try:
        yield
    finally:
        disallow_constants(mode)


def allow_constants(args: Any) -> Any:
    """Lets the fake mode of ``args`` take real tensors; returns it (for :func:`disallow_constants`), or None."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return None  # traced into a graph (Inductor's decomposition): never
    mode = torch._guards.detect_fake_mode(args)
    if mode is None or mode.allow_non_fake_inputs:
        return None
    mode.allow_non_fake_inputs = True
    return mode


def keep_companion_opaque(opdef: CustomOpDef) -> None:
    """The op's vmapped companion stays an extern call for Inductor: it was recorded where its function could not be traced."""
    comp = opdef._ab.vmapped_companion
    decomposition = None if comp is None else comp._ab.inductor_decomposition
    if decomposition is not None:
        _unlist(comp._opoverload, decomposition)


def disallow_constants(mode: Any) -> None:
    if mode is not None:
        mode.allow_non_fake_inputs = False


def dissolves_in_trace(overload: torch._ops.OpOverload) -> bool:
    """Does the active graph tracer decompose this op (NOTE [A trace keeps the op])?

    True when the tracer's decomposition table lists the op (the user asked
    for its decomposition) or is Inductor's (rules already traced).
    """
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY)
    table = getattr(mode, "decomposition_table", None)
    if not table:
        return False
    return overload in table or _MARKER in table


# NOTE [AOTAutograd traces vmap(op) as eager runs it]
# AOTAutograd (torch.compile with any backend, aot_function / aot_module)
# traces a program through autograd: the joint graph holds the op's
# registered backward (and jvp) as our Autograd and batched kernels attach
# them, and its graphs are never differentiated again (an inference graph
# never at all). So vmap(op) needs no one-node companion there (NOTE [One
# node for vmap(op) in a trace]): the op's batched kernel runs as in eager,
# its function once on the BatchedTensors (or its vmap rule), and the
# forward graph holds the function's batched aten ops, a constant number at
# any batch size, as the plain function's does; its backward is the
# registered one, reading the forward's residuals. A companion would cost
# its dispatch, a vmap level and the op's batched kernel in Python on every
# run of the graph, and a recompute of the forward in the backward, whose
# random draws a traced graph cannot replay (NOTE [A traced recompute cannot
# replay draws], vmap/_traced_draws.py). AOTAutograd's tracer is recognised by its
# functionalization mode (FunctionalTensorMode), while not exporting:
# torch.export and make_fx graphs may be differentiated later, and keep the
# companion. A vmap="loop" op keeps it too (its loop would put B calls in
# the graph), as does a function that reads a tensor constant (NOTE [A fake
# run of the function reads its tensor constants]).
def traced_by_aot_autograd() -> bool:
    """Is the active graph tracer AOTAutograd's (NOTE [AOTAutograd traces vmap(op) as eager runs it])?"""
    if torch.compiler.is_exporting():
        return False
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


def first_device_type(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[str]:
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return leaf.device.type
    return None


def decompose(op: CustomOpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The op's function, for Inductor to fuse (NOTE [Inductor sees the function]).

    ``NotImplemented`` (the tracer then records the op as one node) when
    the function cannot be traced (it leaves torch; or it is the stand-in
    of a ``torch.library.Library`` kernel we cannot see, which raises).
    """
    fns = op._backend_fns
    device = first_device_type(args, kwargs)
    fn = fns.get(device, fns.get(None))
    if fn is None:
        return NotImplemented
    try:
        return fn(*args, **kwargs)
    except Exception:
        return NotImplemented
