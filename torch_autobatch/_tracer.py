"""``torch_autobatch.trace``: record the aten ops a model runs in forward *and* backward.

Public API (exported from ``torch_autobatch``):

- :func:`trace` — a context manager that records, on the current thread only,
  every dispatcher op run inside it, and every op that the backward of the
  autograd nodes created inside it runs, wherever and whenever that runs;
- :func:`current_trace` — the trace that records the current thread's ops now;
- :class:`Trace` — the recording: ``print(t)`` lists it, ``t.to_fx()`` makes
  :class:`torch.fx.GraphModule` s that replay it (:class:`TraceGraphs`).

The mechanisms, and the notes that explain them:

- forward: :func:`trace` pushes a :class:`_Recorder` (a ``TorchDispatchMode``)
  on *this thread's* dispatch-mode stack. Below autograd, it sees every aten
  op, and a dispatcher custom op (e.g. from :func:`torch_autobatch.custom_op`)
  as one op: while a recorder runs an op the mode is off the stack, so the
  op's own implementation is never recorded;
- nodes: the grad_fn of each recorded op's outputs gets a hook
  (NOTE [Finding the nodes an op created], NOTE [How a node is hooked]);
- backward: that hook pushes a :class:`_Recorder` for the node on whatever
  thread runs it (NOTE [Why a node pre-hook and no post-hook]);
- state: NOTE [Thread-local tracing state]; cost: NOTE [Cost of recording];
  lifetime: NOTE [What a Trace holds].

Known limits:

- cost: every op pays a trip into Python (a pass-through ``TorchDispatchMode``
  alone doubles a small MLP's step), plus the recording, plus one hook per
  autograd node; see ``benchmarks/bench_tracer.py``;
- an ``AccumulateGrad`` is listed as ``%w.grad += %k``; the op that stores
  ``.grad`` is not recorded, so a backward that reads ``.grad`` (reentrant
  checkpointing) sees it as an input;
- a Python scalar that flows between ops (``.item()``) is recorded as the
  constant it was;
- nodes made at a ``torch.func`` transform's level are not hooked: their
  backward is recorded only while a block is active on the thread that runs
  it, as an untraced node;
- the trace sees what reaches the dispatcher's Python key: higher-order ops
  (``torch.cond``) are refused by ``TorchDispatchMode`` and ``torch.compile``
  runs eagerly while a block is active (Dynamo skips frames when a mode is on
  the stack);
- it relies on torch internals named in the notes (``torch._C`` mode-stack,
  graph-task and hook functions), as of torch 2.13.
"""

from __future__ import annotations

import itertools
import re
import threading
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Union

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Trace", "current_trace", "trace"]

_Tensor = torch.Tensor
_AccumulateGrad = torch._C._functions.AccumulateGrad
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_grad_enabled = torch.is_grad_enabled
_push_mode = torch._C._push_on_torch_dispatch_stack
_pop_mode = torch._C._pop_torch_dispatch_stack
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_EMPTY: dict[str, Any] = {}  # shared "no kwargs"; never mutated

if TYPE_CHECKING:
    from ._trace_fx import TraceGraphs

_ACC_KEY = "torch_autobatch_trace"  # AccumulateGrad node.metadata key: our hook is on it

# NOTE [Thread-local tracing state]
# Everything that says "this thread is tracing" lives in two thread-local
# places, and both are restored on every exit path:
#   - the dispatch-mode stack (C++, per thread): a _Recorder on it is what
#     records. trace() pops its own in `finally`; a node's hook pushes one that
#     the autograd engine itself removes when the node is done, even when the
#     node raises (NOTE [Why a node pre-hook and no post-hook]);
#   - `_tls` below: the `busy` flag (set only while
#     a _Recorder that has another one under it runs an op, reset in
#     `finally`), and work left for the next op. It holds tensors and traces
#     only weakly, so a stale entry (after an exception) keeps nothing alive.
# torch.utils._python_dispatch.is_in_torch_dispatch_mode() is process-global
# and its save/restore races between threads, so the modes are pushed with
# torch._C._push_on_torch_dispatch_stack directly, never with `with mode:`.


