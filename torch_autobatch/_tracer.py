"""``torch_autobatch.trace``: record the aten ops a model runs in forward *and* backward.

Public API (exported from ``torch_autobatch``):

- :func:`trace` — a context manager that records, on the current thread only,
  every dispatcher op run inside it, and every op that the backward of the
  autograd nodes created inside it runs, wherever and whenever that backward
  runs;
- :func:`current_trace` — the trace that records the current thread's ops;
- :class:`Trace` — the recording: ``print(t)`` lists it, ``t.to_fx()`` makes
  :class:`torch.fx.GraphModule` s that replay it.

How it works, in one paragraph per mechanism (the notes below hold the why):

- Forward: entering :func:`trace` pushes a :class:`_Recorder`, a
  ``TorchDispatchMode``, onto *this thread's* dispatch-mode stack. It sees
  every aten op below autograd, and a dispatcher custom op (e.g. one made by
  :func:`torch_autobatch.custom_op`) as one op, never its decomposition.
- Autograd nodes: after each recorded op, the ``grad_fn`` of its outputs is
  tagged (``node.metadata["torch_autobatch_trace"]``) and given a pre-hook.
  See NOTE [Finding the nodes an op created].
- Backward: the pre-hook pushes a :class:`_Recorder` for that node on
  whatever thread runs it. See NOTE [Why a node pre-hook and no post-hook].
"""

from __future__ import annotations

import itertools
import operator
import re
import threading
import weakref
from functools import partial
from typing import Any, Callable, Iterator, Mapping, Optional, Union

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Trace", "TraceGraphs", "current_trace", "trace"]

_Tensor = torch.Tensor
_ref = weakref.ref
_AccumulateGrad = torch._C._functions.AccumulateGrad
_graph_task_id = torch._C._current_graph_task_id
_current_node = torch._C._current_autograd_node
_grad_enabled = torch.is_grad_enabled
_push_mode = torch._C._push_on_torch_dispatch_stack
_pop_mode = torch._C._pop_torch_dispatch_stack
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at

#: ``node.metadata`` key of an autograd node created while tracing: ``(trace, node index)``.
NODE_KEY = "torch_autobatch_trace"
_ACC_KEY = "torch_autobatch_trace_accumulate_grad"
_acc_lock = threading.Lock()

# NOTE [Thread-local tracing state]
# Everything that says "this thread is tracing" lives in two thread-local
# places, and both are restored on every exit path:
#   - the dispatch-mode stack (C++, per thread): a _Recorder on it is what
#     records. trace() pops its own in `finally`; a node's pre-hook pushes one
#     that the autograd engine itself removes when the node is done, even when
#     the node raises (see NOTE [Why a node pre-hook and no post-hook]);
#   - `_tls` below: the active trace() blocks, the `busy` flag (set only while
#     a _Recorder that has another one under it runs an op, reset in
#     `finally`), and work left for the next op. It holds tensors and traces
#     only weakly.
# torch.utils._python_dispatch.is_in_torch_dispatch_mode() is process-global
# and its save/restore races between threads, so the modes are pushed with
# torch._C._push_on_torch_dispatch_stack directly, never with `with mode:`.


class _State(threading.local):
    def __init__(self) -> None:
        self.blocks: list[Trace] = []  # trace() blocks active on this thread, innermost last
        self.busy = False  # a _Recorder runs an op: the _Recorders under it pass it through
        # (weakref to Trace, output value(s), in-place-on-view flag): the last recorded op,
        # whose outputs' grad_fn are tagged at the next op.
        self.pending: Optional[tuple[Any, Any, bool]] = None
        self.task = -1  # graph task of the last traced node run on this thread ...
        self.task_trace: Callable[[], Optional[Trace]] = lambda: None  # ... and its trace
        self.flush_task = -1  # graph task for which a flush callback is queued


_tls = _State()


class _Value:
    """One recorded tensor value. Holds no tensor (``ref`` is a weak reference).

    Values are SSA: an in-place op's output is a new value. ``num >= 0``: the
    output numbered ``num`` (``%num``); ``num < 0``: an input (:class:`_Input`).
    ``node``, once set, is the index of the autograd node whose grad_fn it is.
    """

    __slots__ = ("num", "ref", "shape", "dtype", "node")

    def __init__(self, num: int, ref: Any, shape: torch.Size, dtype: torch.dtype) -> None:
        self.num = num
        self.ref = ref
        self.shape = shape
        self.dtype = dtype

    def __str__(self) -> str:
        return f"%{self.num}"

    __repr__ = __str__


