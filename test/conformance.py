"""Conformance against PyTorch's operator database (``op_db``).

Every float32, autograd-capable OpInfo sample becomes a torch_autobatch op:
the sample's tensors (input, args, kwargs, list elements) are the op's
arguments, everything else is fixed, the outputs are the OpInfo's (after the
sample's ``output_process_fn_grad``) cloned, as a custom op must not alias.
Two variants:

- ``func``: the registered backward is **twice** the true VJP, computed in the
  backward with ``torch.func.vjp``: every reverse-mode result must be exactly
  2x the plain function's, so a path that silently uses the decomposition's
  derivative fails. Forward mode is derived from the function (no jvp
  registered).
- ``derived``: no torch.func in user code at all (no registered backward): the
  forward transforms only. A generic VJP needs torch.func or
  ``torch.autograd.grad`` on fresh leaves, and functorch forbids
  ``requires_grad_`` inside its transforms, so reverse mode is covered by
  ``func`` alone.

Each (sample, transform) pair is checked against the plain OpInfo function
under the same transform, and vmap results also against a per-example loop.
A pair where the plain function fails, disagrees with the loop, or (for a
mismatch, rerun up to 20 times) disagrees with itself, is torch's (``torch``),
not ours. Outcomes: ``pass``, ``torch``, ``skip`` (with a reason),
``error`` (ours raises where the plain function works) and ``mismatch`` (a
silent wrong result).

The sweep (every op, at most ``--max-samples`` samples per op, evenly
spaced; ``--max-samples 0`` for all ~14,000) writes
``docs/conformance.md``::

    python test/conformance.py --write docs/conformance.md

``test/test_conformance.py`` runs a fixed representative subset in CI.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
from oracles import vmap_loop
from torch.func import jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

import torch_autobatch

NS = "tab_conf"
B = 3
SCALE = 2  # the ``func`` variant's backward is SCALE x the true VJP
JAC_MAX_NUMEL = 64  # jacrev/jacfwd only on samples this small (inputs and outputs)
RTOL, ATOL = 1e-4, 1e-4
RANDOMNESS = ("error", "same", "different")
VARIANTS = ("func", "derived")
TRANSFORMS = {
    "func": ("eager", "vmap", "vmap_first", "vjp", "jvp", "vmap_vjp", "vmap_jvp", "jvp_vjp", "jacrev", "jacfwd"),
    "derived": ("eager", "vmap", "vmap_first", "jvp", "vmap_jvp", "jacfwd"),
}
# Forward transforms whose result is the plain function's; reverse-mode ones
# (through the registered backward) are SCALE x the plain function's.
SCALED = {"vjp", "vmap_vjp", "jvp_vjp", "jacrev"}
# Transforms that run the ``func`` variant's backward (which recomputes the
# function) under vmap: where torch cannot vmap the function, that is torch's.
RECOMPUTES_UNDER_VMAP = {"vmap_vjp", "jacrev"}
FORWARD_MODE = {"jvp", "vmap_jvp", "jvp_vjp", "jacfwd"}


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


class NotApplicable(Exception):
    """The pair does not apply to this sample (reason in the message)."""


class PlainFails(Exception):
    """The plain OpInfo function fails on this sample: torch's, not ours."""


