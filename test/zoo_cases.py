"""The zoo (issue 47): real PyPI libraries' ``autograd.Function`` classes, lifted whole.

Each :class:`Case` is one ``autograd.Function`` class of a library from PyPI,
reached through the library's **public** API (a module, a distribution's
``rsample``, an ODE solver), never through ``Cls.apply`` itself. A cell is one
case under one transform (:data:`TRANSFORMS`): :func:`run_cell` lifts the class
in place (``torch_autobatch.autobatch(Cls)``, undone after), runs the transform
on the public call, and compares with a reference made from the **unlifted**
class, eagerly (NOTE in the docstring of :func:`reference`). It also runs the
transform on the unlifted class, to know what a user had before
(``never worse than unlifted``).

A cell's status:

- ``PASS``: the value matches the reference;
- ``CLEAR``: an error whose message names the class (or the lifted op), so the
  user learns what refused and why (the table quotes it);
- ``UNCLEAR``: an error that names neither;
- ``WRONG``: a value that differs from the reference;
- ``N/A``: the library's own code around the class cannot run under the
  transform (its reason is given by the case; the test checks the error);
- ``NO-REF``: the unlifted reference itself cannot be computed.

A failing status is ``WORSE`` as well when the unlifted class passes there.

``python test/test_zoo.py --table`` prints the table of docs/zoo.md.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.utils._pytree import tree_flatten

DT = torch.float64
B = 3  # examples under vmap

TRANSFORMS = ("backward", "grad", "vjp", "jacrev", "vmap", "vmap_grad", "hessian", "jvp", "jacfwd", "compile_grad")
TRANSFORM_TITLES = {
    "backward": "`.backward()`",
    "grad": "`grad`",
    "vjp": "`vjp`",
    "jacrev": "`jacrev`",
    "vmap": "`vmap`",
    "vmap_grad": "`vmap(grad)`",
    "hessian": "`hessian`",
    "jvp": "`jvp`",
    "jacfwd": "`jacfwd`",
    "compile_grad": "`compile(grad)`",
}

PASS, CLEAR, UNCLEAR, WRONG, NA, NOREF = "PASS", "CLEAR", "UNCLEAR", "WRONG", "N/A", "NO-REF"


@dataclass(frozen=True)
class Expected:
    """A cell judged impossible: the error it must raise (``regex``, searched in ``Type: message``) and why.

    ``open``: not impossible, only not done yet: the package gives this clear error today, and the table
    counts it apart (the test pins it, so a change to it shows).
    """

    regex: str
    reason: str
    open: bool = False


@dataclass(frozen=True)
class ReferenceDiffers:
    """A cell whose reference does not apply: the library's own code gives forward and reverse mode different values.

    ``patch()``: a context manager under which the library's code gives both the same value; the cell is run
    (reference and ours) under it and must PASS there, and is counted as having no reference.
    """

    reason: str
    patch: Callable[[], Any]


@dataclass(frozen=True)
class Case:
    """One Function class of one library, reached through the library's public API."""

    name: str  # the row's name
    lib: str  # the PyPI distribution (pip install --no-deps <lib>)
    module: str  # what to import (pytest.importorskip)
    classes: tuple[str, ...]  # dotted paths of the Function classes the call reaches, lifted together
    call: str  # the public call, as the table shows it
    setup: Callable[[], Callable[..., torch.Tensor]]  # builds the public call f(*args) -> one tensor
    sample: Callable[[], tuple[Any, ...]]  # one example's arguments (seeded by the caller)
    argnums: tuple[int, ...] = (0,)  # the differentiable arguments
    in_dims: Optional[tuple[Any, ...]] = None  # vmap: 0 for argnums[0], None for the rest, unless given
    hessian_ref: str = "fd"  # "fd": finite differences of the unlifted gradient; "double_backward": its autograd
    random: bool = False  # the call draws random numbers: every call is seeded, vmap uses randomness="same"
    expected: dict[str, Expected] = field(default_factory=dict)  # cells judged impossible: a clear error
    library_na: dict[str, Expected] = field(default_factory=dict)  # cells the library's own code cannot run
    reference_differs: dict[str, ReferenceDiffers] = field(default_factory=dict)  # no reference (see the class)
    rtol: float = 1e-7
    atol: float = 1e-9
    fd_eps: float = 1e-6

    @property
    def dims(self) -> tuple[Any, ...]:
        if self.in_dims is not None:
            return self.in_dims
        n = len(_sample(self, 0))
        return tuple(0 if i == self.argnums[0] else None for i in range(n))


@dataclass
class Outcome:
    status: str
    message: str = ""
    seconds: float = 0.0

    def short(self, width: int = 160) -> str:
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return first if len(first) <= width else first[: width - 3] + "..."


