"""``torch_autobatch.trace``: record the ops a model runs in forward *and* backward.

Public API (exported from ``torch_autobatch``):

- :func:`trace` — a context manager that records, on the current thread only,
  every dispatcher op run inside it, and every op that the backward of the
  autograd nodes created inside it runs, wherever and whenever that runs;
- :func:`current_trace` — the trace that records the current thread's ops now;
- :class:`Trace` — the recording: ``print(t)`` lists it, ``t.to_fx()`` makes
  :class:`torch.fx.GraphModule` s that replay it (:class:`TraceGraphs`).

The recorder is C++ (``csrc/trace_*.cpp``): a thread-local ``RecordFunction``
observer sees each op with its inputs and outputs, and a C++ pre-hook on each
autograd node a traced op created makes that node's backward record into the
same trace (see the NOTEs there: [How the recorder sees ops], [Which trace
records an op] in trace_observer.cpp; [How a node records its backward],
[Finding the nodes an op created], [AccumulateGrad runs] in trace_hooks.cpp).
This module names and lists what it recorded (the record's Python types:
:mod:`._trace_record`; the replay: :mod:`._trace_fx`); nothing here runs per op.

Known limits:

- ops are recorded at the dispatcher, as autograd sees them: a
  CompositeImplicitAutograd op (``linear``, ``matmul``) as the ops it calls,
  any other op (a custom operator included) as one op, never the ops its
  kernel runs;
- an ``AccumulateGrad`` is listed as ``%w.grad += %k``; the op that stores
  ``.grad`` is not recorded, so a backward that reads ``.grad`` (reentrant
  checkpointing) sees it as an input;
- a Python scalar that flows between ops (``.item()``) is recorded as the
  constant it was;
- code that bypasses the dispatcher is not seen: kernels that Inductor
  (``torch.compile``'s default backend) generates, and ops run with
  ``RecordFunction`` disabled;
- a checkpoint (``torch.utils.checkpoint``) that stops its recomputation
  inside an op leaves that op unrecorded: its saved output is an input;
- ops inside a ``torch.func`` transform (``vmap``, ``grad``, ...) are recorded
  as called there, on the transform's wrapper tensors, at their logical
  shapes: listed, but ``to_fx()`` refuses to replay them;
- the first trace to reach a parameter adds a hook to its ``AccumulateGrad``;
  like any hook registration in torch, that must not race with an untraced
  backward of the same parameter on another thread (NOTE [AccumulateGrad runs]);
- it relies on torch internals named in the notes (the ``RecordFunction``
  thread-local callbacks, the engine's current node and graph task), as of
  torch 2.13 to 2.15; from 2.14 an open block turns off torch.library custom
  ops' fast path, which skips RecordFunction (NOTE [Custom ops' PyObject fast path]).
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Optional, Union

import torch

from .. import _C
from ._fx import TraceGraphs, build_graphs
from ._record import _ACCUMULATE, _Entry, _Tensor, _Value, read_record

__all__ = ["Trace", "current_trace", "trace"]

_DTYPE_ABBR = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
    torch.complex64: "c64",
    torch.complex128: "c128",
}
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]*\Z")  # as in module parameter names
_RESERVED_NAME_RE = re.compile(r"(arg)?\d+\Z|.*\.grad\Z")  # %3, %arg3, %w.grad


def _type_str(v: _Value) -> str:
    return f"{_DTYPE_ABBR.get(v.dtype, str(v.dtype))}[{', '.join(map(str, v.shape))}]"


class Trace:
    """The ops one :func:`trace` block ran, and the ops its autograd nodes' backward ran.

    ``str(t)`` (``print(t)``) is a stable listing: the inputs, the forward ops,
    then each backward call (``backward 1``, ``backward 2``, ...) with its ops
    grouped by the autograd node that ran them, in the order they ran::

        >>> x, w = torch.ones(2, 3), torch.ones(3, 4, requires_grad=True)
        >>> with torch_autobatch.trace(names={"x": x, "w": w}) as t:
        ...     loss = (x @ w).sum()
        >>> loss.backward()
        >>> print(t)
        inputs:
          %x: f32[2, 3]
          %w: f32[3, 4] requires_grad
          %arg0: f32[]
        forward:
          %0 = aten.mm.default(%x, %w)  # f32[2, 4], node 0
          %1 = aten.sum.default(%0)  # f32[], node 1
        backward 1:
          SumBackward0 (node 1):
            %2 = aten.expand.default(%arg0, [2, 4])  # f32[2, 4]
          MmBackward0 (node 0):
            %3 = aten.t.default(%x)  # f32[3, 2]
            %4 = aten.mm.default(%3, %2)  # f32[3, 4]
          AccumulateGrad (%w):
            %w.grad += %4

    Values are ``%0, %1, ...`` in recording order (an in-place op gives its
    tensor a new number). Inputs are the tensors no recorded op made, named
    by :func:`trace`'s ``names`` or ``%arg0, %arg1, ...`` in order of first
    use (``%arg0`` above is the gradient ``backward()`` starts from). A
    tensor autograd saved and gives back to a backward is the value it saved.
    ``node k`` after an op is the autograd node (its grad_fn) that
    differentiates it, and heads that node's backward below. Arguments equal
    to their schema defaults are left out.

    NOTE [What a Trace holds]
    The record (C++, shared by every ``Trace`` object that shows it) holds no
    tensor that a recorded op made: only weak references, shapes and dtypes.
    It holds the inputs without a ``grad_fn`` (parameters, data, the gradient
    ``backward()`` starts from), so that :meth:`TraceGraphs.run` can replay
    with no arguments; inputs with a ``grad_fn`` are held weakly. The autograd
    nodes created while tracing hold the record (through their hook), and
    nothing in it holds a node: freeing the outputs and the Trace frees
    everything, with no cycle. A node's backward that runs after the Trace
    object was freed still records (:func:`current_trace` gives a new Trace
    object for that record).
    """

    def __init__(self, names: Optional[Mapping[str, _Tensor]] = None) -> None:
        self._impl = _C._TraceImpl()
        for name, t in (names or {}).items():
            self._impl.add_input(t, name)
        self._snapshot_version = -1
        _traces[self._impl.id] = self

    @classmethod
    def _of(cls, impl: Any) -> Trace:
        t = _traces.get(impl.id)
        if t is None:
            t = cls.__new__(cls)
            t._impl = impl
            t._snapshot_version = -1
            _traces[impl.id] = t
        return t

    # ------------------------------------------------------------ snapshot
    def _snapshot(self) -> None:
        """Builds ``_values``, ``_inputs``, ``_groups``, ``_entries`` from the record (cached)."""
        impl = self._impl
        version = impl.version
        if version == self._snapshot_version:
            return
        self._values, self._inputs, self._groups, self._entries = read_record(impl)
        self._snapshot_version = version

    # ----------------------------------------------------------------- public
    def name_of(self, tensor: _Tensor) -> str:
        """The name (``"%3"``, ``"%arg0"``, ``"%x"``) under which the trace knows ``tensor`` now.

        Raises ``KeyError`` if no recorded op made or used it::

            >>> x = torch.ones(3)
            >>> with torch_autobatch.trace(names={"x": x}) as t:
            ...     y = x.exp()
            ...     _ = y.add_(1)  # in place: y is now a new value
            >>> t.name_of(x), t.name_of(y)
            ('%x', '%1')
        """
        if not isinstance(tensor, _Tensor):
            raise TypeError(f"Trace.name_of: expected a torch.Tensor, got {type(tensor).__name__}.")
        v = self._impl.value_of(tensor)
        if v < 0:
            raise KeyError(
                f"Trace.name_of: this tensor (shape {tuple(tensor.shape)}, dtype "
                f"{tensor.dtype}) was neither made nor used by an op this trace recorded."
            )
        self._snapshot()
        return str(self._values[v])

    @property
    def inputs(self) -> dict[str, Optional[_Tensor]]:
        """Input name -> tensor (None if held weakly and since freed), in order of first use.

        Example::

            >>> x, y = torch.ones(2), torch.zeros(2)
            >>> with torch_autobatch.trace(names={"x": x}) as t:
            ...     z = y * x  # y is not named: %arg0
            >>> list(t.inputs), t.inputs["%x"] is x, t.inputs["%arg0"] is y
            (['%x', '%arg0'], True, True)
        """
        self._snapshot()
        return {str(v): v() for v in self._inputs}

    def __len__(self) -> int:
        """The number of recorded entries (ops, and ``AccumulateGrad`` lines)."""
        return len(self._impl)

    def __repr__(self) -> str:
        self._snapshot()
        fwd = sum(1 for e in self._entries if e.group.pass_no == 0)
        passes = len({g.pass_no for g in self._groups} - {0})
        return (
            f"<torch_autobatch.Trace: {len(self._inputs)} inputs, {fwd} forward ops, "
            f"{passes} backward calls, {len(self._entries) - fwd} backward entries>"
        )

    def __str__(self) -> str:
        self._snapshot()
        lines = ["inputs:"]
        for v in self._inputs:
            rg = " requires_grad" if v.requires_grad else ""
            lines.append(f"  {v}: {_type_str(v)}{rg}")
        lines.append("forward:")
        current_pass, current_group = 0, self._groups[0]
        for entry in self._entries:
            group = entry.group
            if group is not current_group:
                if group.pass_no != current_pass:
                    current_pass = group.pass_no
                    lines.append(f"backward {current_pass}:" if current_pass else "forward:")
                if group.pass_no:
                    lines.append(f"  {group.label}:")
                current_group = group
            lines.append(("    " if group.pass_no else "  ") + _format_entry(entry))
        return "\n".join(lines)

    def to_fx(self) -> TraceGraphs:
        """:class:`torch.fx.GraphModule` s that replay the recording: see :class:`TraceGraphs`.

        Refuses (``RuntimeError``) a trace that recorded ops inside a
        ``torch.func`` transform. Example::

            >>> x = torch.tensor([1.0, 2.0])
            >>> with torch_autobatch.trace(names={"x": x}) as t:
            ...     y = torch.sin(x) * 2
            >>> graphs = t.to_fx()
            >>> graphs
            <torch_autobatch.TraceGraphs: 1 modules>
            >>> torch.equal(graphs.forward(x)[t.name_of(y)], y)
            True
        """
        if self._impl.saw_transform:
            raise RuntimeError(
                "Trace.to_fx: this trace recorded ops that ran inside a torch.func transform "
                "(vmap, grad, jvp, ...), on the transform's wrapper tensors: the listing shows "
                "them at their logical shapes, but a replay outside the transform would compute "
                "something else. Trace the transformed function's caller instead, or record "
                "without transforms to replay."
            )
        self._snapshot()
        return build_graphs(self._entries, self._inputs)


# record id -> the Trace object showing it, while someone holds that object
_traces: weakref.WeakValueDictionary[int, Trace] = weakref.WeakValueDictionary()


def _format_arg(a: Any) -> str:
    if type(a) is list or type(a) is tuple:
        return f"[{', '.join(_format_arg(x) for x in a)}]"
    return str(a) if isinstance(a, _Value) else repr(a)


def _format_entry(entry: _Entry) -> str:
    func, kwargs, outs, args = entry.func, entry.kwargs, entry.outs, entry.args
    if func is _ACCUMULATE:
        return f"{args[0]}.grad += {args[1]}"
    parts = [_format_arg(a) for a in args] + [f"{k}={_format_arg(a)}" for k, a in kwargs.items()]
    call = f"{func}({', '.join(parts)})"
    if type(outs) is _Value:
        node = "" if outs.node is None else f", node {outs.node}"
        return f"{outs} = {call}  # {_type_str(outs)}{node}"
    if type(outs) is tuple:
        values = [o for o in outs if type(o) is _Value]
        lhs = ", ".join(str(o) if type(o) is _Value else "_" for o in outs)
        nodes = sorted({o.node for o in values if o.node is not None})
        node = f", node {nodes[0]}" if nodes else ""
        return f"{lhs or '_'} = {call}  # ({', '.join(_type_str(o) for o in values)}){node}"
    return call if outs is None else f"_ = {call}  # {outs!r}"


# --------------------------------------------------------------------- trace()
# NOTE [Custom ops' PyObject fast path]
# Since torch 2.14, torch.library.custom_op turns on a fast path for its ops
# (OpOverload._enable_pyobj_dispatch) that calls their kernels without a
# RecordFunction, so the recorder would list the op's kernel's aten ops in its
# place. While any trace block is open, that fast path is off for every
# torch.library custom op that has it (a speed switch only: the same kernels
# run); the last block to close turns it back on. Feature-detected, so it is a
# no-op where torch has no such path (and costs nothing there: a block would
# otherwise walk every op torch.library knows). An op defined inside a block
# keeps it.
_HAS_PYOBJ_DISPATCH = hasattr(torch._ops.OpOverload, "_enable_pyobj_dispatch")
_fast_path_lock = threading.Lock()
_open_blocks = 0
_fast_path_ops: list[torch._ops.OpOverload] = []


def _suspend_custom_op_fast_paths() -> None:
    global _open_blocks
    if not _HAS_PYOBJ_DISPATCH:
        return
    with _fast_path_lock:
        _open_blocks += 1
        if _open_blocks > 1:
            return
        from torch._library.custom_ops import OPDEFS

        for opdef in list(OPDEFS.values()):
            op = getattr(opdef, "_opoverload", None)
            if op is not None and getattr(op, "_is_pyobj_dispatcher_enabled", lambda: False)():
                op._enable_pyobj_dispatch(False)  # torch >= 2.14
                _fast_path_ops.append(op)


def _resume_custom_op_fast_paths() -> None:
    global _open_blocks
    if not _HAS_PYOBJ_DISPATCH:
        return
    with _fast_path_lock:
        _open_blocks -= 1
        if _open_blocks > 0:
            return
        for op in _fast_path_ops:
            op._enable_pyobj_dispatch(True)  # type: ignore[attr-defined]  # torch >= 2.14
        _fast_path_ops.clear()


class _TraceBlock:
    """The context manager :func:`trace` returns; ``__enter__`` gives the :class:`Trace`."""

    def __init__(self, names: Optional[Mapping[str, _Tensor]]) -> None:
        self._names = names
        self._trace: Optional[Trace] = None
        self._active = False

    def __enter__(self) -> Trace:
        if self._trace is not None:
            raise RuntimeError(
                "torch_autobatch.trace(): this block was already entered; call trace() again for a new one."
            )
        t = self._trace = Trace(self._names)
        _suspend_custom_op_fast_paths()
        try:
            _C._trace_push(t._impl)
        except BaseException:
            _resume_custom_op_fast_paths()
            raise
        self._active = True
        return t

    def __exit__(self, *exc: Any) -> None:
        if self._active and self._trace is not None:
            self._active = False
            try:
                _C._trace_pop(self._trace._impl)
            finally:
                _resume_custom_op_fast_paths()


def _check_names(names: Any) -> Optional[dict[str, _Tensor]]:
    where = "torch_autobatch.trace(names=...)"
    if names is None:
        return None
    if isinstance(names, torch.nn.Module):
        names = {**dict(names.named_parameters()), **dict(names.named_buffers())}
    elif not isinstance(names, Mapping):
        raise TypeError(f"{where}: expected a mapping from name to tensor or an nn.Module, got {type(names).__name__}.")
    for name, t in names.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"{where}: got the name {name!r}; expected letters, digits, '_' "
                "and '.' (e.g. 'x', 'fc1.weight', '0.bias')."
            )
        if _RESERVED_NAME_RE.match(name):
            raise ValueError(
                f"{where}: the name {name!r} is reserved (N names outputs, argN "
                "unnamed inputs, .grad gradients); choose another."
            )
        if not isinstance(t, _Tensor):
            raise TypeError(f"{where}: expected a tensor for {name!r}, got {type(t).__name__}.")
    return dict(names)


def trace(names: Union[Mapping[str, _Tensor], torch.nn.Module, None] = None) -> _TraceBlock:
    """Records the ops run on this thread inside the block, and their backward.

    Example::

        >>> x, w = torch.ones(2, 3), torch.ones(3, requires_grad=True)
        >>> with torch_autobatch.trace(names={"x": x, "w": w}) as t:
        ...     loss = (x * w).sum()
        >>> loss.backward()          # after the block: still recorded into t
        >>> print(t)                 # forward ops, then backward ops grouped by node
        inputs:
          %x: f32[2, 3]
          %w: f32[3] requires_grad
          %arg0: f32[]
        forward:
          %0 = aten.mul.Tensor(%x, %w)  # f32[2, 3], node 0
        ...
        >>> out = t.to_fx().run()    # replays forward and backward
        >>> torch.equal(out[t.name_of(loss)], loss), torch.equal(out["%w.grad"], w.grad)
        (True, True)

    With a module, ``trace(names=model)`` names its parameters and buffers
    (``%weight``, ``%0.bias``, ...).

    Which trace records an op (the C++ side: NOTE [Which trace records an op]):

    - Inside the block, every dispatcher op run on *this* thread is recorded
      (other threads are never recorded), at the aten level; a
      ``torch_autobatch.custom_op`` (or any dispatcher op that is not
      CompositeImplicitAutograd) is one op, never its decomposition.
    - Every autograd node created by a recorded op remembers that op's trace,
      and every op its backward runs is recorded into that trace: after the
      block, on another thread, once per backward call (``retain_graph=True``);
      with ``create_graph=True`` the nodes that backward creates belong to the
      same trace, so double backward is recorded too. The gradient a leaf
      receives is listed as ``%w.grad += %k``.
    - Nested blocks: each op is recorded by exactly one trace: inside a traced
      node's backward, that node's trace; otherwise the innermost block active
      on the thread. The outer block records again from the moment the inner
      one exits. What ran while the inner block was active (and the backward
      of the inner block's nodes) is never added to the outer trace, which
      sees the inner block's results as inputs (``%argN``).
    - A node created outside any block whose backward runs on this thread
      while a block is active is recorded into that block, under
      ``<Name> (untraced node)``.

    When no block is active and no traced node runs, nothing is installed: no
    observer, no mode, no hook. On exit, also by an exception, the block
    restores the thread's tracing state (and removes its observer if no
    other block needs it).

    Args:
        names: optional names for input tensors (``{"x": x}``), or a module,
            whose parameters and buffers are named by their qualified names.
            Unnamed inputs are ``%arg0, %arg1, ...``.

    Returns:
        a context manager; ``with trace() as t`` binds ``t`` to the :class:`Trace`.
    """
    return _TraceBlock(_check_names(names))


def current_trace() -> Optional[Trace]:
    """The trace that would record an op run on this thread now, or None.

    That is the innermost active :func:`trace` block, or, inside the backward
    of a node created while tracing, that node's trace::

        >>> print(torch_autobatch.current_trace())
        None
        >>> with torch_autobatch.trace() as t:
        ...     print(torch_autobatch.current_trace() is t)
        True
    """
    impl = _C._current_trace()
    return None if impl is None else Trace._of(impl)