class _State(threading.local):
    def __init__(self) -> None:
        self.busy = False  # a _Recorder runs an op: the _Recorders under it pass it through
        # The outputs of the last op recorded with grad mode on, the weakref of its
        # trace, and of the base of the view it modified in place, if it did: their
        # grad_fn are hooked at the next op.
        self.pending: Any = None
        self.pending_trace: Callable[[], Optional[Trace]] = _dead
        self.pending_base: Optional[Callable[[], Optional[_Tensor]]] = None
        # graph task id -> weakref to the trace of the last traced node run in it here
        self.task_traces: dict[int, Callable[[], Optional[Trace]]] = {}
        self.flush_task = -1  # graph task for which a flush callback is queued
        self.dummy: Optional[_Tensor] = None  # see NOTE [How a node is hooked]


def _dead() -> None:
    return None


_tls = _State()


class _Value(weakref.ref):
    """One recorded tensor value: a weak reference to the tensor, and what to print.

    Values are SSA: an in-place op's output is a new value of the same tensor.
    ``num >= 0``: the output numbered ``num`` (``%num``); ``num < 0``: an input
    (:class:`_Input`). ``node``: the index of the hooked autograd node that is
    the tensor's grad_fn, or None; ``seq``: the sequence number of the grad_fn
    it was last seen with, or None (see `_hook_input_node`). Compared and
    hashed by identity, never by referent.
    """

    __slots__ = ("num", "shape", "dtype", "node", "seq")
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other

    def __ne__(self, other: object) -> bool:
        return self is not other

    def __str__(self) -> str:
        return f"%{self.num}"

    __repr__ = __str__


class _Input(_Value):
    """A tensor that no recorded op made. ``held`` keeps it (see NOTE [What a Trace holds])."""

    __slots__ = ("name", "held", "requires_grad")

    def __str__(self) -> str:
        return self.name


class _Group:
    """The header recorded ops are listed under: the forward, or one run of one node.

    Holds no reference to a trace or a node (a trace holds its groups).
    """

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

# An entry of Trace._entries is one list: [group, func, kwargs, outputs, *args].
_GROUP, _FUNC, _KWARGS, _OUTS, _ARGS = 0, 1, 2, 3, 4