class _Input(_Value):
    """A tensor that no recorded op made. ``held`` keeps it (see NOTE [What a Trace holds])."""

    __slots__ = ("name", "held", "requires_grad")

    def __str__(self) -> str:
        return self.name


class _Group:
    """Where recorded ops belong: the forward, or one run of one node's backward."""

    __slots__ = ("pass_no", "name", "index", "leaf")

    def __init__(self, pass_no: int, name: str, index: Optional[int] = None,
                 leaf: Optional[_Value] = None) -> None:
        self.pass_no = pass_no  # 0: forward; k: the k-th backward call that ran this trace's nodes
        self.name = name
        self.index = index
        self.leaf = leaf

    @property
    def label(self) -> str:
        if self.leaf is not None:
            return f"{self.name} ({self.leaf})"
        return self.name if self.index is None else f"{self.name} (node {self.index})"


class _Accumulate:
    """The pseudo-op of an ``AccumulateGrad`` run: ``leaf.grad += grad``."""

    def __repr__(self) -> str:
        return "accumulate_grad"


_ACCUMULATE = _Accumulate()


# ------------------------------------------------------------------ recording
class _Recorder(TorchDispatchMode):
    """Records every op that reaches it into ``trace``, under ``group``.

    ``group`` is None for the mode of a :func:`trace` block: its ops are the
    forward (or, inside a backward that no traced node started, that node's).
    ``shadows``: another _Recorder is under this one on the stack; it must not
    record what this one records (it sees the ops this one runs).
    """

    def __init__(self, trace: Trace, group: Optional[_Group]) -> None:
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
        tls = _tls
        if tls.busy:  # a _Recorder above this one records this op
            return func(*args, **kwargs) if kwargs else func(*args)
        pending = tls.pending
        if pending is not None:
            tls.pending = None
            _tag_outputs(*pending)
        if self.shadows:
            tls.busy = True
            try:
                out = func(*args, **kwargs) if kwargs else func(*args)
            finally:
                tls.busy = False
        else:
            out = func(*args, **kwargs) if kwargs else func(*args)

        # Record. This is the hot path: see NOTE [Cost of recording].
        trace = self.trace
        ids = trace._ids
        grad = _grad_enabled()
        rargs = []
        for a in args:
            if isinstance(a, _Tensor):
                v = ids.get(id(a))
                if v is None or v.ref() is not a:
                    v = trace._new_input(a)
                elif grad and a._is_view():
                    _tag_view_input(trace, a)
                rargs.append(v)
            elif (type(a) is list or type(a) is tuple) and a and type(a[0]) is not int:
                rargs.append(trace._map(a))
            else:
                rargs.append(a)
        if kwargs:
            kwargs = {k: trace._map(a) for k, a in kwargs.items()}
        if isinstance(out, _Tensor):
            outs: Any = _Value(trace._next_num(), _ref(out), out.shape, out.dtype)
            ids[id(out)] = outs
        elif type(out) is tuple or type(out) is list:
            outs = tuple(trace._output(o) if isinstance(o, _Tensor) else o for o in out)
        else:
            outs = out
        group = self.group
        if group is None:
            group = trace._forward if _graph_task_id() == -1 else trace._untraced_group()
        trace._entries.append((group, func, rargs, kwargs, outs))
        if grad:
            tls.pending = (trace._weakself, outs, out is args[0] if args else False)
        return out


def _recorder_on_stack() -> Optional[_Recorder]:
    """The topmost _Recorder on this thread's dispatch-mode stack, if any."""
    for i in range(_stack_len() - 1, -1, -1):
        mode = _stack_at(i)
        if type(mode) is _Recorder:
            return mode
    return None