# ----------------------------------------------------------------- helpers
def resolve(path: str) -> Any:
    """``pkg.mod.Cls.Inner`` -> the object (the longest importable module prefix, then attributes)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def classes_of(case: Case) -> tuple[type, ...]:
    return tuple(resolve(p) for p in case.classes)


@contextlib.contextmanager
def lifted_in_place(*classes: type) -> Iterator[None]:
    # test_lift's helper, imported late: test_lift imports numpy and builds its own cases at import
    from test_lift import lifted_in_place as lift

    with lift(*classes):
        yield


def _seeded(case: Case, f: Callable[..., Any]) -> Callable[..., Any]:
    if not case.random:
        return f

    def g(*args: Any) -> Any:
        torch.manual_seed(1234)
        return f(*args)

    return g


_SETUPS: dict[str, Callable[..., Any]] = {}


def _f(case: Case) -> Callable[..., torch.Tensor]:
    if case.name not in _SETUPS:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            _SETUPS[case.name] = case.setup()
    return _seeded(case, _SETUPS[case.name])


def _sample(case: Case, i: int) -> tuple[Any, ...]:
    with torch.random.fork_rng():
        torch.manual_seed(100 + i)
        return case.sample()


def _batched(case: Case) -> tuple[Any, ...]:
    examples = [_sample(case, i) for i in range(B)]
    return tuple(
        torch.stack([ex[j] for ex in examples], d) if d is not None else examples[0][j] for j, d in enumerate(case.dims)
    )


def _example(case: Case, batched: tuple[Any, ...], b: int) -> tuple[Any, ...]:
    return tuple(a.select(d, b) if d is not None else a for a, d in zip(batched, case.dims))


_WEIGHTS: dict[str, torch.Tensor] = {}


def _weights(case: Case) -> torch.Tensor:
    """The loss's weights, of the output's shape (made once, by the unlifted class)."""
    if case.name not in _WEIGHTS:
        with torch.random.fork_rng():
            out = _f(case)(*_sample(case, 0))
            torch.manual_seed(7)
            _WEIGHTS[case.name] = torch.randn(out.shape, dtype=out.dtype)
    return _WEIGHTS[case.name]


def _tangents(case: Case, args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    with torch.random.fork_rng():
        torch.manual_seed(8)
        return tuple(torch.randn_like(args[i]) for i in case.argnums)


def _with(args: tuple[Any, ...], argnums: tuple[int, ...], values: tuple[Any, ...]) -> tuple[Any, ...]:
    out = list(args)
    for i, v in zip(argnums, values):
        out[i] = v
    return tuple(out)


def _loss(f: Callable[..., torch.Tensor], w: torch.Tensor) -> Callable[..., torch.Tensor]:
    """sum(w * out) + sum(out^2) / 2: linear in out would leave a linear forward's hessian 0."""

    def loss(*args: Any) -> torch.Tensor:
        out = f(*args)
        return (w * out).sum() + 0.5 * (out * out).sum()

    return loss


def _eager_grads(fn: Callable[..., torch.Tensor], args: tuple[Any, ...], argnums: tuple[int, ...], cot: Any = None):
    leaves = tuple(args[i].detach().clone().requires_grad_() for i in argnums)
    out = fn(*_with(args, argnums, leaves))
    gs = torch.autograd.grad(out, leaves, cot, allow_unused=True)
    return tuple(torch.zeros_like(leaf) if g is None else g for leaf, g in zip(leaves, gs))