# ------------------------------------------------------------------ recording
class _Recorder(TorchDispatchMode):
    """Records every op that reaches it into ``trace``, under ``group``.

    Pushed by a :func:`trace` block (``group`` None: its ops are the forward,
    or, inside a backward no traced node started, that node's), or by a traced
    node's hook (``group``: that node in that backward call). ``shadows``:
    another _Recorder is under this one on the stack; that one must not record
    what this one records (it sees the ops this one runs).
    """

    def __init__(self, trace: Trace, group: Optional[_Group] = None) -> None:
        # NB: no super().__init__(): its state serves only `with mode:`, which we never use.
        self.trace = trace
        self.group = group
        self.shadows = _stack_len() > 0 and _recorder_on_stack() is not None

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # The default wraps __torch_dispatch__ in torch._dynamo.disable, which costs
        # about as much as the recording itself.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        # NOTE [Cost of recording]
        # This runs for every op, so it does the least it can: name each tensor
        # argument by one dict lookup (id -> _Value, checked by calling the
        # weak reference), make one _Value per output, append one list. Text
        # waits until the trace is printed; finding autograd nodes waits until
        # the next op (NOTE [Finding the nodes an op created]). Every object
        # kept per op is one more for the cyclic GC to scan, so there are three:
        # the _Value (which is the weak reference), its torch.Size, the entry.
        tls = _tls
        if tls.busy:  # a _Recorder above this one records this op
            return func(*args, **kwargs) if kwargs else func(*args)
        if tls.pending is not None:
            _flush(tls)
        if self.shadows:
            tls.busy = True
            try:
                out = func(*args, **kwargs) if kwargs else func(*args)
            finally:
                tls.busy = False
        else:
            out = func(*args, **kwargs) if kwargs else func(*args)

        trace = self.trace
        ids = trace._ids
        grad = _grad_enabled()
        group = self.group
        if group is None:
            group = trace._forward if _graph_task_id() == -1 else trace._untraced_group()
        entry = [group, func, trace._map_kwargs(kwargs) if kwargs else _EMPTY, None]
        for a in args:
            if isinstance(a, _Tensor):
                v = ids.get(id(a))
                if v is None or v() is not a:
                    v = trace._new_input(a)
                if grad and (v.node is None or a._is_view()):
                    fn = a.grad_fn
                    if fn is not None and fn._sequence_nr() != v.seq:
                        _hook_input_node(trace, v, fn)
                entry.append(v)
            elif (type(a) is list or type(a) is tuple) and a and type(a[0]) is not int:
                entry.append(trace._map(a))
            else:
                entry.append(a)
        if isinstance(out, _Tensor):
            v = _Value(out)
            v.num = trace._next_num()
            v.shape = out.shape
            v.dtype = out.dtype
            v.node = v.seq = None
            ids[id(out)] = v
            entry[_OUTS] = v
        elif type(out) is tuple or type(out) is list:
            entry[_OUTS] = v = tuple(trace._output(o) if isinstance(o, _Tensor) else o
                                     for o in out)
        else:
            entry[_OUTS] = v = out
        trace._entries.append(entry)
        if grad or self.group is None:  # (grad off: the output of a Function.forward, maybe)
            tls.pending = v
            tls.pending_trace = trace._weakself
            # An in-place op on a view: its base gets a CopySlices (the view may be freed).
            tls.pending_base = (weakref.ref(out._base)
                                if args and out is args[0] and out._is_view() else None)
        return out


def _recorder_on_stack() -> Optional[_Recorder]:
    """The topmost _Recorder on this thread's dispatch-mode stack, if any."""
    for i in range(_stack_len() - 1, -1, -1):
        mode = _stack_at(i)
        if type(mode) is _Recorder:
            return mode
    return None


def _flush(tls: _State) -> None:
    """Tags the grad_fn of the last recorded op's outputs, now that autograd has set them.

    NOTE [Finding the nodes an op created]
    The mode sits below autograd: an op's outputs get their grad_fn only after
    the mode returns. So each op recorded with grad mode on leaves its outputs
    in `_tls.pending`, and the next op (or the end of the block, or the next
    node's hook, or the end of a create_graph backward) tags them. Every node
    is the grad_fn of some op's output at that moment: C++ composites (linear,
    matmul) reach the mode op by op, and a view op's output is the very tensor
    autograd returns. A new output's grad_fn is a new node, so no mark is
    needed to hook each node once (a mark in ``node.metadata`` would cost a
    dict per node). Two kinds of nodes are nobody's output's grad_fn then:
      - the CopySlices made by an in-place op on a view is the grad_fn of the
        view's *base*: it is hooked from there. (Hooks on the node CopySlices
        wraps never fire; CopySlices' do.)
      - a view whose base was since modified in place gets a new grad_fn when
        it is next used, and torch.autograd.Function.apply attaches its node
        after its forward ran (with grad mode off, so the forward's last op
        leaves its outputs here too): an op's inputs are checked by the
        sequence number of their grad_fn (`_hook_input_node`).
    """
    outs = tls.pending
    tls.pending = None
    trace = tls.pending_trace()
    if trace is None:
        return
    if tls.pending_base is not None:
        base = tls.pending_base()
        tls.pending_base = None
        fn = None if base is None else base.grad_fn
        if fn is not None:
            trace._tag(fn)
    if type(outs) is _Value:
        t = outs()
        if t is None:
            return
        fn = t.grad_fn
        if fn is not None:
            outs.node = trace._tag(fn)
            outs.seq = fn._sequence_nr()
    elif type(outs) is tuple:
        seen: list[tuple[Any, int]] = []  # the node wrappers stay alive, so `is` is exact
        for v in outs:
            if type(v) is _Value:
                t = v()
                fn = None if t is None else t.grad_fn
                if fn is not None:
                    index = next((i for f, i in seen if f is fn), None)
                    if index is None:
                        index = trace._tag(fn)
                        seen.append((fn, index))
                    v.node = index
                    v.seq = fn._sequence_nr()


