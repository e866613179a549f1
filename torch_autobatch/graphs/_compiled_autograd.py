"""What compiled autograd runs for an op's grad node (csrc/compiled_autograd.cpp).

The node hands compiled autograd a :class:`CompiledNode` and has it record
``call_backward(node, saved_tensors, *grads)``, as autograd.Function's node
does: NOTE [Compiled autograd sees an autograd.Function]. Dynamo then traces
:meth:`CompiledNode.run`, the user's backward included, into the compiled
backward.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CompiledNode"]


class _NodeBackward(torch.autograd.Function):
    """The class whose ``backward`` compiled autograd's ``call_backward`` calls; never applied."""

    @staticmethod
    def forward(*args: Any) -> Any:
        raise RuntimeError("torch_autobatch: _NodeBackward stands for a grad node; it is never applied.")

    @staticmethod
    def backward(fake: Any, *grads: Any) -> Any:
        # fake: torch._dynamo.external_utils.FakeBackwardCFunction(CompiledNode, saved tensors)
        return fake.real.run(fake.saved_tensors, grads)


class _CtxWithSaved:
    """The op's ctx as its backward sees it in a compiled backward.

    ``saved_tensors`` are the compiled graph's; every other attribute is the
    ctx's own. (Eagerly, the node lends the ctx its saved tensors through a
    thread-local stack, NOTE [Saved tensors belong to the call], which
    Dynamo cannot trace.)
    """

    def __init__(self, ctx: Any, saved: tuple[Any, ...], vjp_call: _Residuals | None) -> None:
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved_tensors", saved)
        if vjp_call is not None:
            object.__setattr__(self, "vjp_call", vjp_call)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ctx, name, value)


class _Residuals:
    """A register_vjp call's residuals, rebuilt in Python from what the node saved.

    Stands for the call's C++ ``_VjpCall`` (csrc/vjp_residuals.cpp), whose
    ``residuals`` Dynamo cannot trace. A compiled backward is never
    differentiated again (compiled autograd refuses ``create_graph``), so
    ``fwd`` never runs again (NOTE [Second derivatives through residuals]).
    """

    def __init__(self, parts: tuple[tuple[Any, ...], tuple[tuple[int, int], ...], Any]) -> None:
        self.leaves, self.slots, self.spec = parts

    def residuals(self, saved: tuple[Any, ...]) -> tuple[Any]:
        values = list(self.leaves)
        for leaf, slot in self.slots:
            values[leaf] = saved[slot]
        if self.spec is None:
            return (tuple(values),)
        return (torch.utils._pytree.tree_unflatten(values, self.spec),)


def _group(flat: tuple[Any, ...], slots: tuple[tuple[int, int, bool], ...]) -> tuple[Any, ...]:
    """One value per return of the op (a list for a list return) from the flat gradients."""
    out: list[Any] = []
    for first, count, is_list in slots:
        if is_list:
            out.append(list(flat[first : first + count]))
        else:
            out.append(flat[first] if count else None)
    return tuple(out)


@torch._dynamo.disable
def _run_eagerly(node: CompiledNode, saved: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
    """The node's backward as the eager node runs it, between compiled graphs."""
    return node.node.run_backward(saved, grads)


class CompiledNode:
    """One grad node of an op, as compiled autograd's ``call_backward`` sees it.

    Made by the node's ``compiled_args`` for each backward (a graph input, as
    a hook is), so the compiled graph always runs the current node's op and
    ctx; Dynamo guards on what the backward reads of them.
    """

    _forward_cls = _NodeBackward

    def __init__(self, opdef: Any, ctx: Any, node: Any) -> None:
        self.opdef = opdef
        self.ctx = ctx
        self.node = node
        self.ret_slots, self.arg_slots, self.edges, self.returns_an_argument = node.compiled_info()
        # A preset's backward is an opaque kernel, called through machinery of
        # ours that Dynamo need not see; a node made under vmap runs its
        # backward batched, re-entering the vmap levels (NOTE [Re-entering the
        # vmap levels], csrc/vmap_frames.h): both run eagerly between graphs.
        self.opaque = opdef._ab.vmap_preset is not None or node.has_frames
        call = getattr(ctx, "vjp_call", None)  # a register_vjp op's (op/_vjp.py)
        self.vjp_call = None if call is None else _Residuals(call.residual_parts())

    def run(self, saved: Any, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        """The node's backward: the user's, its gradients checked as the eager node checks them."""
        if self.opaque:
            return _run_eagerly(self, saved, grads)
        result = self.opdef._run_backward(
            _CtxWithSaved(self.ctx, tuple(saved), self.vjp_call), _group(grads, self.ret_slots)
        )
        out = self._input_grads(result)
        # Anything else (a gradient to sum or cast, a list, an error to raise)
        # is the eager node's C++ check, which Dynamo runs between graphs.
        return self.node.input_grads(result) if out is None else out

    def _input_grads(self, result: tuple[Any, ...]) -> tuple[Any, ...] | None:
        """One gradient per input, where each is None or a tensor of its input's shape and dtype."""
        if len(result) != len(self.arg_slots) or self.returns_an_argument:
            return None
        out: list[Any] = [None] * len(self.edges)
        for g, (first, count, is_list) in zip(result, self.arg_slots):
            if g is None:
                continue
            if not is_list:
                if count != 1 or not self._fits(g, first, out):
                    return None
            elif not isinstance(g, (list, tuple)) or len(g) != count:
                return None
            else:
                for k, gk in enumerate(g):
                    if gk is not None and not self._fits(gk, first + k, out):
                        return None
        return tuple(out)

    def _fits(self, g: Any, edge: int, out: list[Any]) -> bool:
        """Whether ``g`` is a gradient of the input at ``edge`` as it is (then put in ``out``)."""
        if not isinstance(g, torch.Tensor):
            return False
        meta = self.edges[edge]
        if meta is None:  # no gradient wanted
            return True
        _, _, dtype, size = meta
        if tuple(g.shape) != size or g.dtype != dtype:
            return False
        out[edge] = g
        return True
