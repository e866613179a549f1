"""``Trace.to_fx()``: :class:`torch.fx.GraphModule` s that replay a recorded trace."""

from __future__ import annotations

import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.fx

from ._record import _ACCUMULATE, _Entry, _Input, _Tensor, _Value

__all__ = ["TraceGraphs", "build_graphs"]


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
    draw new numbers::

        >>> w = torch.ones(3, requires_grad=True)
        >>> with torch_autobatch.trace(names={"w": w}) as t:
        ...     loss = (w * w).sum()
        >>> loss.backward()
        >>> graphs = t.to_fx()
        >>> graphs, graphs.forward.input_names, graphs.backward[0].input_names
        (<torch_autobatch.TraceGraphs: 2 modules>, ('%w',), ('%arg0', '%w'))
        >>> graphs.run()["%w.grad"]
        tensor([2., 2., 2.])
    """

    def __init__(self, modules: list[torch.fx.GraphModule], defaults: dict[str, Any]) -> None:
        self.modules = modules
        self._defaults = defaults

    @property
    def forward(self) -> torch.fx.GraphModule:
        """The first module: the forward ops (an empty module if the trace has none).

        Example::

            >>> x = torch.tensor([1.0, 2.0])
            >>> with torch_autobatch.trace(names={"x": x}) as t:
            ...     y = x * 3
            >>> fwd = t.to_fx().forward
            >>> fwd.input_names, fwd(torch.ones(2))
            (('%x',), {'%0': tensor([3., 3.])})
        """
        return self.modules[0]

    @property
    def backward(self) -> list[torch.fx.GraphModule]:
        """The modules of the backward calls, in the order they ran.

        Example::

            >>> w = torch.ones(2, requires_grad=True)
            >>> with torch_autobatch.trace(names={"w": w}) as t:
            ...     loss = (w * 3).sum()
            >>> loss.backward(retain_graph=True)
            >>> loss.backward()
            >>> backward = t.to_fx().backward
            >>> len(backward), backward[0].input_names
            (2, ('%arg0',))
            >>> backward[0](torch.tensor(1.0))["%w.grad"]
            tensor([3., 3.])
        """
        return [m for m in self.modules if m.pass_no > 0]  # type: ignore[operator]

    def __repr__(self) -> str:
        return f"<torch_autobatch.TraceGraphs: {len(self.modules)} modules>"

    def run(self, inputs: Optional[Mapping[str, _Tensor]] = None, *, clone_inputs: bool = True) -> dict[str, _Tensor]:
        """Runs every module in order under ``torch.no_grad()``; returns all they return.

        Args:
            inputs: input name (``"%x"`` or ``"x"``) -> tensor. Inputs not given
                default to the tensors the trace holds (NOTE [What a Trace holds]).
            clone_inputs: replay on clones of the inputs, so that the in-place
                ops the trace recorded (a BatchNorm's running statistics, an
                optimizer step) do not change the caller's tensors. Pass False
                to replay on the tensors themselves (and keep their aliasing).

        Returns:
            value name -> tensor, for every value a module returns (see the
            class doc). The gradients of a leaf from several backward calls are
            summed into ``"%w.grad"``, as ``.grad`` accumulates them.

        Example::

            >>> x, w = torch.ones(3), torch.ones(3, requires_grad=True)
            >>> with torch_autobatch.trace(names={"x": x, "w": w}) as t:
            ...     loss = (x * w).sum()
            >>> loss.backward()
            >>> graphs = t.to_fx()
            >>> graphs.run()[t.name_of(loss)]  # the inputs the trace holds
            tensor(3.)
            >>> out = graphs.run({"x": torch.tensor([1.0, 2.0, 3.0])})
            >>> out[t.name_of(loss)], out["%w.grad"]
            (tensor(6.), tensor([1., 2., 3.]))
        """
        env: dict[str, Any] = {k: r() for k, r in self._defaults.items()}
        for k, t in (inputs or {}).items():
            if not isinstance(k, str) or not isinstance(t, _Tensor):
                raise TypeError(
                    "TraceGraphs.run: expected inputs to map names to tensors, got "
                    f"{type(k).__name__} -> {type(t).__name__}."
                )
            env[k if k.startswith("%") else f"%{k}"] = t
        if clone_inputs:
            env = {k: None if t is None else t.detach().clone() for k, t in env.items()}
        with torch.no_grad():
            for gm in self.modules:
                args = []
                input_names: list[str] = gm.input_names  # type: ignore[assignment]  # set by build_graphs
                for name in input_names:
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


def _uses(entry: _Entry) -> Iterator[_Value]:
    """The values an entry reads (an AccumulateGrad line reads its gradient, not its leaf)."""
    if entry.func is _ACCUMULATE:
        return iter((entry.args[-1],))
    return _values_in((entry.args, tuple(entry.kwargs.values())))


def build_graphs(entries: Sequence[_Entry], inputs: Sequence[_Input]) -> TraceGraphs:
    """The modules that replay a trace's ``entries``; ``inputs``: the trace's inputs."""
    # Segments: maximal runs of entries of one pass (forward = pass 0), in order.
    segments: list[tuple[int, list[_Entry]]] = [(0, [])]
    for e in list(entries):
        if e.group.pass_no != segments[-1][0]:
            segments.append((e.group.pass_no, []))
        segments[-1][1].append(e)

    made: dict[_Value, int] = {}  # value -> segment that makes it
    last_use: dict[_Value, int] = {}  # value -> last segment that uses it
    for s, (_, segment) in enumerate(segments):
        for e in segment:
            for v in _uses(e):
                last_use[v] = s
            for v in _values_in(e.outs):
                made[v] = s

    modules = []
    for s, (pass_no, segment) in enumerate(segments):
        graph = torch.fx.Graph()
        nodes: dict[_Value, torch.fx.Node] = {}
        placeholders: list[_Value] = []
        for e in segment:
            for v in _uses(e):
                if made.get(v) != s and v not in nodes:
                    nodes[v] = graph.placeholder(_fx_name(str(v)))
                    placeholders.append(v)

        def fx(a: Any) -> Any:
            if isinstance(a, _Value):
                return nodes[a]  # noqa: B023  (fx is used within this iteration only)
            if type(a) is list or type(a) is tuple:
                return type(a)(fx(x) for x in a)
            return a

        results: dict[str, torch.fx.Node] = {}
        for e in segment:
            func, outs = e.func, e.outs
            if func is _ACCUMULATE:  # two runs in one module (threads): their sum
                key, grad = f"{e.args[0]}.grad", nodes[e.args[-1]]
                prev = results.get(key)
                results[key] = grad if prev is None else graph.call_function(operator.add, (prev, grad))
                continue
            name = _fx_name(str(outs)) if type(outs) is _Value else None
            node = graph.create_node(
                "call_function",
                func,
                tuple(fx(e.args)),
                {k: fx(a) for k, a in e.kwargs.items()},
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
            if made.get(v) == s and last_use.get(v, -1) != s:
                results[str(v)] = node  # used later, or never: a result
        graph.output(results)
        gm = torch.fx.GraphModule(
            torch.nn.Module(),
            graph,
            class_name="TraceForward" if pass_no == 0 else f"TraceBackward{pass_no}",
        )
        gm.input_names = tuple(str(v) for v in placeholders)  # type: ignore[assignment]
        gm.pass_no = pass_no  # type: ignore[assignment]
        modules.append(gm)
    return TraceGraphs(modules, {str(v): v for v in inputs})