def _hook_input_node(trace: Trace, v: _Value, fn: Any) -> None:
    """Hooks ``fn``, an op input's grad_fn that is not the one ``v`` was last seen with.

    A node created since then: the one ``torch.autograd.Function.apply``
    attaches after its (recorded, grad-mode-off) forward, or the new grad_fn
    of a view whose base was modified in place.
    """
    v.node = trace._tag(fn)
    v.seq = fn._sequence_nr()


def _flush_callback() -> None:
    tls = _tls
    tls.flush_task = -1
    if tls.pending is not None:
        _flush(tls)


def _node_hook(trace: Trace, index: int, name: str, grad: Any) -> None:
    """Runs before a traced node's backward, on the thread that runs it.

    NOTE [Why a node pre-hook and no post-hook]
    The engine runs a node's pre-hooks, its backward and the accumulation of
    its results into the next nodes' input buffers under one guard that saves
    and restores the thread-local state, dispatch-mode stack included. A mode
    pushed here therefore records exactly that node's work (the gradient
    additions the engine does for it included), and is gone when the node is
    done, whether it returned or raised: no post-hook, nothing to undo. That
    guard is also why one hook per node is needed: nothing pushed in one node
    survives into the next.
    """
    tls = _tls
    if tls.pending is not None:
        _flush(tls)
    task = _graph_task_id()
    task_traces = tls.task_traces
    ref = trace._weakself
    if task_traces.get(task) is not ref:
        task_traces[task] = ref
        if len(task_traces) > 64:  # ids only grow: keep the recent tasks (and any running one)
            for old in sorted(task_traces)[:-16]:
                del task_traces[old]
    if tls.flush_task != task and _grad_enabled():
        # create_graph=True: the last op's outputs get nodes, to tag after the last node.
        tls.flush_task = task
        torch.autograd.Variable._execution_engine.queue_callback(_flush_callback)
    pass_no = trace._passes.get(task) or trace._pass_of(task)
    _push_mode(_Recorder(trace, _Group(pass_no, name, index)))


_HAS_HOOK_DICT = (hasattr(_AccumulateGrad, "_register_hook_dict")  # C++ nodes
                  and hasattr(torch._C._FunctionBase, "_register_hook_dict"))  # Function's


def _hook_node(fn: Any, hook: Callable[[Any], None]) -> None:
    """Registers ``hook(grad)`` to run before node ``fn``'s backward.

    NOTE [How a node is hooked]
    ``fn.register_prehook`` builds an OrderedDict and a RemovableHandle in
    Python for every node (~3 us, the largest per-node cost). A node's
    *tensor* pre-hook dict, registered with ``fn._register_hook_dict(t)`` (what
    ``Tensor.register_hook`` uses), runs at the same point under the same
    guard; it takes the dict from ``t._backward_hooks``, so a per-thread empty
    tensor lends it and is cleared at once (~0.6 us). It runs for any node but
    AccumulateGrad, whose tensor pre-hooks are its leaf's; those get
    ``register_prehook``.
    """
    if not _HAS_HOOK_DICT:
        fn.register_prehook(lambda grads: hook(grads[0] if grads else None))
        return
    tls = _tls
    dummy = tls.dummy
    if dummy is None:
        with torch._C._DisableTorchDispatch():  # not an op to record
            dummy = tls.dummy = torch.empty(0)
    dummy._backward_hooks = {0: hook}
    try:
        fn._register_hook_dict(dummy)
    finally:
        dummy._backward_hooks = None