def _eager_jacobian(case: Case, f: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    """d out / d arg for each differentiable argument, one row at a time by the unlifted class's .backward()."""
    leaves = tuple(args[i].detach().clone().requires_grad_() for i in case.argnums)
    out = f(*_with(args, case.argnums, leaves))
    flat = out.reshape(-1)
    rows: list[list[torch.Tensor]] = [[] for _ in leaves]
    for k in range(flat.numel()):
        if case.random:  # each row's backward draws what the transform's one backward draws
            torch.manual_seed(1234)
        gs = torch.autograd.grad(flat[k], leaves, retain_graph=True, allow_unused=True)
        for j, (leaf, g) in enumerate(zip(leaves, gs)):
            rows[j].append(torch.zeros_like(leaf) if g is None else g)
    return tuple(torch.stack(r).reshape(*out.shape, *leaf.shape) for r, leaf in zip(rows, leaves))


def _fd_hessian(case: Case, loss: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    """Central finite differences of the unlifted class's eager gradient w.r.t. the first differentiable argument."""
    a0 = case.argnums[0]
    x = args[a0]
    cols = []
    for k in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=x.dtype)
        e[k] = case.fd_eps
        e = e.reshape(x.shape)
        gp = _eager_grads(loss, _with(args, (a0,), (x + e,)), (a0,))[0]
        gm = _eager_grads(loss, _with(args, (a0,), (x - e,)), (a0,))[0]
        cols.append((gp - gm) / (2 * case.fd_eps))
    return torch.stack(cols, -1).reshape(*x.shape, *x.shape)


def _double_backward_hessian(case: Case, loss: Callable[..., torch.Tensor], args: tuple[Any, ...]) -> torch.Tensor:
    """The unlifted class's eager second derivative: its backward differentiated by autograd (create_graph)."""
    a0 = case.argnums[0]
    leaf = args[a0].detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(loss(*_with(args, (a0,), (leaf,))), leaf, create_graph=True)
    rows = []
    for k in range(g.numel()):
        (h,) = torch.autograd.grad(g.reshape(-1)[k], leaf, retain_graph=True, allow_unused=True)
        rows.append(torch.zeros_like(leaf) if h is None else h)
    return torch.stack(rows).reshape(*leaf.shape, *leaf.shape)


# -------------------------------------------------------------- transforms
def _run(case: Case, transform: str) -> Any:
    """The transform on the public call, as a user would write it (whatever Cls.apply is now)."""
    f = _f(case)
    args = _sample(case, 0)
    w = _weights(case)
    loss = _loss(f, w)
    an = case.argnums
    diff = tuple(args[i] for i in an)
    of_diff = lambda *d: f(*_with(args, an, d))  # noqa: E731
    every = tuple(range(len(an)))
    randomness = "same" if case.random else "error"
    if transform == "backward":
        return _backward(loss, args, an)
    if transform == "grad":
        return grad(loss, argnums=an)(*args)
    if transform == "vjp":
        return vjp(of_diff, *diff)[1](w)
    if transform == "jacrev":
        return jacrev(of_diff, argnums=every)(*diff)
    if transform == "vmap":
        return vmap(f, in_dims=case.dims, randomness=randomness)(*_batched(case))
    if transform == "vmap_grad":
        return vmap(grad(loss, argnums=an), in_dims=case.dims, randomness=randomness)(*_batched(case))
    if transform == "hessian":
        of_first = lambda x: loss(*_with(args, an[:1], (x,)))  # noqa: E731
        if case.random:  # hessian is jacfwd(jacrev(f)), whose vmap must be told how to draw
            return jacfwd(jacrev(of_first), randomness=randomness)(args[an[0]])
        return hessian(of_first)(args[an[0]])
    if transform == "jvp":
        return jvp(of_diff, diff, _tangents(case, args))[1]
    if transform == "jacfwd":
        return jacfwd(of_diff, argnums=every, randomness=randomness)(*diff)
    if transform == "compile_grad":
        torch._dynamo.reset()
        try:
            return torch.compile(grad(loss, argnums=an), backend="aot_eager", dynamic=False)(*args)
        finally:
            torch._dynamo.reset()
    raise ValueError(transform)


def _backward(
    loss: Callable[..., torch.Tensor], args: tuple[Any, ...], an: tuple[int, ...]
) -> tuple[torch.Tensor, ...]:
    leaves = tuple(args[i].detach().clone().requires_grad_() for i in an)
    loss(*_with(args, an, leaves)).backward()
    return tuple(torch.zeros_like(leaf) if leaf.grad is None else leaf.grad for leaf in leaves)


_REFERENCES: dict[tuple[str, str], Any] = {}


def reference(case: Case, transform: str) -> Any:
    """What the transform must give, from the **unlifted** class run eagerly (torch's own ``apply``).

    ``.backward()``, ``grad``, ``compile(grad)``: ``torch.autograd.grad`` of the loss; ``vjp``: of the output with
    the cotangent; ``jacrev``, ``jacfwd``: one ``torch.autograd.grad`` per output element (the class's backward);
    ``jvp``: that jacobian times the tangent (forward mode of a lifted class is its backward's transpose);
    ``vmap``: a loop of the forward; ``vmap(grad)``: a loop of ``torch.autograd.grad``; ``hessian``: central
    finite differences of the eager gradient, or (``hessian_ref="double_backward"``, for a class whose backward is
    deliberately not its forward's derivative: a surrogate gradient) autograd's derivative of the eager gradient.
    """
    key = (case.name, transform)
    _weights(case)
    if key not in _REFERENCES:
        for cls in classes_of(case):
            assert "apply" not in vars(cls), f"{cls.__qualname__} is lifted while its reference is made"
        _REFERENCES[key] = _reference(case, transform)
    return _REFERENCES[key]


def _reference(case: Case, transform: str) -> Any:
    f = _f(case)
    args = _sample(case, 0)
    w = _weights(case)
    loss = _loss(f, w)
    an = case.argnums
    if transform in ("backward", "grad", "compile_grad"):
        return _eager_grads(loss, args, an)
    if transform == "vjp":
        return _eager_grads(f, args, an, w)
    if transform in ("jacrev", "jacfwd"):
        return _eager_jacobian(case, f, args)
    if transform == "jvp":
        jac = _eager_jacobian(case, f, args)
        out_shape = jac[0].shape[: jac[0].dim() - args[an[0]].dim()]
        tangents = _tangents(case, args)
        return sum(
            (j.reshape(math.prod(out_shape), -1) @ t.reshape(-1)).reshape(out_shape) for j, t in zip(jac, tangents)
        )
    if transform == "vmap":
        batched = _batched(case)
        return torch.stack([f(*_example(case, batched, b)) for b in range(B)])
    if transform == "vmap_grad":
        batched = _batched(case)
        per = [_eager_grads(loss, _example(case, batched, b), an) for b in range(B)]
        return tuple(torch.stack([p[j] for p in per]) for j in range(len(an)))
    if transform == "hessian":
        if case.hessian_ref == "double_backward":
            return _double_backward_hessian(case, loss, args)
        return _fd_hessian(case, loss, args)
    raise ValueError(transform)


def _tolerances(case: Case, transform: str) -> dict[str, float]:
    if transform == "hessian" and case.hessian_ref == "fd":
        return {"rtol": 1e-5, "atol": 1e-6}
    return {"rtol": case.rtol, "atol": case.atol}


def _compare(case: Case, transform: str, got: Any, expected: Any) -> Optional[str]:
    got_leaves, _ = tree_flatten(got)
    exp_leaves, _ = tree_flatten(expected)
    if len(got_leaves) != len(exp_leaves):
        return f"{len(got_leaves)} results, expected {len(exp_leaves)}"
    for g, e in zip(got_leaves, exp_leaves):
        if not isinstance(g, torch.Tensor):
            return f"got a {type(g).__name__}"
        try:
            torch.testing.assert_close(g, e, check_dtype=False, **_tolerances(case, transform))
        except AssertionError as err:
            lines = [ln.strip() for ln in str(err).splitlines() if "difference" in ln or "shape" in ln.lower()]
            return "; ".join(lines) or str(err).splitlines()[0]
    return None


def _names(case: Case, classes: tuple[type, ...]) -> list[str]:
    names = [cls.__name__ for cls in classes] + [cls.__qualname__ for cls in classes]
    for cls in classes:
        lifted = getattr(vars(cls).get("apply"), "lifted", None)
        qualname = getattr(lifted, "_qualname", None)
        if qualname:
            names.append(qualname)
    return names


def classify_error(case: Case, exc: BaseException, names: list[str]) -> Outcome:
    text = f"{type(exc).__name__}: {exc}"
    status = CLEAR if any(n and n in text for n in names) else UNCLEAR
    return Outcome(status, text)


def run_cell(case: Case, transform: str, *, lifted: bool = True) -> Outcome:
    """The cell's status, lifted in place (``lifted=False``: torch's own ``apply``, for comparison)."""
    differs = case.reference_differs.get(transform)
    if differs is not None and lifted:
        with differs.patch():
            out = _run_cell(case, transform, lifted=True)
        if out.status == PASS:
            out.status, out.message = NOREF, f"No reference: {differs.reason}"
        return out
    return _run_cell(case, transform, lifted=lifted)


def _run_cell(case: Case, transform: str, *, lifted: bool) -> Outcome:
    start = time.perf_counter()
    try:
        expected = reference(case, transform)
    except Exception as exc:  # noqa: BLE001
        return Outcome(NOREF, f"{type(exc).__name__}: {exc}", time.perf_counter() - start)
    classes = classes_of(case)
    names: list[str] = []
    try:
        with lifted_in_place(*classes) if lifted else contextlib.nullcontext():
            names = _names(case, classes)
            got = _run(case, transform)
    except Exception as exc:  # noqa: BLE001
        out = classify_error(case, exc, names or _names(case, classes))
        na = case.library_na.get(transform)
        if na is not None and re.search(na.regex, out.message):
            out.status = NA
        out.message = out.message + "\n" + "".join(traceback.format_exception(exc)[-3:])
        out.seconds = time.perf_counter() - start
        return out
    mismatch = _compare(case, transform, got, expected)
    return Outcome(PASS if mismatch is None else WRONG, mismatch or "", time.perf_counter() - start)


def cell_ok(case: Case, transform: str, out: Outcome) -> bool:
    """What the test asserts: PASS, or the expected clear error of a cell judged impossible (or the library's)."""
    if transform in case.expected:
        exp = case.expected[transform]
        return out.status == CLEAR and re.search(exp.regex, out.message) is not None
    if transform in case.library_na:
        return out.status in (NA, PASS)
    if transform in case.reference_differs:
        return out.status == NOREF
    return out.status == PASS


# ------------------------------------------------------------------- cases
def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=DT)