def _tag_outputs(trace_ref: Any, outs: Any, inplace: bool) -> None:
    """Tags the grad_fn of the last recorded op's outputs, now that autograd has set them.

    NOTE [Finding the nodes an op created]
    The mode sits below autograd: an op's outputs get their grad_fn only after
    the mode returns. So each recorded op leaves its outputs in `_tls.pending`
    and the next op (or the end of the block, or the next node's pre-hook, or
    the end of a create_graph backward) tags them. Every node is the grad_fn of
    some op's output at that moment: C++ composites (linear, matmul) reach the
    mode op by op, and a view op's output is the very tensor autograd returns.
    Two kinds of nodes are nobody's grad_fn then:
      - the CopySlices made by an in-place op on a view is the grad_fn of the
        view's *base*: it is tagged from there. (Hooks on the node CopySlices
        wraps never fire; CopySlices' do.)
      - a view whose base was later modified in place gets a new grad_fn when
        it is next used: views are checked when they are an op's input
        (`_tag_view_input`).
    """
    trace = trace_ref()
    if trace is None:
        return
    if type(outs) is _Value:
        t = outs.ref()
        if t is None:
            return
        fn = t.grad_fn
        if fn is not None:
            md = fn.metadata
            if NODE_KEY not in md:
                outs.node = trace._tag(fn, md)
        if inplace and t._is_view():
            base = t._base
            fn = None if base is None else base.grad_fn
            if fn is not None:
                md = fn.metadata
                if NODE_KEY not in md:
                    trace._tag(fn, md)
    elif type(outs) is tuple:
        for v in outs:
            if type(v) is _Value:
                t = v.ref()
                fn = None if t is None else t.grad_fn
                if fn is not None:
                    md = fn.metadata
                    tag = md.get(NODE_KEY)
                    v.node = trace._tag(fn, md) if tag is None else tag[1]


def _tag_view_input(trace: Trace, a: _Tensor) -> None:
    fn = a.grad_fn
    if fn is not None:
        md = fn.metadata
        if NODE_KEY not in md:
            trace._tag(fn, md)


def _flush(tls: _State) -> None:
    pending = tls.pending
    if pending is not None:
        tls.pending = None
        _tag_outputs(*pending)


def _flush_callback() -> None:
    tls = _tls
    tls.flush_task = -1
    _flush(tls)


def _node_prehook(trace: Trace, index: int, name: str, grad_outputs: Any) -> None:
    """Runs before a traced node's backward, on the thread that runs it.

    NOTE [Why a node pre-hook and no post-hook]
    The engine runs a node's pre-hooks, its backward and the accumulation of
    its results into the next nodes' input buffers under one guard that saves
    and restores the thread-local state, dispatch-mode stack included. A mode
    pushed here therefore records exactly that node's work (the gradient
    additions the engine does for it included), and is gone when the node is
    done, whether it returned or raised: no post-hook, nothing to undo.
    """
    tls = _tls
    if tls.pending is not None:
        _flush(tls)
    task = _graph_task_id()
    tls.task = task
    tls.task_trace = trace._weakself
    if tls.flush_task != task and _grad_enabled():
        # create_graph=True: the last op's outputs get nodes, to tag after the last node.
        tls.flush_task = task
        torch.autograd.Variable._execution_engine.queue_callback(_flush_callback)
    _push_mode(_Recorder(trace, _Group(trace._pass_of(task), name, index)))


def _accumulate_grad_prehook(grad_outputs: Any) -> None:
    """Runs before an ``AccumulateGrad`` node that a traced node feeds.

    AccumulateGrad nodes belong to the leaf, not to one graph: two traces (two
    threads) may run the same one. So it carries one shared hook, and the run
    is attributed to the trace of the last traced node that ran in the same
    backward call on this thread (``torch._C._current_graph_task_id()``).
    """
    tls = _tls
    if tls.pending is not None:
        _flush(tls)
    task = _graph_task_id()
    if task != tls.task:
        return
    trace = tls.task_trace()
    if trace is None:
        return
    leaf = trace._value(_current_node().variable)
    group = _Group(trace._pass_of(task), "AccumulateGrad", None, leaf)
    grad = grad_outputs[0]
    if grad is not None:
        trace._entries.append((group, _ACCUMULATE, (leaf, trace._value(grad)), {}, None))
    _push_mode(_Recorder(trace, group))


def _hook_accumulate_grad(node: Any) -> None:
    with _acc_lock:
        md = node.metadata
        if _ACC_KEY not in md:
            md[_ACC_KEY] = True
            node.register_prehook(_accumulate_grad_prehook)


# ---------------------------------------------------------------------- Trace
_DTYPE_ABBR = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*\Z")
_AUTO_NAME_RE = re.compile(r"arg\d+\Z")