def _accumulate_grad_hook(grad_outputs: Any) -> None:
    """Runs before an ``AccumulateGrad`` node that a traced node feeds: records ``leaf.grad += g``.

    AccumulateGrad nodes belong to the leaf, not to one graph: two traces (two
    threads) may run the same one. So it carries one shared hook, and the run
    is attributed to the trace of the last traced node that ran in the same
    backward call on this thread (``torch._C._current_graph_task_id()``); the
    engine runs an AccumulateGrad right after the node that feeds it (it has
    the highest priority), so that is the node that fed it. The ops that store
    ``.grad`` (a detach, a copy or an in-place add) are not recorded: the
    ``+=`` line says what they do.
    """
    tls = _tls
    if tls.pending is not None:
        _flush(tls)
    task = _graph_task_id()
    trace_ref = tls.task_traces.get(task)
    trace = None if trace_ref is None else trace_ref()
    grad = grad_outputs[0]
    if trace is None or grad is None:
        return
    leaf = trace._value(_current_node().variable)
    group = _Group(trace._passes.get(task) or trace._pass_of(task), "AccumulateGrad", leaf)
    trace._entries.append([group, _ACCUMULATE, _EMPTY, None, leaf, trace._value(grad)])
    if _stack_len() > 0 and _recorder_on_stack() is not None:
        _push_mode(_SILENCER)  # a trace() block active here must not record this node


class _Silencer(TorchDispatchMode):
    """Runs ops so that the _Recorders under it do not record them."""

    def __init__(self) -> None:  # no state: one instance serves every thread
        pass

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        tls = _tls
        busy, tls.busy = tls.busy, True
        try:
            return func(*args, **kwargs) if kwargs else func(*args)
        finally:
            tls.busy = busy


_SILENCER = _Silencer()


def _hook_accumulate_grad(node: Any, md: dict[str, Any]) -> None:
    """Puts the shared hook on AccumulateGrad ``node`` (metadata ``md``) once, whoever asks first."""
    mark = object()
    if md.setdefault(_ACC_KEY, mark) is mark:  # one C call: atomic under the GIL
        node.register_prehook(_accumulate_grad_hook)