CASES: list[Case] = []


def case(**kw: Any) -> None:
    CASES.append(Case(**kw))


# -- pytorch-revgrad: the gradient reversal layer (domain adaptation). Its forward returns its input.
def _revgrad() -> Callable[..., torch.Tensor]:
    from pytorch_revgrad import RevGrad

    layer = RevGrad(alpha=0.7)
    return lambda x: layer(x)


case(
    name="RevGrad",
    lib="pytorch-revgrad",
    module="pytorch_revgrad",
    classes=("pytorch_revgrad.functional.RevGrad",),
    call="pytorch_revgrad.RevGrad(alpha=0.7)(x)",
    setup=_revgrad,
    sample=lambda: (_r(3, 4),),
    hessian_ref="double_backward",  # its backward (-alpha) is deliberately not its forward's derivative (1)
)


# -- sparsemax: Sparsemax(dim) module, ctx attributes and an int argument
def _sparsemax() -> Callable[..., torch.Tensor]:
    from sparsemax import Sparsemax

    m = Sparsemax(dim=-1)
    return lambda x: m(x)


case(
    name="SparsemaxFunction",
    lib="sparsemax",
    module="sparsemax",
    classes=("sparsemax.sparsemax.SparsemaxFunction",),
    call="sparsemax.Sparsemax(dim=-1)(x)",
    setup=_sparsemax,
    sample=lambda: (_r(3, 5),),
)