@dataclasses.dataclass
class Result:
    op: str
    sample: int
    variant: str
    transform: str
    status: str  # pass | torch | skip | error | mismatch
    detail: str = ""


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _is_float(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _sanitize(name: str) -> str:
    return re.sub(r"\W", "_", name)


class Case:
    """One OpInfo sample as a plain function of its tensors, and as our op."""

    def __init__(self, opinfo: Any, sample: Any, index: int, variant: str) -> None:
        self.opinfo, self.index, self.variant = opinfo, index, variant
        leaves, self._spec = tree_flatten((sample.input, sample.args, sample.kwargs))
        self._leaves = leaves
        self._slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        if not self._slots:
            raise NotApplicable("no tensor argument")
        self._process = sample.output_process_fn_grad
        self.inputs = tuple(leaves[i].detach() for i in self._slots)
        try:
            outs = self.plain(*self.inputs)
        except NotApplicable:
            raise
        except Exception as e:  # noqa: BLE001
            raise PlainFails(f"plain fails: {_first_line(e)}") from e
        self.num_outputs = len(outs)
        self.diff_in = [i for i, t in enumerate(self.inputs) if _is_float(t)]
        self.diff_out = [j for j, t in enumerate(outs) if _is_float(t)]
        self.numel_in = sum(self.inputs[i].numel() for i in self.diff_in)
        self.numel_out = sum(outs[j].numel() for j in self.diff_out)
        self.op = self._define()

    # -- the plain function and our op ---------------------------------------
    def plain(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(self._leaves)
        for slot, t in zip(self._slots, tensors):
            leaves[slot] = t
        inp, args, kwargs = tree_unflatten(leaves, self._spec)
        out = self._process(self.opinfo.op(inp, *args, **kwargs))
        flat, _ = tree_flatten(out)
        if not flat or not all(isinstance(o, torch.Tensor) for o in flat):
            raise NotApplicable("returns a non-tensor")
        return tuple(flat)

    def _define(self) -> Callable[..., Any]:
        n, k = len(self.inputs), self.num_outputs
        case = self

        def fn(*tensors: torch.Tensor) -> Any:
            outs = tuple(o.clone() for o in case.plain(*tensors))
            return outs if k > 1 else outs[0]

        params = [
            inspect.Parameter(f"a{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=torch.Tensor)
            for i in range(n)
        ]
        ret = tuple[(torch.Tensor,) * k] if k > 1 else torch.Tensor
        fn.__signature__ = inspect.Signature(params, return_annotation=ret)  # type: ignore[attr-defined]
        name = f"{_sanitize(self.opinfo.name)}_{_sanitize(self.opinfo.variant_test_name)}_{self.index}_{self.variant}"
        fn.__name__ = name
        op = torch_autobatch.custom_op(f"{NS}::{name}", fn, mutates_args=())
        if self.variant == "func":
            op.register_autograd(self._backward, setup_context=_save_inputs)
        return op

    def _backward(self, ctx: Any, *grads: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
        xs = ctx.saved_tensors
        g = self.differentiable(self.plain, xs)
        _, pullback = vjp(g, *[xs[i] for i in self.diff_in])
        cts = tuple(grads[j] for j in self.diff_out)
        result: list[Optional[torch.Tensor]] = [None] * len(xs)
        for i, gi in zip(self.diff_in, pullback(cts)):
            # gi + gi, not 2.0 * gi: forward AD of a Python scalar times a 0-dim
            # tensor gives a float64 tangent under functorch (torch's bug).
            result[i] = gi + gi
        return tuple(result)

    def differentiable(self, f: Callable[..., Any], xs: Sequence[torch.Tensor]) -> Callable[..., Any]:
        """``f`` as a function of the floating inputs only, giving the floating outputs."""

        def g(*d: torch.Tensor) -> tuple[torch.Tensor, ...]:
            full = list(xs)
            for i, v in zip(self.diff_in, d):
                full[i] = v
            outs = f(*full)
            outs = outs if isinstance(outs, tuple) else (outs,)
            return tuple(outs[j] for j in self.diff_out)

        return g

    def ours(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.op(*tensors)
        return out if isinstance(out, tuple) else (out,)


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


# -- inputs for the transforms ------------------------------------------------
def _batched(t: torch.Tensor) -> torch.Tensor:
    """B distinct examples: t, 0.9 t, 0.8 t for floating tensors, copies otherwise."""
    if t.layout != torch.strided:
        raise NotApplicable(f"{t.layout} input: torch.stack cannot make a batch of it")
    if _is_float(t) and t.layout == torch.strided:
        return torch.stack([t * (1 - 0.1 * k) for k in range(B)])
    return torch.stack([t] * B)


def _like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen, dtype=t.dtype)


def _assert_close(actual: Any, expected: Any, what: str) -> None:
    a, _ = tree_flatten(actual)
    e, _ = tree_flatten(expected)
    if len(a) != len(e):
        raise AssertionError(f"{what}: {len(a)} results, expected {len(e)}")
    for x, y in zip(a, e):
        if isinstance(x, torch.Tensor) and x.layout != torch.strided:
            x = x.to_dense()
        if isinstance(y, torch.Tensor) and y.layout != torch.strided:
            y = y.to_dense()
        torch.testing.assert_close(x, y, rtol=RTOL, atol=ATOL, equal_nan=True, msg=lambda m: f"{what}: {m}")


def _scaled(tree: Any) -> Any:
    return tree_map(lambda t: SCALE * t if isinstance(t, torch.Tensor) else t, tree)


class Runner:
    """Runs one transform on our op and on the plain function."""

    def __init__(self, case: Case) -> None:
        self.case = case
        gen = torch.Generator().manual_seed(1234 + case.index)
        xs = case.inputs
        self.diff_xs = tuple(xs[i] for i in case.diff_in)
        self.tangents = tuple(_like(t, gen) for t in self.diff_xs)
        outs = case.plain(*xs)
        self.cotangents = tuple(_like(outs[j], gen) for j in case.diff_out)

    @functools.cached_property
    def plain_vmap_error(self) -> Optional[str]:
        """How vmap of the plain function fails on this sample, if it does."""
        try:
            _seeded(lambda: vmap(self.case.plain)(*self.batched))
        except Exception as e:  # noqa: BLE001
            return _first_line(e)
        return None

    @functools.cached_property
    def plain_jvp_error(self) -> Optional[str]:
        """How torch.func.jvp of the plain function fails on this sample, if it does."""
        try:
            _seeded(lambda: self.run("jvp", self.case.plain))
        except NotApplicable:
            return None
        except Exception as e:  # noqa: BLE001
            return _first_line(e)
        return None

    @functools.cached_property
    def batched(self) -> tuple[torch.Tensor, ...]:
        return tuple(_batched(t) for t in self.case.inputs)

    @functools.cached_property
    def batched_tangents(self) -> tuple[torch.Tensor, ...]:
        return tuple(_batched(t) for t in self.tangents)

    @functools.cached_property
    def batched_cts(self) -> tuple[torch.Tensor, ...]:
        return tuple(_batched(t) for t in self.cotangents)

    def run(self, transform: str, f: Callable[..., Any]) -> Any:
        """``transform`` applied to ``f`` (the plain function or our op) on this sample."""
        case, xs = self.case, self.case.inputs
        needs_ad = transform not in ("eager", "vmap", "vmap_first")
        if needs_ad and (not case.diff_in or not case.diff_out):
            raise NotApplicable("no floating input or output")
        if transform == "jacfwd" and any(t.layout in _COMPRESSED for t in self.diff_xs):
            # NOTE [jacfwd of a sparse compressed input]: jacfwd's standard
            # basis is new_zeros of each input. For a CSR/CSC/BSR/BSC input
            # torch builds it from new_empty and, with sparse invariant checks
            # on (torch's TestCase turns them on), validates indices it never
            # initialised: a random error, or a segfault (a CI run crashed
            # there). The plain function fails there anyway (diagonal of it).
            raise NotApplicable("sparse compressed input: jacfwd's basis (new_zeros) reads uninitialised indices")
        if transform in ("jacrev", "jacfwd") and max(case.numel_in, case.numel_out) > JAC_MAX_NUMEL:
            raise NotApplicable(f"larger than {JAC_MAX_NUMEL} elements")
        g = case.differentiable(f, xs)
        if transform == "eager":
            return f(*xs)
        if transform == "vmap":
            return vmap(f)(*self.batched)
        if transform == "vmap_first":
            in_dims = (0,) + (None,) * (len(xs) - 1)
            return vmap(f, in_dims=in_dims)(self.batched[0], *xs[1:])
        if transform == "vjp":
            return vjp(g, *self.diff_xs)[1](self.cotangents)
        if transform == "jvp":
            return jvp(g, self.diff_xs, self.tangents)
        if transform == "vmap_vjp":
            return vmap(lambda d, ct: vjp(case.differentiable(f, xs), *d)[1](ct))(
                tuple(self.batched[i] for i in case.diff_in), self.batched_cts
            )
        if transform == "vmap_jvp":
            return vmap(lambda d, t: jvp(case.differentiable(f, xs), d, t))(
                tuple(self.batched[i] for i in case.diff_in), self.batched_tangents
            )
        if transform == "jvp_vjp":
            return jvp(lambda *d: vjp(g, *d)[1](self.cotangents), self.diff_xs, self.tangents)
        if transform == "jacrev":
            return jacrev(g, argnums=tuple(range(len(self.diff_xs))))(*self.diff_xs)
        if transform == "jacfwd":
            return jacfwd(g, argnums=tuple(range(len(self.diff_xs))))(*self.diff_xs)
        raise ValueError(transform)

    def loop(self, transform: str, f: Callable[..., Any]) -> Any:
        """The per-example loop that a vmap transform must equal: ``run``'s function, looped."""
        case, xs = self.case, self.case.inputs
        if transform == "vmap":
            return vmap_loop(f, 0, *self.batched)
        if transform == "vmap_first":
            return vmap_loop(f, (0,) + (None,) * (len(xs) - 1), self.batched[0], *xs[1:])
        diff = tuple(self.batched[i] for i in case.diff_in)
        if transform == "vmap_vjp":
            return vmap_loop(lambda d, ct: vjp(case.differentiable(f, xs), *d)[1](ct), 0, diff, self.batched_cts)
        if transform == "vmap_jvp":
            return vmap_loop(lambda d, t: jvp(case.differentiable(f, xs), d, t), 0, diff, self.batched_tangents)
        raise ValueError(transform)


def _seeded(fn: Callable[[], Any], seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return fn()


def classify_randomness(case: Case) -> str:
    """'deterministic', 'random' (values follow the seed) or 'nondeterministic' (e.g. empty)."""
    """'deterministic', 'random' (draws random numbers: its values follow the
    seed, or it draws without using them, e.g. dropout with p=0) or
    'nondeterministic' (e.g. empty)."""
    run = lambda seed: _seeded(lambda: case.plain(*case.inputs), seed)  # noqa: E731
    first = run(0)
    if not _same(first, run(0)):
        return "nondeterministic"
    torch.manual_seed(1)
    before = torch.get_rng_state()
    second = case.plain(*case.inputs)
    draws = not torch.equal(before, torch.get_rng_state())
    return "random" if draws or not _same(first, second) else "deterministic"


def _same(x: Sequence[torch.Tensor], y: Sequence[torch.Tensor]) -> bool:
    def equal(p: torch.Tensor, q: torch.Tensor) -> bool:
        p, q = (t.to_dense() if t.layout != torch.strided else t for t in (p, q))
        try:
            torch.testing.assert_close(p, q, rtol=0, atol=0, equal_nan=True)
        except AssertionError:
            return False
        return True

    return all(equal(p, q) for p, q in zip(x, y))


def check_pair(runner: Runner, transform: str, kind: str, randomness: str = "error") -> Result:
    """One (sample, transform) pair: ours against the plain function (and its loop)."""
    case = runner.case
    name = f"{transform}[{randomness}]" if kind == "random" and transform == "vmap" else transform

    def res(status: str, detail: str = "") -> Result:
        return Result(op_key(case.opinfo), case.index, case.variant, name, status, detail)

    def under(f: Callable[..., Any]) -> Any:
        if kind == "random" and transform == "vmap":
            return _seeded(lambda: vmap(f, randomness=randomness)(*runner.batched))
        return _seeded(lambda: runner.run(transform, f))

    scale = _scaled if transform in SCALED else (lambda tree: tree)
    try:
        plain = under(case.plain)
    except NotApplicable as e:
        return res("skip", str(e))
    except Exception as e:  # noqa: BLE001  (torch's own failure)
        try:
            under(case.ours)
        except Exception as ours:  # noqa: BLE001
            same = _first_line(ours) == _first_line(e)
            return res("torch", f"plain fails{'' if same else ' (ours differently)'}: {_first_line(e)}")
        return res("torch", f"plain fails, ours works: {_first_line(e)}")
    expected = scale(plain)
    if transform.startswith("vmap") and kind == "deterministic":
        try:
            _assert_close(plain, runner.loop(transform, case.plain), "plain vs loop")
        except Exception as e:  # noqa: BLE001
            return res("torch", f"plain disagrees with its loop: {_first_line(e)}")
    try:
        actual = under(case.ours)
    except Exception as e:  # noqa: BLE001
        if transform in RECOMPUTES_UNDER_VMAP and case.variant == "func" and runner.plain_vmap_error:
            return res(
                "torch",
                "the harness's backward recomputes the function under vmap, where "
                f"torch fails: {runner.plain_vmap_error}",
            )
        if transform in FORWARD_MODE and runner.plain_jvp_error == _first_line(e):
            # Derived forward mode is torch's forward AD of the function, which
            # fails on this sample (sdpa picks its flash kernel when no input
            # requires grad); the plain function escapes only where a grad
            # level above it makes sdpa pick another kernel (jvp(vjp)).
            return res(
                "torch", f"derived forward mode is torch's jvp of the function, which fails: {runner.plain_jvp_error}"
            )
        return res("error", _first_line(e))
    if kind == "nondeterministic":
        a, _ = tree_flatten(actual)
        e, _ = tree_flatten(expected)
        ok = len(a) == len(e) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, e))
        return res("pass" if ok else "mismatch", "shapes and dtypes only (uninitialized values)")
    try:
        _assert_close(actual, expected, "ours vs plain")
    except AssertionError as e:
        # Checked again: where the plain function disagrees with itself
        # (max_unpool with duplicate indices), the pair is torch's.
        for _ in range(20):
            try:
                _assert_close(under(case.plain), plain, "plain vs plain")
            except AssertionError:
                return res("torch", f"the plain function is nondeterministic here: {_first_line(e)}")
        return res("mismatch", _first_line(e))
    return res("pass")


def check_case(case: Case) -> list[Result]:
    kind = classify_randomness(case)
    runner = Runner(case)
    results = []
    for transform in TRANSFORMS[case.variant]:
        if kind == "random" and transform == "vmap":
            results.extend(check_pair(runner, transform, kind, r) for r in RANDOMNESS)
            continue
        if kind == "random" and transform not in ("eager", "jvp"):
            results.append(
                Result(
                    op_key(case.opinfo),
                    case.index,
                    case.variant,
                    transform,
                    "skip",
                    "random op: checked by eager, jvp and vmap under each randomness",
                )
            )
            continue
        results.append(check_pair(runner, transform, kind))
    return results


# -- the sweep -------------------------------------------------------------------
def conformance_ops() -> list[Any]:
    from torch.testing._internal.common_methods_invocations import op_db

    return [o for o in op_db if o.supports_autograd and torch.float32 in o.supported_dtypes("cpu")]


def op_key(opinfo: Any) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def check_op(opinfo: Any, max_samples: Optional[int], variants: Sequence[str] = VARIANTS) -> list[Result]:
    key = op_key(opinfo)
    results: list[Result] = []
    torch.manual_seed(0)
    try:
        samples = _spread(list(opinfo.sample_inputs("cpu", torch.float32)), max_samples)
    except Exception as e:  # noqa: BLE001
        return [Result(key, -1, "-", "samples", "skip", f"sample_inputs fails: {_first_line(e)}")]
    for index, sample in enumerate(samples):
        for variant in variants:
            try:
                case = Case(opinfo, sample, index, variant)
            except NotApplicable as e:
                results.append(Result(key, index, variant, "define", "skip", str(e)))
                continue
            except PlainFails as e:
                results.append(Result(key, index, variant, "define", "torch", str(e)))
                continue
            except Exception as e:  # noqa: BLE001
                results.append(Result(key, index, variant, "define", "error", _first_line(e)))
                continue
            results.extend(check_case(case))
    return results


def _spread(samples: list[Any], most: Optional[int]) -> list[Any]:
    """At most ``most`` samples, evenly spaced over all of them (the first and the last kept)."""
    if most is None or len(samples) <= most:
        return samples
    if most == 1:
        return samples[:1]
    step = (len(samples) - 1) / (most - 1)
    return [samples[round(k * step)] for k in range(most)]


def _worker(names: Sequence[str], max_samples: Optional[int], out: str) -> None:
    """Checks the named ops, appending one JSON line per result (and a start marker per op)."""
    warnings.filterwarnings("ignore")
    by_name = {op_key(o): o for o in conformance_ops()}
    with open(out, "a") as f:
        for name in names:
            f.write(json.dumps({"start": name}) + "\n")
            f.flush()
            for r in check_op(by_name[name], max_samples):
                f.write(json.dumps(dataclasses.asdict(r)) + "\n")
            f.flush()


def sweep(names: Sequence[str], max_samples: Optional[int], jobs: int, out: str, progress: bool = True) -> list[Result]:
    """Runs the ops in ``jobs`` worker processes; an op that crashes its worker is a result too."""
    chunks = [list(names[i::jobs]) for i in range(jobs)]
    files = [f"{out}.{i}" for i in range(jobs)]
    for path in files:
        if os.path.exists(path):
            os.remove(path)
    pending = {i: chunk for i, chunk in enumerate(chunks) if chunk}
    procs: dict[int, subprocess.Popen] = {}
    crashed: list[Result] = []

    def launch(i: int, todo: list[str]) -> None:
        cmd = [sys.executable, __file__, "--worker", files[i], "--max-samples", str(max_samples or 0), "--ops", *todo]
        procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    for i, chunk in pending.items():
        launch(i, chunk)
    t0 = time.time()
    while procs:
        time.sleep(1.0)
        for i, p in list(procs.items()):
            if p.poll() is None:
                continue
            del procs[i]
            done = _started(files[i])
            if p.returncode != 0:
                last = done[-1] if done else pending[i][0]
                stderr = (p.stderr.read().decode(errors="replace") if p.stderr else "").strip().splitlines()
                crashed.append(
                    Result(
                        last,
                        -1,
                        "-",
                        "process",
                        "error",
                        f"worker died (rc {p.returncode}): {stderr[-1] if stderr else ''}"[:300],
                    )
                )
                rest = pending[i][pending[i].index(last) + 1 :]
                if rest:
                    pending[i] = rest
                    launch(i, rest)
        if progress:
            n = sum(len(_started(f)) for f in files)
            print(f"\r{n}/{len(names)} ops, {time.time() - t0:.0f} s", end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    results = list(crashed)
    for path in files:
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    d = json.loads(line)
                    if "start" not in d:
                        results.append(Result(**d))
            os.remove(path)
    return results


def _started(path: str) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["start"] for line in f if line.startswith('{"start"')]


# -- the report ------------------------------------------------------------------
def summarize(results: Sequence[Result]) -> dict[str, int]:
    counts = collections.Counter(r.status for r in results)
    return {s: counts.get(s, 0) for s in ("pass", "torch", "skip", "error", "mismatch")}


def write_markdown(results: Sequence[Result], path: str, meta: dict[str, Any]) -> None:
    by_op: dict[str, list[Result]] = collections.defaultdict(list)
    for r in results:
        by_op[r.op].append(r)
    c = summarize(results)
    judged = c["pass"] + c["error"] + c["mismatch"]
    samples = len({(r.op, r.sample) for r in results if r.sample >= 0})
    pct = 100.0 * c["pass"] / judged if judged else 100.0
    lines = [
        "# Conformance with PyTorch's operator database",
        "",
        f"Generated by `{meta['command']}` on {meta['date']} ({meta['machine']}; torch {torch.__version__}, "
        f"torch_autobatch {torch_autobatch.__version__}, {meta['seconds']:.0f} s). "
        "How each pair is built and judged: the docstring of `test/conformance.py`.",
        "",
        f"**Summary: {len(by_op)} ops, {samples} samples ({meta['max_samples']}), "
        f"{len(results)} pairs; {c['pass']} pass = {pct:.2f}% of the {judged} pairs where the plain function works; "
        f"{c['error']} errors, {c['mismatch']} silent mismatches; {c['torch']} pairs fail or disagree in torch itself "
        f"(plain function), {c['skip']} not applicable.**",
        "",
    ]
    reasons = collections.Counter(_torch_reason(r.detail) for r in results if r.status == "torch")
    lines += [
        "Pairs that are torch's (the plain function fails there, or is not reproducible):",
        "",
        "| reason | pairs |",
        "|---|---:|",
    ]
    lines += [f"| {reason} | {n} |" for reason, n in reasons.most_common()]
    lines.append("")
    lines += [
        "Where both fail with another first line, both are functorch refusing the same code: under "
        "`vmap(jvp)` or `vmap(vjp)` the plain function meets the ops its AD level decomposed "
        "(`rrelu_with_noise` for `rrelu`, a data-dependent check instead of `.item()`), and where "
        "the plain function fails in its own derivative formula (batch norm's running stats), the "
        "harness's backward fails in the vjp it computes. op_db seeds its random ops inside the "
        "call (`wrapper_set_seed`), so the sweep sees them as deterministic; random streams "
        '(`randomness="same"`/`"different"` values, derived tangents drawing the primal\'s '
        "mask) are checked in `test/test_nested_transforms.py` and `test/test_forward_mode.py`.",
        "",
    ]
    skips = collections.Counter(r.detail for r in results if r.status == "skip")
    lines += ["Pairs that do not apply:", "", "| reason | pairs |", "|---|---:|"]
    lines += [f"| {_md(reason)} | {n} |" for reason, n in skips.most_common()]
    lines.append("")
    bad = [r for r in results if r.status in ("error", "mismatch")]
    if bad:
        lines += [
            "## Errors and mismatches",
            "",
            "| op | sample | variant | transform | status | detail |",
            "|---|---:|---|---|---|---|",
        ]
        lines += [f"| {r.op} | {r.sample} | {r.variant} | {r.transform} | {r.status} | {_md(r.detail)} |" for r in bad]
        lines.append("")
    lines += [
        "## Per op",
        "",
        "Counts of (sample, transform) pairs. `torch`: the plain function itself fails there (first reason shown).",
        "",
        "| op | samples | pass | torch | skip | error | mismatch | torch's first reason |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for op in sorted(by_op):
        rs = by_op[op]
        oc = summarize(rs)
        reason = next((r.detail for r in rs if r.status == "torch"), "")
        n = len({r.sample for r in rs if r.sample >= 0})
        lines.append(
            f"| {op} | {n} | {oc['pass']} | {oc['torch']} | {oc['skip']} | {oc['error']} | {oc['mismatch']} | {_md(reason[:120])} |"
        )
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def _torch_reason(detail: str) -> str:
    """The class of a ``torch`` result, for the report."""
    for prefix, reason in (
        ("plain fails (ours differently)", "the plain function fails; ours fails with another first line"),
        ("plain fails, ours works", "the plain function fails; ours works"),
        ("plain fails", "the plain function fails; ours fails the same way"),
        ("plain disagrees", "the plain function under vmap disagrees with its own per-example loop"),
        ("the plain function is nondeterministic", "the plain function disagrees with itself on reruns"),
        (
            "the harness's backward",
            "the harness's backward recomputes the function under vmap, which torch cannot batch",
        ),
        ("derived forward mode", "torch's jvp of the function fails (derived forward mode)"),
    ):
        if detail.startswith(prefix):
            return reason
    return detail


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", nargs="*", help="op names (name or name.variant); default: all")
    p.add_argument("--max-samples", type=int, default=10, help="samples per op, evenly spaced (0: all)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--write", metavar="MD", help="write the report here (e.g. docs/conformance.md)")
    p.add_argument("--json", metavar="FILE", help="write every result as JSON here")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    max_samples = args.max_samples or None
    if args.worker:
        _worker(args.ops, max_samples, args.worker)
        return 0
    names = args.ops or [op_key(o) for o in conformance_ops()]
    t0 = time.time()
    out = os.path.join(os.path.dirname(os.path.abspath(args.write or __file__)), ".conformance")
    results = sweep(names, max_samples, args.jobs, out)
    c = summarize(results)
    print(json.dumps(c))
    for r in results:
        if r.status in ("error", "mismatch"):
            print(f"{r.status}: {r.op}[{r.sample}] {r.variant} {r.transform}: {r.detail}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dataclasses.asdict(r) for r in results], f, indent=0)
    if args.write:
        cmd = "python test/conformance.py"
        if args.max_samples != 10:
            cmd += f" --max-samples {args.max_samples}"
        cmd += f" --write {args.write}"
        meta = dict(
            command=cmd,
            date=time.strftime("%Y-%m-%d"),
            machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads",
            seconds=time.time() - t0,
            max_samples=f"at most {args.max_samples} per op, evenly spread" if args.max_samples else "all of them",
        )
        write_markdown(results, args.write, meta)
    return 1 if c["error"] or c["mismatch"] else 0


if __name__ == "__main__":
    sys.exit(main())