# ---------------------------------------------------------------------- Trace
_DTYPE_ABBR = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
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
    use (``%arg0`` above is the gradient ``backward()`` starts from).
    ``node k`` after an op is the autograd node (its grad_fn) that
    differentiates it, and heads that node's backward below.

    NOTE [What a Trace holds]
    A Trace holds no tensor that a recorded op made: only weak references,
    shapes and dtypes. It holds the inputs without a ``grad_fn`` (parameters,
    data, the gradient ``backward()`` starts from), so that
    :meth:`TraceGraphs.run` can replay with no arguments; inputs with a
    ``grad_fn`` are held weakly. The autograd nodes created while tracing hold
    the Trace (through their hook), and nothing in a Trace holds a node:
    freeing the outputs and the Trace frees everything, with no cycle.
    """

    def __init__(self, names: Optional[Mapping[str, _Tensor]] = None) -> None:
        self._weakself = weakref.ref(self)
        self._ids: dict[int, _Value] = {}  # id(tensor) -> its latest value (checked by calling)
        self._inputs: list[_Input] = []
        self._unnamed = 0  # inputs named %arg0, %arg1, ...
        self._entries: list[list[Any]] = []  # see _GROUP, _FUNC, _KWARGS, _OUTS, _ARGS
        self._next_num = itertools.count().__next__
        self._next_node = itertools.count().__next__
        self._forward = _Group(0, "forward")
        self._passes: dict[int, int] = {}  # graph task id -> backward call number
        self._untraced: dict[tuple[Any, ...], _Group] = {}
        self._lock = threading.Lock()
        for name, t in (names or {}).items():
            self._new_input(t, name)

    # ------------------------------------------------------------- recording
    def _new_input(self, t: _Tensor, name: Optional[str] = None) -> _Input:
        with self._lock:
            v = self._ids.get(id(t))
            if type(v) is _Input and v() is t:
                return v
            v = _Input(t)
            v.num = -1 - len(self._inputs)
            v.shape = t.shape
            v.dtype = t.dtype
            if name is None:
                name = f"arg{self._unnamed}"
                self._unnamed += 1
            v.name = f"%{name}"
            v.requires_grad = t.requires_grad
            fn = t.grad_fn
            v.held = t if fn is None else None
            v.node = None
            v.seq = None if fn is None else fn._sequence_nr()
            self._inputs.append(v)
            self._ids[id(t)] = v
            return v

    def _value(self, t: _Tensor) -> _Value:
        v = self._ids.get(id(t))
        if v is None or v() is not t:
            v = self._new_input(t)
        return v

    def _map(self, a: Any) -> Any:
        if isinstance(a, _Tensor):
            return self._value(a)
        if type(a) is list or type(a) is tuple:
            return type(a)(self._map(x) for x in a)
        return a

    def _map_kwargs(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {k: self._map(a) for k, a in kwargs.items()}

    def _output(self, t: _Tensor) -> _Value:
        v = _Value(t)
        v.num = self._next_num()
        v.shape = t.shape
        v.dtype = t.dtype
        v.node = v.seq = None
        self._ids[id(t)] = v
        return v

    def _tag(self, fn: Any) -> int:
        """Makes autograd node ``fn`` record its backward into this trace; returns its index."""
        index = self._next_node()
        _hook_node(fn, partial(_node_hook, self, index, fn.name()))
        for nxt, _ in fn.next_functions:
            if type(nxt) is _AccumulateGrad:
                md = nxt.metadata
                if _ACC_KEY not in md:
                    _hook_accumulate_grad(nxt, md)
        return index

    def _pass_of(self, task: int) -> int:
        pass_no = self._passes.get(task)
        if pass_no is None:
            with self._lock:
                pass_no = self._passes.setdefault(task, len(self._passes) + 1)
        return pass_no

    def _untraced_group(self) -> _Group:
        """The group of an op a trace() block's mode sees inside a backward.

        That is the backward of a node no trace hooked (one created before the
        block) that runs on this thread while the block is active.
        """
        task = _graph_task_id()
        node = _current_node()
        key = (task, None) if node is None else (task, node.name(), node._sequence_nr())
        group = self._untraced.get(key)
        if group is None:
            label = "(engine)" if node is None else f"{node.name()} (untraced node)"
            group = self._untraced[key] = _Group(self._pass_of(task), label)
        return group

    # ----------------------------------------------------------------- public
    def name_of(self, tensor: _Tensor) -> str:
        """The name (``"%3"``, ``"%arg0"``, ``"%x"``) under which the trace knows ``tensor`` now.

        Raises ``KeyError`` if no recorded op made or used it.
        """
        if not isinstance(tensor, _Tensor):
            raise TypeError(
                f"Trace.name_of: expected a torch.Tensor, got {type(tensor).__name__}."
            )
        v = self._ids.get(id(tensor))
        if v is None or v() is not tensor:
            raise KeyError(
                f"Trace.name_of: this tensor (shape {tuple(tensor.shape)}, dtype "
                f"{tensor.dtype}) was neither made nor used by an op this trace recorded."
            )
        return str(v)

    @property
    def inputs(self) -> dict[str, Optional[_Tensor]]:
        """Input name -> tensor (None if held weakly and since freed), in order of first use."""
        return {str(v): v() for v in self._inputs}

    def __len__(self) -> int:
        """The number of recorded entries (ops, and ``AccumulateGrad`` lines)."""
        return len(self._entries)

    def __repr__(self) -> str:
        fwd = sum(1 for e in self._entries if e[_GROUP].pass_no == 0)
        return (
            f"<torch_autobatch.Trace: {len(self._inputs)} inputs, {fwd} forward ops, "
            f"{len(self._passes)} backward calls, {len(self._entries) - fwd} backward entries>"
        )

    def __str__(self) -> str:
        lines = ["inputs:"]
        for v in self._inputs:
            rg = " requires_grad" if v.requires_grad else ""
            lines.append(f"  {v}: {_type_str(v)}{rg}")
        lines.append("forward:")
        current_pass, current_group = 0, self._forward
        for entry in list(self._entries):
            group = entry[_GROUP]
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
        """:class:`torch.fx.GraphModule` s that replay the recording: see :class:`TraceGraphs`."""
        from ._trace_fx import build_graphs

        return build_graphs(self)


def _format_arg(a: Any) -> str:
    if type(a) is list or type(a) is tuple:
        return f"[{', '.join(_format_arg(x) for x in a)}]"
    return str(a) if isinstance(a, _Value) else repr(a)


def _format_entry(entry: list[Any]) -> str:
    func, kwargs, outs, args = entry[_FUNC], entry[_KWARGS], entry[_OUTS], entry[_ARGS:]
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
        nodes = sorted({o.node for o in values} - {None})
        node = f", node {nodes[0]}" if nodes else ""
        return f"{lhs or '_'} = {call}  # ({', '.join(_type_str(o) for o in values)}){node}"
    return call if outs is None else f"_ = {call}  # {outs!r}"


# --------------------------------------------------------------------- trace()
class _TraceBlock:
    """The context manager :func:`trace` returns; ``__enter__`` gives the :class:`Trace`."""

    def __init__(self, names: Optional[Mapping[str, _Tensor]]) -> None:
        self._names = names
        self._trace: Optional[Trace] = None
        self._mode: Optional[_Recorder] = None

    def __enter__(self) -> Trace:
        if self._trace is not None:
            raise RuntimeError(
                "torch_autobatch.trace(): this block was already entered; call trace() "
                "again for a new one."
            )
        t = self._trace = Trace(self._names)
        self._mode = _Recorder(t)
        _push_mode(self._mode)
        return t

    def __exit__(self, *exc: Any) -> None:
        tls, mode = _tls, self._mode
        self._mode = None
        try:
            if tls.pending is not None:
                _flush(tls)
        finally:
            tls.pending = tls.pending_base = None
            _remove_mode(mode)


def _remove_mode(mode: Any) -> None:
    """Pops ``mode`` off this thread's dispatch-mode stack, keeping any mode above it."""
    above = []
    try:
        while _stack_len() > 0:
            top = _pop_mode(None)
            if top is mode:
                return
            above.append(top)
    finally:
        for m in reversed(above):
            _push_mode(m)