# -- geomloss: SamplesLoss's kernel losses double the gradient of their first argument (DoubleGrad)
def _geomloss() -> Callable[..., torch.Tensor]:
    from geomloss import SamplesLoss

    loss = SamplesLoss("gaussian", blur=0.5)
    return lambda x, y: loss(x, y)


case(
    name="DoubleGrad",
    lib="geomloss",
    module="geomloss",
    classes=("geomloss._legacy.kernel_samples.DoubleGrad",),
    call='geomloss.SamplesLoss("gaussian", blur=0.5)(x, y)',
    setup=_geomloss,
    sample=lambda: (_r(4, 2), _r(5, 2)),
    argnums=(0, 1),
    hessian_ref="double_backward",  # its backward (2 g) is deliberately not its forward's derivative (g)
)


# -- pyro-ppl: special functions and reparameterized samplers of its distributions
def _safe_log() -> Callable[..., torch.Tensor]:
    from pyro.ops.special import safe_log

    return safe_log


case(
    name="_SafeLog",
    lib="pyro-ppl",
    module="pyro",
    classes=("pyro.ops.special._SafeLog",),
    call="pyro.ops.special.safe_log(x)",
    setup=_safe_log,
    sample=lambda: (_r(3, 4).abs() + 0.2,),
)


def _straight_through(kind: str) -> Callable[[], Callable[..., torch.Tensor]]:
    def setup() -> Callable[..., torch.Tensor]:
        import pyro
        from pyro.distributions import RelaxedBernoulliStraightThrough, RelaxedOneHotCategoricalStraightThrough

        dist = RelaxedBernoulliStraightThrough if kind == "bernoulli" else RelaxedOneHotCategoricalStraightThrough

        def f(logits: torch.Tensor) -> torch.Tensor:
            with pyro.validation_enabled(False):
                d = dist(torch.tensor(0.5, dtype=DT), logits=logits)
                hard = d.rsample()
                # log_prob reads the soft sample the class keeps on its output (hard._unquantize)
                return torch.cat([hard, d.log_prob(hard).reshape(-1)])

        return f

    return setup


case(
    name="QuantizeBernoulli",
    lib="pyro-ppl",
    module="pyro",
    classes=("pyro.distributions.relaxed_straight_through.QuantizeBernoulli",),
    call="d = RelaxedBernoulliStraightThrough(0.5, logits=l); s = d.rsample(); d.log_prob(s)",
    setup=_straight_through("bernoulli"),
    sample=lambda: (_r(4),),
    random=True,
    hessian_ref="double_backward",  # straight-through: its backward (identity) is not round's derivative (0)
)
case(
    name="QuantizeCategorical",
    lib="pyro-ppl",
    module="pyro",
    classes=("pyro.distributions.relaxed_straight_through.QuantizeCategorical",),
    call="d = RelaxedOneHotCategoricalStraightThrough(0.5, logits=l); s = d.rsample(); d.log_prob(s)",
    setup=_straight_through("categorical"),
    sample=lambda: (_r(4),),
    random=True,
    hessian_ref="double_backward",
)


def _omt() -> Callable[..., torch.Tensor]:
    import pyro
    from pyro.distributions import OMTMultivariateNormal

    def f(loc: torch.Tensor, scale_tril: torch.Tensor) -> torch.Tensor:
        with pyro.validation_enabled(False):
            return OMTMultivariateNormal(loc, scale_tril).rsample(torch.Size([2]))

    return f


def _lower(n: int) -> torch.Tensor:
    return torch.tril(_r(n, n), -1) + torch.diag(torch.rand(n, dtype=DT) + 0.5)


_ONCE = Expected(
    r"_OMTMVNSample.backward is decorated with @once_differentiable|_OMTMVNSample.* draws random numbers, and its "
    r"backward is being differentiated again",
    "the class's backward is `@once_differentiable` (a second derivative must differentiate it), and its forward "
    "draws the noise it saves, so a second derivative would differentiate other draws (forward mode evaluates the "
    "backward on a basis, NOTE [Forward mode on a basis], and draws the primal's noise)",
)

case(
    name="_OMTMVNSample",
    lib="pyro-ppl",
    module="pyro",
    classes=("pyro.distributions.omt_mvn._OMTMVNSample",),
    call="OMTMultivariateNormal(loc, scale_tril).rsample((2,))",
    setup=_omt,
    sample=lambda: (_r(3), _lower(3)),
    argnums=(0, 1),
    random=True,
    expected={"hessian": _ONCE},
)


# -- torchdiffeq: the adjoint method (an nn.Module, an options dict), the adaptive solvers' scratch writes
# (an index tuple (..., i)), and the event-time gradient (two callables)
class _Field(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3, dtype=DT)

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(y)) - 0.5 * y


def _odeint_adjoint() -> Callable[..., torch.Tensor]:
    from torchdiffeq import odeint_adjoint

    func = _Field()
    t = torch.linspace(0, 1, 3, dtype=DT)
    return lambda y0: odeint_adjoint(func, y0, t, method="rk4", options={"step_size": 0.25})


