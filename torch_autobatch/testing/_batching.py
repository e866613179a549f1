"""Checks of an op under ``vmap``: its batching rule against a per-example loop, per-example gradients, a second thread.

The same contract as ``testing/_derivatives.py``: ``_check_<name>(case, exhaustive)``
passes, or raises ``_Skip`` / ``_Fail``.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ._case import (
    _BATCH,
    _Case,
    _compare,
    _Fail,
    _first_line,
    _forward_mode,
    _need_backward,
    _need_values,
    _Skip,
)


def _example(t: torch.Tensor, k: int) -> torch.Tensor:
    """The k-th example made from a sample tensor (values shrunk, so domains like |x| < 1 hold)."""
    if t.is_floating_point() or t.is_complex():
        return t * (1 - 0.15 * k)
    return t.clone()


def _vmap_configs(case: _Case) -> list[tuple[str, dict[int, int]]]:
    """(label, {leaf index: batch dim}) for the vmap checks: batched at 0, at the last dim, one at a time."""
    configs: list[tuple[str, dict[int, int]]] = [("all at dim 0", {i: 0 for i in case.tensors})]
    last = {i: case.leaves[i].dim() for i in case.tensors}
    if any(d > 0 for d in last.values()):
        configs.append(("all at their last dim", last))
    if len(case.tensors) > 1:
        for i in case.tensors:
            configs.append((f"only {case.names[i]} at dim 0", {i: 0}))
    return configs


def _batched_leaves(case: _Case, dims: dict[int, int]) -> tuple[list[Any], list[list[Any]]]:
    """The batched leaves (dims per leaf) and the per-example leaves."""
    examples = [list(case.leaves) for _ in range(_BATCH)]
    batched = list(case.leaves)
    for i, d in dims.items():
        xs = [_example(case.leaves[i], k) for k in range(_BATCH)]
        batched[i] = torch.stack(xs, dim=d)
        for k in range(_BATCH):
            examples[k][i] = xs[k]
    return batched, examples


def _stack_outputs(outs: list[Any]) -> Any:
    leaves = [tree_flatten(o)[0] for o in outs]
    spec = tree_flatten(outs[0])[1]
    stacked = []
    for j in range(len(leaves[0])):
        col = [lv[j] for lv in leaves]
        stacked.append(torch.stack(col) if isinstance(col[0], torch.Tensor) else col[0])
    return tree_unflatten(stacked, spec)


def _dims_label(case: _Case, dims: dict[int, int]) -> str:
    return ", ".join(f"{case.names[i]}={dims.get(i)}" for i in case.tensors)


def _check_vmap(case: _Case, exhaustive: bool) -> None:
    _need_values(case)
    if not case.tensors:
        raise _Skip("no tensor arguments to batch")
    rule = "the registered vmap rule" if case.op.vmap_rule else "the free batching rule"
    for label, dims in _vmap_configs(case):
        batched, examples = _batched_leaves(case, dims)
        in_dims = tuple(dims.get(i) for i in case.tensors)

        def flat(*ts: torch.Tensor, batched: list[Any] = batched) -> Any:
            leaves = list(batched)
            for i, t in zip(case.tensors, ts):
                leaves[i] = t
            return case.call(leaves)

        out_dims = tree_map(lambda o: 0 if isinstance(o, torch.Tensor) else None, case.out)
        try:
            got = torch.vmap(flat, in_dims=in_dims, out_dims=out_dims)(*[batched[i] for i in case.tensors])
        except NotImplementedError as e:
            raise _Skip(f"{rule} refuses to batch ({_first_line(e)})") from e
        except Exception as e:
            raise _Fail(
                f"vmap ({label}; in_dims {_dims_label(case, dims)}) through {rule} raised {_first_line(e)}"
            ) from e
        expected = _stack_outputs([case.call(ex) for ex in examples])
        gl, el = tree_flatten(got)[0], tree_flatten(expected)[0]
        try:
            _compare(gl, el, [f"output {i}" for i in range(len(el))], case.atol, case.rtol, "vmap")
        except _Fail as f:
            raise _Fail(
                f"vmap through {rule} vs a per-example loop, in_dims {_dims_label(case, dims)} ({label}): "
                f"{f.why.split(': ', 1)[1]}",
                argument=f"in_dims {_dims_label(case, dims)}",
                max_error=f.max_error,
            ) from None


def _grad_configs(case: _Case) -> list[tuple[str, list[bool]]]:
    configs = [("every input batched", [True] * len(case.diff))]
    if len(case.diff) > 1:
        configs.append((f"only {case.diff_names()[0]} batched", [True] + [False] * (len(case.diff) - 1)))
    return configs


def _compare_with_loop(case: _Case, got: list[Any], expected: list[Any], what: str, label: str) -> None:
    """``got`` (a transform's) against a loop of eager ``.backward()``; a failure says which and where."""
    try:
        _compare(got, expected, case.diff_names(), case.atol, case.rtol, what)
    except _Fail as f:
        raise _Fail(
            f"{what} ({label}) vs a loop of eager .backward(): {f.why.split(': ', 1)[1]}",
            argument=f.argument,
            max_error=f.max_error,
        ) from None


def _check_vmap_grad(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    from torch.func import grad, vmap

    argnums = tuple(range(len(case.diff)))
    for label, batched in _grad_configs(case):
        xs = [torch.stack([_example(p, k) for k in range(_BATCH)]) if b else p for p, b in zip(case.primals(), batched)]
        in_dims = tuple(0 if b else None for b in batched)
        got = vmap(grad(lambda *p: case.loss(case.floats_of(p)), argnums=argnums), in_dims=in_dims)(*xs)
        loop = [case.eager_vjp(primals=[x[k] if b else x for x, b in zip(xs, batched)]) for k in range(_BATCH)]
        expected = [torch.stack([loop[k][j] for k in range(_BATCH)]) for j in range(len(case.diff))]
        _compare_with_loop(case, list(got), expected, "vmap(grad)", label)


def _check_grad_vmap(case: _Case, exhaustive: bool) -> None:
    _need_backward(case)
    from torch.func import grad, vmap

    argnums = tuple(range(len(case.diff)))
    for label, batched in _grad_configs(case):
        xs = [torch.stack([_example(p, k) for k in range(_BATCH)]) if b else p for p, b in zip(case.primals(), batched)]
        in_dims = tuple(0 if b else None for b in batched)

        def total(*p: torch.Tensor, in_dims: tuple[Optional[int], ...] = in_dims) -> torch.Tensor:
            outs = vmap(lambda *q: case.floats_of(q), in_dims=in_dims)(*p)
            return sum(((o * u).sum() for o, u in zip(outs, case.u)), torch.zeros((), dtype=torch.float64))

        got = grad(total, argnums=argnums)(*xs)
        loop = [case.eager_vjp(primals=[x[k] if b else x for x, b in zip(xs, batched)]) for k in range(_BATCH)]
        expected = [
            torch.stack([loop[k][j] for k in range(_BATCH)]) if b else sum(loop[k][j] for k in range(_BATCH))
            for j, b in enumerate(batched)
        ]
        _compare_with_loop(case, list(got), expected, "grad(vmap)", label)


def _check_vmap_jvp(case: _Case, exhaustive: bool) -> None:
    _forward_mode(case)
    xs = [torch.stack([_example(p, k) for k in range(_BATCH)]) for p in case.primals()]
    vs = [torch.stack([v] * _BATCH) for v in case.v]
    got = torch.vmap(lambda p, t: torch.func.jvp(lambda *q: case.floats_of(q), tuple(p), tuple(t))[1])(xs, vs)
    loop = [case.eager_jvp(case.v, primals=[x[k] for x in xs]) for k in range(_BATCH)]
    expected = [torch.stack([loop[k][i] for k in range(_BATCH)]) for i in range(len(case.float_outs))]
    names = [f"output {i}" for i in range(len(expected))]
    _compare(list(got), expected, names, case.atol, case.rtol, "vmap(jvp) vs a loop of eager dual tensors")


def _check_second_thread(case: _Case, exhaustive: bool) -> None:
    _need_values(case)

    def answers() -> list[Any]:
        result: list[Any] = list(tree_flatten(case.call(case.leaves))[0])
        if case.op.has_backward and case.diff and case.float_outs:
            result += case.eager_vjp()
        if case.tensors:
            batched, _ = _batched_leaves(case, {i: 0 for i in case.tensors})

            def flat(*ts: torch.Tensor) -> Any:
                leaves = list(batched)
                for i, t in zip(case.tensors, ts):
                    leaves[i] = t
                return case.call(leaves)

            out_dims = tree_map(lambda o: 0 if isinstance(o, torch.Tensor) else None, case.out)
            try:
                result += tree_flatten(torch.vmap(flat, out_dims=out_dims)(*[batched[i] for i in case.tensors]))[0]
            except NotImplementedError:  # a rule that refuses to batch: the vmap check reports it
                pass
        return result

    expected = answers()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["got"] = answers()
        except BaseException as e:  # reported below
            box["error"] = e

    thread = threading.Thread(target=run, name="torch_autobatch.testing.check")
    thread.start()
    thread.join()
    if "error" in box:
        raise _Fail(f"on a second thread: {_first_line(box['error'])}")
    _compare(box["got"], expected, [f"result {i}" for i in range(len(expected))], 0, 0, "second thread vs main thread")