def _type_str(v: _Value) -> str:
    return f"{_DTYPE_ABBR.get(v.dtype, str(v.dtype))}[{', '.join(map(str, v.shape))}]"


class Trace:
    """The ops one :func:`trace` block ran, and the ops its autograd nodes' backward ran.

    ``str(t)`` (``print(t)``) is a stable listing: the inputs, the forward ops,
    then each backward call (``backward 1``, ``backward 2``, ...) with the ops
    grouped by the autograd node that ran them, in the order they ran::

        inputs:
          %x: f32[2, 3]
          %w: f32[3, 4] requires_grad
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
            %5 = aten.detach.default(%4)  # f32[3, 4]

    Values are ``%0, %1, ...`` in recording order (an in-place op gets a new
    number); inputs (tensors no recorded op made) are named by :func:`trace`'s
    ``names`` or ``%arg0, %arg1, ...`` in order of first use. ``node k`` after
    an op is the autograd node that differentiates it (``node.metadata
    ["torch_autobatch_trace"]`` of that node holds ``k``).

    NOTE [What a Trace holds]
    A Trace holds no tensor that a recorded op made: only names, shapes and
    dtypes. It holds the inputs without a ``grad_fn`` (parameters, data, the
    gradient ``backward()`` starts from), so that :meth:`TraceGraphs.run` can
    replay without arguments; inputs with a ``grad_fn`` are held weakly. The
    autograd nodes created while tracing hold the Trace (through their
    pre-hook and ``metadata``), and nothing in a Trace holds a node: freeing
    the outputs and the Trace frees everything.
    """

    def __init__(self, names: Optional[Mapping[str, _Tensor]] = None) -> None:
        self._weakself = _ref(self)
        self._ids: dict[int, _Value] = {}  # id(tensor) -> its latest value (checked by .ref)
        self._inputs: list[_Input] = []
        self._unnamed = 0  # inputs named %arg0, %arg1, ...
        self._entries: list[tuple[Any, ...]] = []  # (group, func, args, kwargs, outputs)
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
            if type(v) is _Input and v.ref() is t:
                return v
            v = _Input(-1 - len(self._inputs), _ref(t), t.shape, t.dtype)
            if name is None:
                name = f"arg{self._unnamed}"
                self._unnamed += 1
            v.name = f"%{name}"
            v.requires_grad = t.requires_grad
            v.held = t if t.grad_fn is None else None
            self._inputs.append(v)
            self._ids[id(t)] = v
            return v

    def _value(self, t: _Tensor) -> _Value:
        v = self._ids.get(id(t))
        if v is None or v.ref() is not t:
            v = self._new_input(t)
        return v

    def _map(self, a: Any) -> Any:
        if isinstance(a, _Tensor):
            return self._value(a)
        if type(a) is list or type(a) is tuple:
            return type(a)(self._map(x) for x in a)
        return a

    def _output(self, t: _Tensor) -> _Value:
        v = _Value(self._next_num(), _ref(t), t.shape, t.dtype)
        self._ids[id(t)] = v
        return v

    def _tag(self, fn: Any, md: dict[str, Any]) -> int:
        """Makes autograd node ``fn`` record its backward into this trace; returns its index."""
        index = self._next_node()
        name = fn.name()
        md[NODE_KEY] = (self, index)
        fn.register_prehook(partial(_node_prehook, self, index, name))
        for nxt, _ in fn.next_functions:
            if type(nxt) is _AccumulateGrad and _ACC_KEY not in nxt.metadata:
                _hook_accumulate_grad(nxt)
        return index

    def _pass_of(self, task: int) -> int:
        pass_no = self._passes.get(task)
        if pass_no is None:
            with self._lock:
                pass_no = self._passes.setdefault(task, len(self._passes) + 1)
        return pass_no

    def _untraced_group(self) -> _Group:
        """The group of an op a trace() block's mode sees inside a backward.

        That is the backward of a node no trace tagged (one created before the
        block) that runs on this thread while the block is active.
        """
        task = _graph_task_id()
        node = _current_node()
        key = (task, None) if node is None else (task, node.name(), node._sequence_nr())
        group = self._untraced.get(key)
        if group is None:
            name = "(engine)" if node is None else f"{node.name()} (untraced node)"
            group = self._untraced[key] = _Group(self._pass_of(task), name)
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
        if v is None or v.ref() is not tensor:
            raise KeyError(
                f"Trace.name_of: this tensor (shape {tuple(tensor.shape)}, dtype "
                f"{tensor.dtype}) was neither made nor used by an op this trace recorded."
            )
        return str(v)

    @property
    def inputs(self) -> dict[str, Optional[_Tensor]]:
        """Input name -> tensor (None if only held weakly and since freed), in order of first use."""
        return {str(v): v.ref() for v in self._inputs}

    def __len__(self) -> int:
        """The number of recorded entries (ops, and ``AccumulateGrad`` pseudo-ops)."""
        return len(self._entries)

    def __repr__(self) -> str:
        fwd = sum(1 for e in self._entries if e[0].pass_no == 0)
        return (
            f"<torch_autobatch.Trace: {len(self._inputs)} inputs, {fwd} forward ops, "
            f"{len(self._passes)} backward calls, {len(self._entries) - fwd} backward ops>"
        )

    def __str__(self) -> str:
        lines = ["inputs:"]
        for v in self._inputs:
            rg = " requires_grad" if v.requires_grad else ""
            lines.append(f"  {v}: {_type_str(v)}{rg}")
        lines.append("forward:")
        current_pass, current_group = 0, self._forward
        for group, func, args, kwargs, outs in self._entries:
            if group is not current_group:
                if group.pass_no != current_pass:
                    current_pass = group.pass_no
                    lines.append(f"backward {current_pass}:" if current_pass else "forward:")
                if group.pass_no:
                    lines.append(f"  {group.label}:")
                current_group = group
            indent = "    " if group.pass_no else "  "
            lines.append(indent + _format_entry(func, args, kwargs, outs))
        return "\n".join(lines)

    def to_fx(self) -> TraceGraphs:
        """:class:`torch.fx.GraphModule` s that replay the recording: see :class:`TraceGraphs`."""
        return _build_graphs(self)