def _not_differentiable(cls: str, how: str) -> Expected:
    return Expected(
        rf"{cls}.backward is not differentiable by torch",
        f"the class's backward {how}: torch.func cannot differentiate it, and a second derivative must (forward"
        " mode evaluates it on a basis of cotangents instead, NOTE [Forward mode on a basis])",
    )


def _hessian_of(cls: str, how: str) -> dict[str, Expected]:
    return {"hessian": _not_differentiable(cls, how)}


_AUTOGRAD = "runs autograd itself (torch.autograd.grad / .backward() under enable_grad, recompute-style)"
_DATA_DEPENDENT = Expected(
    r"data-dependent control flow",
    "torchdiffeq's event search (outside the class) branches on tensor values: vmap cannot run it",
)
_SOLUTION_BUFFER = Expected(
    r"inplace arithmetic",
    "torchdiffeq's solver (outside the class) writes the batched y0 into an unbatched buffer"
    " (`solution[0] = y0`): vmap cannot run it",
)

case(
    name="OdeintAdjointMethod",
    lib="torchdiffeq",
    module="torchdiffeq",
    classes=("torchdiffeq._impl.adjoint.OdeintAdjointMethod",),
    call='odeint_adjoint(func, y0, t, method="rk4", options={"step_size": 0.25})',
    setup=_odeint_adjoint,
    sample=lambda: (_r(3),),
    expected=_hessian_of("OdeintAdjointMethod", _AUTOGRAD),
    rtol=1e-6,
    atol=1e-8,
)


def _odeint_dopri5() -> Callable[..., torch.Tensor]:
    from torchdiffeq import odeint

    func = _Field()
    t = torch.linspace(0, 1, 3, dtype=DT)
    return lambda y0: odeint(func, y0, t, method="dopri5", rtol=1e-6, atol=1e-8)


@contextlib.contextmanager
def _detached_step_size() -> Iterator[None]:
    """torchdiffeq's step size computed from detached inputs: a constant for forward mode as for reverse mode."""
    from torchdiffeq._impl import rk_common

    original = rk_common._optimal_step_size
    rk_common._optimal_step_size = lambda step, ratio, *rest: original(step.detach(), ratio.detach(), *rest)
    try:
        yield
    finally:
        rk_common._optimal_step_size = original


case(
    name="_UncheckedAssign",
    lib="torchdiffeq",
    module="torchdiffeq",
    classes=("torchdiffeq._impl.rk_common._UncheckedAssign", "torchdiffeq._impl.misc._StitchGradient"),
    call='odeint(func, y0, t, method="dopri5")',
    setup=_odeint_dopri5,
    sample=lambda: (_r(3),),
    library_na={"vmap": _SOLUTION_BUFFER, "vmap_grad": _SOLUTION_BUFFER},
    reference_differs=dict.fromkeys(
        ("jvp", "jacfwd"),
        ReferenceDiffers(
            "torchdiffeq's step-size control (`_optimal_step_size`) runs under `@torch.no_grad()`, which "
            "forward-mode AD does not stop: forward mode through `odeint` differentiates the step size, reverse "
            "mode (the reference) does not, and the two differ by ~2e-7 here whatever the classes do. With the "
            "step size's inputs detached (the test runs the cell so) the cell PASSes",
            _detached_step_size,
        ),
    ),
    rtol=1e-6,
    atol=1e-8,
)