def _check_names(names: Any) -> Optional[dict[str, _Tensor]]:
    where = "torch_autobatch.trace(names=...)"
    if names is None:
        return None
    if isinstance(names, torch.nn.Module):
        names = {**dict(names.named_parameters()), **dict(names.named_buffers())}
    elif not isinstance(names, Mapping):
        raise TypeError(f"{where}: expected a mapping from name to tensor or an nn.Module, "
                        f"got {type(names).__name__}.")
    for name, t in names.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"{where}: got the name {name!r}; expected letters, digits, '_' "
                             "and '.' (e.g. 'x', 'fc1.weight', '0.bias').")
        if _RESERVED_NAME_RE.match(name):
            raise ValueError(f"{where}: the name {name!r} is reserved (N names outputs, argN "
                             "unnamed inputs, .grad gradients); choose another.")
        if not isinstance(t, _Tensor):
            raise TypeError(f"{where}: expected a tensor for {name!r}, got {type(t).__name__}.")
    return dict(names)


def trace(names: Union[Mapping[str, _Tensor], torch.nn.Module, None] = None) -> _TraceBlock:
    """Records the ops run on this thread inside the block, and their backward.

    Example::

        >>> with torch_autobatch.trace(names={"x": x, **dict(model.named_parameters())}) as t:
        ...     loss = model(x).sum()
        >>> loss.backward()          # after the block: still recorded into t
        >>> print(t)                 # forward ops, then backward ops grouped by node
        >>> graphs = t.to_fx()       # GraphModules that replay it
        >>> graphs.run()[t.name_of(loss)]

    NOTE [Which trace records an op]

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
    mode, no hook. On exit, also by an exception, the block removes its mode
    and restores the thread's tracing state.

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
    of a node created while tracing, that node's trace.
    """
    mode = _recorder_on_stack()
    return None if mode is None else mode.trace