def _format_arg(a: Any) -> str:
    if type(a) is list or type(a) is tuple:
        inner = ", ".join(_format_arg(x) for x in a)
        return f"[{inner}]"
    return str(a) if isinstance(a, _Value) else repr(a)


def _format_entry(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], outs: Any) -> str:
    if func is _ACCUMULATE:
        return f"{args[0]}.grad += {args[1]}"
    call = ", ".join([_format_arg(a) for a in args] + [f"{k}={_format_arg(a)}" for k, a in kwargs.items()])
    call = f"{func}({call})"
    if type(outs) is _Value:
        index = getattr(outs, "node", None)
        node = "" if index is None else f", node {index}"
        return f"{outs} = {call}  # {_type_str(outs)}{node}"
    if type(outs) is tuple:
        vals = [o for o in outs if type(o) is _Value]
        lhs = ", ".join(str(o) if type(o) is _Value else "_" for o in outs)
        types = ", ".join(_type_str(o) for o in vals)
        nodes = sorted({o.node for o in vals if getattr(o, "node", None) is not None})
        node = f", node {nodes[0]}" if nodes else ""
        return f"{lhs or '_'} = {call}  # ({types}){node}"
    return f"_ = {call}  # {outs!r}" if outs is not None else call


# --------------------------------------------------------------------- trace()
class _TraceBlock:
    """The context manager :func:`trace` returns."""

    def __init__(self, names: Optional[Mapping[str, _Tensor]]) -> None:
        self._names = names
        self._trace: Optional[Trace] = None
        self._mode: Optional[_Recorder] = None

    def __enter__(self) -> Trace:
        if self._mode is not None:
            raise RuntimeError(
                "torch_autobatch.trace(): this block is already active; call trace() "
                "again for a new one."
            )
        t = Trace(self._names)
        self._names = None
        self._trace, self._mode = t, _Recorder(t, None)
        _push_mode(self._mode)
        _tls.blocks.append(t)
        return t

    def __exit__(self, *exc: Any) -> None:
        tls, mode = _tls, self._mode
        self._mode = None
        try:
            _flush(tls)
        finally:
            tls.pending = None
            tls.blocks.remove(self._trace)  # type: ignore[arg-type]
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
    if names is None:
        return None
    if isinstance(names, torch.nn.Module):
        named = dict(names.named_parameters())
        named.update(names.named_buffers())
        return named
    if not isinstance(names, Mapping):
        raise TypeError(
            "torch_autobatch.trace(names=...): expected a mapping from name to tensor "
            f"or an nn.Module, got {type(names).__name__}."
        )
    for name, t in names.items():
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(
                f"torch_autobatch.trace(names=...): got the name {name!r}; names must be "
                "identifiers, dots allowed (e.g. 'x', 'fc1.weight')."
            )
        if _AUTO_NAME_RE.match(name) or name.endswith(".grad"):
            raise ValueError(
                f"torch_autobatch.trace(names=...): the name {name!r} is reserved "
                "(argN names unnamed inputs, .grad the gradients); choose another."
            )
        if not isinstance(t, _Tensor):
            raise TypeError(
                f"torch_autobatch.trace(names=...): expected a tensor for {name!r}, "
                f"got {type(t).__name__}."
            )
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

    What is recorded (NOTE [Which trace records an op]):

    - inside the block, every dispatcher op run on *this* thread (other threads
      are never recorded), at the aten level: a ``torch_autobatch.custom_op``
      (or any dispatcher op that is not CompositeImplicitAutograd) is one op;
    - every autograd node created while an op is recorded remembers the trace
      that recorded the op, and every op its backward runs is recorded into
      that trace: after the block, on another thread, once per backward call
      (``retain_graph=True``), and with ``create_graph=True`` the nodes that
      backward creates are that trace's too (double backward is recorded);
    - nested blocks: an op is recorded by exactly one trace, the innermost
      active block on the thread (or, inside a backward, the node's trace).
      The outer block records again once the inner one exits; it never sees
      the inner block's ops, nor the backward of the inner block's nodes;
    - a node created outside any block whose backward runs on this thread
      while a block is active is recorded into that block, under
      ``<Name> (untraced node)``.

    Nothing is changed when no block is active and no traced node runs: no
    mode and no hook is installed. On exit (also by an exception) the block
    removes its mode and restores the thread's tracing state.

    Args:
        names: optional names for input tensors (``{"x": x}``), or a module,
            whose parameters and buffers are named by their qualified names.
            Unnamed inputs are ``%arg0, %arg1, ...``.

    Returns:
        a context manager whose ``__enter__`` returns the :class:`Trace`.
    """
    return _TraceBlock(_check_names(names))


def current_trace() -> Optional[Trace]:
    """The trace that would record an op run on this thread now, or None.

    That is the innermost active :func:`trace` block, or, inside the backward
    of a node created while tracing, that node's trace.
    """
    mode = _recorder_on_stack()
    return None if mode is None else mode.trace


# ---------------------------------------------------------------------- to_fx
def _fx_name(name: str) -> str:
    name = name.lstrip("%").replace(".", "_")
    return f"v{name}" if name[:1].isdigit() else name


class TraceGraphs:
    """GraphModules that replay a :class:`Trace`, in the order it was recorded.

    ``modules`` cuts the recording where it switches between the forward and a
    backward call: usually ``forward``, then one module per backward call
    (``backward[0]``, ``backward[1]``, ...). Each module takes, positionally,
    the values named by its ``input_names`` (inputs of the trace, and values
    an earlier module made) and returns a dict from value name (``"%3"``) to
    tensor: the values it makes that a later module uses, those that nothing
    uses (the results, e.g. the loss), and ``"%w.grad"``: the gradient that
    backward call accumulated into the leaf ``%w``. The ops are the recorded
    aten ops, replayed eagerly (views and in-place ops included); random ops
    draw new numbers.
    """

    def __init__(self, modules: list[torch.fx.GraphModule], defaults: dict[str, Any]) -> None:
        self.modules = modules
        self._defaults = defaults

    @property
    def forward(self) -> torch.fx.GraphModule:
        """The first module: the forward ops (an empty module if the trace has none)."""
        return self.modules[0]

    @property
    def backward(self) -> list[torch.fx.GraphModule]:
        """The modules of the backward calls, in the order they ran."""
        return [m for m in self.modules if m.pass_no > 0]  # type: ignore[operator]

    def __iter__(self) -> Iterator[torch.fx.GraphModule]:
        return iter(self.modules)

    def __repr__(self) -> str:
        return f"<torch_autobatch.TraceGraphs: {len(self.modules)} modules>"

    def run(self, inputs: Optional[Mapping[str, _Tensor]] = None) -> dict[str, _Tensor]:
        """Runs every module in order under ``torch.no_grad()``; returns all they return.

        ``inputs`` maps input names (``"%x"`` or ``"x"``) to tensors; inputs not
        given default to the tensors the trace holds (see NOTE [What a Trace
        holds]). The gradients of a leaf from several backward calls are summed
        into ``"%w.grad"``, as ``.grad`` accumulates them. In-place ops that the
        trace recorded on its inputs are replayed on the given tensors.
        """
        env: dict[str, Any] = {k: r() for k, r in self._defaults.items()}
        for k, t in (inputs or {}).items():
            env[k if k.startswith("%") else f"%{k}"] = t
        with torch.no_grad():
            for gm in self.modules:
                args = []
                for name in gm.input_names:  # type: ignore[attr-defined]
                    if env.get(name) is None:
                        raise ValueError(
                            f"TraceGraphs.run: no value for the input {name!r}: the trace "
                            f"held it weakly and it was freed. Pass it: run({{{name!r}: tensor}})."
                        )
                    args.append(env[name])
                for k, v in gm(*args).items():
                    if k.endswith(".grad") and env.get(k) is not None:
                        v = env[k] + v
                    env[k] = v
        return env


def _values_in(a: Any) -> Iterator[_Value]:
    if isinstance(a, _Value):
        yield a
    elif type(a) is list or type(a) is tuple:
        for x in a:
            yield from _values_in(x)


def _build_graphs(trace: Trace) -> TraceGraphs:
    # Segments: maximal runs of entries of one pass (forward = pass 0), in order.
    segments: list[tuple[int, list[tuple[Any, ...]]]] = [(0, [])]
    for e in list(trace._entries):
        if e[0].pass_no != segments[-1][0]:
            segments.append((e[0].pass_no, []))
        segments[-1][1].append(e)

    made: dict[_Value, int] = {}  # value -> segment that makes it
    last_use: dict[_Value, int] = {}  # value -> last segment that uses it
    for s, (_, entries) in enumerate(segments):
        for _, func, args, kwargs, outs in entries:
            used = args[1:] if func is _ACCUMULATE else (args, tuple(kwargs.values()))
            for v in _values_in(used):
                last_use[v] = s
            for v in _values_in(outs):
                made[v] = s

    modules = []
    for s, (pass_no, entries) in enumerate(segments):
        graph = torch.fx.Graph()
        nodes: dict[_Value, torch.fx.Node] = {}
        inputs: list[_Value] = []
        for _, func, args, kwargs, outs in entries:
            used = args[1:] if func is _ACCUMULATE else (args, tuple(kwargs.values()))
            for v in _values_in(used):
                if made.get(v) != s and v not in nodes:
                    nodes[v] = graph.placeholder(_fx_name(str(v)))
                    inputs.append(v)

        def fx(a: Any) -> Any:
            if isinstance(a, _Value):
                return nodes[a]
            if type(a) is list or type(a) is tuple:
                return type(a)(fx(x) for x in a)
            return a

        results: dict[str, torch.fx.Node] = {}
        for _, func, args, kwargs, outs in entries:
            if func is _ACCUMULATE:
                results[f"{args[0]}.grad"] = nodes[args[1]]
                continue
            name = _fx_name(str(outs)) if type(outs) is _Value else None
            node = graph.create_node(
                "call_function", func, tuple(fx(args)), {k: fx(a) for k, a in kwargs.items()},
                name=name,
            )
            if type(outs) is _Value:
                nodes[outs] = node
            elif type(outs) is tuple:
                for i, o in enumerate(outs):
                    if type(o) is _Value:
                        nodes[o] = graph.create_node(
                            "call_function", operator.getitem, (node, i), name=_fx_name(str(o))
                        )
        for v, node in nodes.items():
            if made.get(v) == s and last_use.get(v, s) == s and v in last_use:
                continue  # used only inside this module
            if made.get(v) == s:
                results[str(v)] = node
        graph.output(results)
        gm = torch.fx.GraphModule(
            torch.nn.Module(), graph,
            class_name="TraceForward" if pass_no == 0 else f"TraceBackward{pass_no}",
        )
        gm.input_names = tuple(str(v) for v in inputs)  # type: ignore[assignment]
        gm.pass_no = pass_no  # type: ignore[assignment]
        modules.append(gm)
    defaults = {str(v): v.ref for v in trace._inputs}
    return TraceGraphs(modules, defaults)