def _odeint_event() -> Callable[..., torch.Tensor]:
    from torchdiffeq import odeint_event

    func = _Field()
    t0 = torch.tensor(0.0, dtype=DT)

    def event_fn(t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y.sum() - 3.0  # the time the state's sum falls to 3.0

    def f(y0: torch.Tensor) -> torch.Tensor:
        event_t, solution = odeint_event(func, y0, t0, event_fn=event_fn, method="rk4", options={"step_size": 0.1})
        return torch.cat([event_t.reshape(1), solution[-1]])

    return f


case(
    name="ImplicitFnGradientRerouting",
    lib="torchdiffeq",
    module="torchdiffeq",
    classes=("torchdiffeq._impl.odeint.ImplicitFnGradientRerouting",),
    call='odeint_event(func, y0, t0, event_fn=event_fn, method="rk4")',
    setup=_odeint_event,
    sample=lambda: (_r(3).abs() + 1.5,),
    expected={
        **dict.fromkeys(
            ("grad", "vjp", "jacrev", "hessian", "jvp", "jacfwd", "compile_grad"),
            Expected(
                r"ImplicitFnGradientRerouting.apply was called under a torch.func transform with a Python object "
                r"argument, event_fn .* initial_signs",
                "the `event_fn` torchdiffeq passes to `apply` closes over `initial_signs`, a `sign()` of `y0`, which "
                "the transform tracks: its derivative is zero, but nothing tells a tracked tensor inside an object "
                "from one whose derivative would be lost, so it is refused (NOTE [Python objects as arguments of a "
                "lifted Function])",
            ),
        ),
    },
    library_na={"vmap": _DATA_DEPENDENT, "vmap_grad": _DATA_DEPENDENT},
    rtol=1e-6,
    atol=1e-8,
)


# -- memory-efficient-attention-pytorch (lucidrains): flash attention in plain torch, and reversible layers
def _flash(cosine: bool) -> Callable[[], Callable[..., torch.Tensor]]:
    def setup() -> Callable[..., torch.Tensor]:
        if cosine:
            from memory_efficient_attention_pytorch.cosine_sim_flash_attention import FlashAttention
        else:
            from memory_efficient_attention_pytorch import FlashAttention

        attn = FlashAttention(dim=4, heads=2, dim_head=2, q_bucket_size=2, k_bucket_size=3)
        if cosine:
            attn = attn.double()
        return lambda x: attn(x)

    return setup


_NO_GRAD_BACKWARD = {
    "hessian": Expected(
        r"FlashAttentionFunction.backward is not differentiable by torch",
        "the class's backward runs under `@torch.no_grad()` and accumulates in place: a second derivative must"
        " differentiate it (forward mode evaluates it on a basis of cotangents instead, NOTE [Forward mode on a"
        " basis])",
    ),
}

case(
    name="FlashAttentionFunction",
    lib="memory-efficient-attention-pytorch",
    module="memory_efficient_attention_pytorch",
    classes=("memory_efficient_attention_pytorch.flash_attention.FlashAttentionFunction",),
    call="FlashAttention(dim=4, heads=2, dim_head=2, q_bucket_size=2, k_bucket_size=3)(x)",
    setup=_flash(False),
    sample=lambda: (torch.randn(1, 4, 4),),  # float32: the library puts float64's max into a float32 buffer
    expected=_NO_GRAD_BACKWARD,
    rtol=1e-5,
    atol=1e-6,
)
case(
    name="cosine_sim.FlashAttentionFunction",
    lib="memory-efficient-attention-pytorch",
    module="memory_efficient_attention_pytorch",
    classes=("memory_efficient_attention_pytorch.cosine_sim_flash_attention.FlashAttentionFunction",),
    call="cosine_sim_flash_attention.FlashAttention(dim=4, heads=2, dim_head=2, q_bucket_size=2, k_bucket_size=3)(x)",
    setup=_flash(True),
    sample=lambda: (_r(1, 4, 4),),
    expected=_NO_GRAD_BACKWARD,
    rtol=1e-6,  # its row sums are float32 whatever q's dtype
    atol=1e-7,
)


def _reversible() -> Callable[..., torch.Tensor]:
    from memory_efficient_attention_pytorch.reversible import ReversibleSequence

    def block() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh())

    seq = ReversibleSequence([(block(), block()) for _ in range(2)]).double()
    return lambda x: seq(x)


case(
    name="_ReversibleFunction",
    lib="memory-efficient-attention-pytorch",
    module="memory_efficient_attention_pytorch",
    classes=("memory_efficient_attention_pytorch.reversible._ReversibleFunction",),
    call="ReversibleSequence([(f, g), (f2, g2)])(x)",
    setup=_reversible,
    sample=lambda: (_r(1, 3, 2),),
    expected=_hessian_of("_ReversibleFunction", _AUTOGRAD),
)


# -- snntorch: surrogate gradients of the spike (a Heaviside step) in a leaky integrate-and-fire neuron
def _leaky(spike_grad: Optional[Callable[[], Any]]) -> Callable[[], Callable[..., torch.Tensor]]:
    def setup() -> Callable[..., torch.Tensor]:
        import snntorch

        neuron = snntorch.Leaky(beta=0.9, spike_grad=None if spike_grad is None else spike_grad()).double()

        def f(x: torch.Tensor, mem: torch.Tensor) -> torch.Tensor:
            spk, mem = neuron(x, mem)
            return torch.cat([spk, mem])

        return f

    return setup


def _surrogate(name: str, *args: Any) -> Callable[[], Any]:
    def make() -> Any:
        from snntorch import surrogate

        return getattr(surrogate, name)(*args)

    return make


def _custom_surrogate() -> Any:
    from snntorch import surrogate

    def spike_grad(input_: torch.Tensor, grad_input: torch.Tensor, spikes: torch.Tensor) -> torch.Tensor:
        return grad_input / (1 + (5 * input_) ** 2)

    return surrogate.custom_surrogate(spike_grad)


_LEAKY_STATE = {
    "compile_grad": Expected(
        r"Cannot access storage of TensorWrapper",
        "snn.Leaky keeps its membrane on the module (`self.mem = ...`) inside the compiled `grad`: AOTAutograd"
        " fails the same with the spike as plain torch ops (where the op breaks the graph, as for Triangular, it"
        " passes)",
    )
}
_DREW = dict.fromkeys(
    ("jacrev", "hessian"),
    Expected(
        r"(?s)randomness error mode.*StochasticSpikeOperator",
        "the class's backward draws noise, and `jacrev` (also inside `hessian`) has no `randomness` argument: its"
        " vmap of the backward runs in randomness='error' mode (`jacfwd`, `vmap` take randomness='same')",
    ),
)


def _membrane() -> tuple[torch.Tensor, torch.Tensor]:
    return (_r(5), _r(5))


for _name, _cls, _spike_grad, _call in (
    ("ATan", "ATan", None, "snntorch.Leaky(beta=0.9)(x, mem)  # surrogate.atan(), the default"),
    (
        "FastSigmoid",
        "FastSigmoid",
        _surrogate("fast_sigmoid", 25),
        "Leaky(beta=0.9, spike_grad=surrogate.fast_sigmoid(25))",
    ),
    ("Triangular", "Triangular", _surrogate("triangular", 1), "Leaky(beta=0.9, spike_grad=surrogate.triangular(1))"),
    (
        "StraightThroughEstimator",
        "StraightThroughEstimator",
        _surrogate("straight_through_estimator"),
        "Leaky(beta=0.9, spike_grad=surrogate.straight_through_estimator())",
    ),
    (
        "StochasticSpikeOperator",
        "StochasticSpikeOperator",
        _surrogate("SSO", 0.0, 0.2),
        "Leaky(beta=0.9, spike_grad=surrogate.SSO(0.0, 0.2))  # its backward draws noise",
    ),
    (
        "CustomSurrogate",
        "CustomSurrogate",
        _custom_surrogate,
        "Leaky(beta=0.9, spike_grad=surrogate.custom_surrogate(fn))",
    ),
):
    case(
        name=_name,
        lib="snntorch",
        module="snntorch",
        classes=(f"snntorch.surrogate.{_cls}",),
        call=_call,
        setup=_leaky(_spike_grad),
        sample=_membrane,
        hessian_ref="double_backward",  # a surrogate gradient is deliberately not the step's derivative (0)
        random=_name == "StochasticSpikeOperator",
        expected=_DREW if _name == "StochasticSpikeOperator" else {},
        library_na={} if _name in ("Triangular", "CustomSurrogate", "StochasticSpikeOperator") else _LEAKY_STATE,
    )


# -- linear_operator (GPyTorch's): structured operators, whose Functions take the operator's representation tree
def _linop(method: str) -> Callable[[], Callable[..., torch.Tensor]]:
    def setup() -> Callable[..., torch.Tensor]:
        from linear_operator.operators import AddedDiagLinearOperator, DenseLinearOperator, DiagLinearOperator

        def f(d: torch.Tensor, root: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
            op = AddedDiagLinearOperator(DenseLinearOperator(root @ root.mT), DiagLinearOperator(d))
            if method == "matmul":
                return op @ rhs
            if method == "solve":
                return op.solve(rhs)
            if method == "inv_quad":
                return op.inv_quad(rhs).reshape(1)
            if method == "sqrt_inv_matmul":
                return op.sqrt_inv_matmul(rhs)
            if method == "pivoted_cholesky":
                return op.pivoted_cholesky(rank=3)
            raise ValueError(method)

        return f

    return setup


def _linop_open(cls: str) -> dict[str, Expected]:
    out = {
        "hessian": Expected(
            rf"{cls}.backward is not differentiable|{cls}.backward returned None for an input that needs a gradient",
            "the backward returns a gradient only for the operator's tensors that report requires_grad, and a "
            "second derivative runs it on tensors that do not (NOTE [A backward that asks requires_grad]; forward "
            "mode runs it as eager mode does instead, NOTE [Forward mode on a basis])",
            open=True,
        )
    }
    if cls != "Matmul":
        out["vmap_grad"] = Expected(
            r"returned a Python value \(AddedDiagLinearOperator\) that differs between the examples of a vmap",
            "the forward keeps on ctx an operator built from the batched inputs, which cannot be one value for "
            "every example; the backward's residuals would have to be kept per example",
            open=True,
        )
    return out


def _psd_sample() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.rand(4, dtype=DT) + 0.5, _r(4, 3), _r(4, 2))


for _cls, _method, _call in (
    ("Matmul", "matmul", "(AddedDiagLinearOperator(DenseLinearOperator(R @ R.mT), DiagLinearOperator(d))) @ rhs"),
    ("Solve", "solve", "op.solve(rhs)  # op = AddedDiagLinearOperator(...) as above"),
    ("InvQuad", "inv_quad", "op.inv_quad(rhs)"),
    ("SqrtInvMatmul", "sqrt_inv_matmul", "op.sqrt_inv_matmul(rhs)"),
    ("PivotedCholesky", "pivoted_cholesky", "op.pivoted_cholesky(rank=3)"),
):
    case(
        name=_cls,
        lib="linear-operator",
        module="linear_operator",
        classes=(f"linear_operator.functions._{re.sub(r'(?<!^)(?=[A-Z])', '_', _cls).lower()}.{_cls}",),
        call=_call,
        setup=_linop(_method),
        sample=_psd_sample,
        argnums=(0, 1, 2),
        rtol=1e-6,
        atol=1e-8,
        expected=_hessian_of(_cls, _AUTOGRAD) if _cls == "PivotedCholesky" else _linop_open(_cls),
    )
