"""``loss.backward()`` under compiled autograd runs each op's registered backward.

Compiled autograd (``torch._dynamo.compiled_autograd``) records every node of
the backward graph and compiles the whole backward. Our grad node presents
itself as an ``autograd.Function``'s does (NOTE [Compiled autograd sees an
autograd.Function], csrc/compiled_autograd.cpp). Every op here registers a
backward twice the true derivative, so the compiled gradients match the
plain oracle's (or the eager op's) only if the registered rule ran.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from ops import OPS, OPS_BY_NAME
from oracles import DTYPE, twice_grad, unique_op_name
from test_lift import lifted_in_place, make_numpy, make_rownorm, rownorm
from test_register_vjp import plain as vjp_plain
from test_vmap_presets import make_op as make_preset_op
from test_vmap_presets import plain as preset_plain
from torch._dynamo.utils import counters
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

import torch_autobatch

NS = "tab_ca"


@contextlib.contextmanager
def compiled_autograd(backend: str = "aot_eager") -> Iterator[None]:
    """Compiled autograd for the block, from a clean Dynamo cache; counts its graph breaks."""
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend=backend)):
        yield
    torch._dynamo.reset()


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def _leaves(args: Any) -> list[torch.Tensor]:
    flat, _ = torch.utils._pytree.tree_flatten(args)
    return [a for a in flat if isinstance(a, torch.Tensor) and a.is_floating_point()]


def _fresh(args: Any, wrt: tuple[int, ...] | None) -> Any:
    """The sample with fresh leaves that require grad: floating tensors (of the arguments ``wrt``)."""

    def leaf(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.detach().clone().requires_grad_()
        return a

    return tuple(torch.utils._pytree.tree_map(leaf, a) if wrt is None or i in wrt else a for i, a in enumerate(args))


def grads_of(
    f: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    select: Any,
    ca: str | None,
    wrt: tuple[int, ...] | None = None,
) -> list:
    """``.grad`` of the floating inputs (of arguments ``wrt``) after ``loss.backward()``, compiled if ``ca``."""
    args = _fresh(args, wrt)
    outs = select(f(*args, **kwargs))
    loss = sum((o * torch.linspace(0.5, 1.5, o.numel(), dtype=o.dtype).reshape(o.shape)).sum() for o in outs)
    with compiled_autograd(ca) if ca else contextlib.nullcontext():
        loss.backward()
    return [a.grad for a in _leaves(args) if a.requires_grad]


@instantiate_parametrized_tests
class TestOpsUnderCompiledAutograd(TestCase):
    @parametrize("name", [e.name for e in OPS])
    def test_registered_backward_runs(self, name: str) -> None:
        entry = OPS_BY_NAME[name]
        (args, kwargs), *_ = entry.sample_inputs()
        want = grads_of(entry.oracle, args, kwargs, entry.select, None)
        got = grads_of(entry.op, args, kwargs, entry.select, "aot_eager")
        self.assertEqual(got, want)
        self.assertEqual(graph_breaks(), 0, "the backward was traced whole")
        self.assertGreater(counters["compiled_autograd"]["captures"], 0)


# ------------------------------------------------------------- op kinds
def _rbf(k: float) -> torch_autobatch.CustomOpDef:
    """A radial basis: exp(-(r - mu)^2), with a backward k times the true one, scaled by ctx.k."""

    @torch_autobatch.custom_op(unique_op_name(NS, "rbf"), mutates_args=())
    def rbf(r: torch.Tensor, mu: torch.Tensor, k: float) -> torch.Tensor:
        return torch.exp(-((r.unsqueeze(-1) - mu) ** 2))

    def setup(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        r, mu, k = inputs
        ctx.save_for_backward(r, mu)
        ctx.k = k

    def backward(ctx: Any, g: torch.Tensor) -> Any:
        r, mu = ctx.saved_tensors
        d = r.unsqueeze(-1) - mu
        return ctx.k * (g * torch.exp(-(d**2)) * (-2 * d)).sum(-1), None, None

    rbf.register_autograd(backward, setup_context=setup)
    return rbf


RBF = _rbf(2.0)
R, MU = torch.rand(7, dtype=DTYPE), torch.linspace(0, 1, 5, dtype=DTYPE)


TABLE: list[torch.Tensor] = []  # a tensor a backward reads, not an argument


def _one(out: torch.Tensor) -> tuple[torch.Tensor]:
    return (out,)


def rbf_plain(r: torch.Tensor, mu: torch.Tensor, k: float) -> torch.Tensor:
    from oracles import scale_derivative

    return torch.exp(-((scale_derivative(r, k).unsqueeze(-1) - mu) ** 2))


class TestOpKinds(TestCase):
    def _check(self, f: Callable[..., Any], oracle: Callable[..., Any], *args: Any, breaks: int | None = 0) -> None:
        want = grads_of(oracle, args, {}, lambda o: (o,), None)
        got = grads_of(f, args, {}, lambda o: (o,), "aot_eager")
        self.assertEqual(got, want)
        if breaks is not None:
            self.assertEqual(graph_breaks(), breaks)

    def test_register_vjp(self) -> None:
        from test_register_vjp import make_op as make_vjp_op

        op = make_vjp_op()
        x, w = torch.randn(4, 3, dtype=DTYPE), torch.randn(3, dtype=DTYPE)
        self._check(op, vjp_plain, x, w, breaks=None)

    def test_preset_with_numpy_backward_runs_eagerly_between_graphs(self) -> None:
        op = make_preset_op("numpy", "expand_dims")
        x, w = torch.randn(4, 3, dtype=DTYPE), torch.randn(3, dtype=DTYPE)
        self._check(op, twice_grad(preset_plain), x, w, breaks=None)
        self.assertGreater(graph_breaks(), 0, "numpy cannot be traced: it runs eagerly")

    def test_lifted_legacy_function(self) -> None:
        cls = make_rownorm(2.0)
        x, w = torch.randn(4, 5, dtype=DTYPE), torch.randn(5, dtype=DTYPE)
        with lifted_in_place(cls):
            self._check(lambda x, w: cls.apply(x, w, 1e-6), twice_grad(lambda x, w: rownorm(x, w, 1e-6)), x, w)

    def test_lifted_numpy_forward(self) -> None:
        cls = make_numpy(2.0)
        with lifted_in_place(cls):
            self._check(cls.apply, twice_grad(torch.sin), torch.randn(6, dtype=DTYPE), breaks=None)

    def test_lifted_new_style_function(self) -> None:
        class Cube(torch.autograd.Function):
            @staticmethod
            def forward(x: torch.Tensor) -> torch.Tensor:
                return x**3

            @staticmethod
            def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
                ctx.save_for_backward(inputs[0])

            @staticmethod
            def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
                (x,) = ctx.saved_tensors
                return 2 * 3 * g * x**2

        with lifted_in_place(Cube):
            self._check(Cube.apply, twice_grad(lambda x: x**3), torch.randn(6, dtype=DTYPE))

    def test_numpy_backward(self) -> None:
        """Dynamo traces numpy as torch ops where it can, and otherwise runs it between graphs."""

        @torch_autobatch.custom_op(unique_op_name(NS, "np_backward"), mutates_args=())
        def sin(x: torch.Tensor) -> torch.Tensor:
            return torch.sin(x)

        def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return torch.from_numpy(2 * g.numpy() * np.cos(x.detach().numpy()))

        sin.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))
        self._check(sin, twice_grad(torch.sin), torch.randn(6, dtype=DTYPE), breaks=None)

    def test_selective_checkpointing(self) -> None:
        from test_checkpointing import sac
        from torch.utils.checkpoint import CheckpointPolicy, checkpoint

        for policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE):
            with self.subTest(policy=policy):
                ctx_fn = sac(RBF._qualname, policy)
                f = lambda r: checkpoint(  # noqa: E731
                    lambda r: torch.sin(RBF(r * 1.5, MU, 2.0)).sum(), r, use_reentrant=False, context_fn=ctx_fn
                )
                want = grads_of(lambda r: torch.sin(rbf_plain(r * 1.5, MU, 2.0)).sum(), (R,), {}, _one, None)
                self.assertEqual(grads_of(f, (R,), {}, _one, "aot_eager"), want)

    def test_config_compiled_autograd_with_a_compiled_step(self) -> None:
        """The public switch: torch._dynamo.config.compiled_autograd with a torch.compile'd step."""

        def step(r: torch.Tensor) -> torch.Tensor:
            loss = torch.sin(RBF(r, MU, 2.0)).sum()
            loss.backward()
            return loss

        torch._dynamo.reset()
        r = R.clone().requires_grad_()
        with torch._dynamo.config.patch(compiled_autograd=True):
            torch.compile(step, backend="aot_eager")(r)
        torch._dynamo.reset()
        want = R.clone().requires_grad_()
        torch.sin(rbf_plain(want, MU, 2.0)).sum().backward()
        self.assertEqual(r.grad, want.grad)

    def test_a_node_made_under_vmap(self) -> None:
        """vmap in the forward, .backward() after it: the backward runs batched (eagerly, between graphs)."""
        for op, oracle in ((RBF, rbf_plain), (make_preset_op("numpy", "expand_dims"), twice_grad(preset_plain))):
            with self.subTest(op=op._qualname):
                x = torch.rand(4, 5, dtype=DTYPE)
                args = (MU, 2.0) if op is RBF else (torch.randn(5, dtype=DTYPE),)
                f = lambda o: lambda x: torch.func.vmap(lambda r: o(r, *args))(x)  # noqa: E731
                want = grads_of(f(oracle), (x,), {}, _one, None)
                self.assertEqual(grads_of(f(op), (x,), {}, _one, "aot_eager"), want)

    def test_a_tensor_the_backward_reads_is_read_live(self) -> None:
        @torch_autobatch.custom_op(unique_op_name(NS, "table"), mutates_args=())
        def scale(x: torch.Tensor) -> torch.Tensor:
            return x * 1.0

        scale.register_autograd(lambda ctx, g: g * TABLE[0])
        TABLE[:] = [torch.tensor([2.0, 3.0, 4.0], dtype=DTYPE)]
        with compiled_autograd():
            for change in (lambda: None, lambda: TABLE[0].mul_(10), lambda: TABLE.__setitem__(0, TABLE[0] + 1)):
                change()
                x = torch.ones(3, dtype=DTYPE, requires_grad=True)
                scale(x).sum().backward()
                self.assertEqual(x.grad, TABLE[0])

    def test_inductor(self) -> None:
        r, mu = torch.rand(7, dtype=torch.float32), torch.linspace(0, 1, 5)
        want = grads_of(rbf_plain, (r, mu, 2.0), {}, lambda o: (o,), None, wrt=(0,))
        got = grads_of(RBF, (r, mu, 2.0), {}, lambda o: (o,), "inductor", wrt=(0,))
        self.assertEqual(got, want)
        self.assertEqual(graph_breaks(), 0)


class TestCacheKeys(TestCase):
    def test_a_changed_ctx_attribute_recompiles(self) -> None:
        r, mu = torch.rand(5, dtype=DTYPE), torch.linspace(0, 1, 4, dtype=DTYPE)
        torch._dynamo.reset()
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            for k in (2.0, 3.0, 2.0):
                rr = r.clone().requires_grad_()
                RBF(rr, mu, k).sum().backward()
                self.assertEqual(rr.grad, self._want(r, mu, k))
        torch._dynamo.reset()

    def _want(self, r: torch.Tensor, mu: torch.Tensor, k: float) -> torch.Tensor:
        rr = r.clone().requires_grad_()
        rbf_plain(rr, mu, k).sum().backward()
        return rr.grad

    def test_a_second_op_of_the_same_shape_is_not_given_the_first_ones_graph(self) -> None:
        three = _rbf(3.0)  # its backward is 3x, with ctx.k the same as RBF's
        r, mu = torch.rand(5, dtype=DTYPE), torch.linspace(0, 1, 4, dtype=DTYPE)
        torch._dynamo.reset()
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            for op in (RBF, three, RBF):
                rr = r.clone().requires_grad_()
                op(rr, mu, 2.0).sum().backward()
                self.assertEqual(rr.grad, self._want(r, mu, 2.0))
        torch._dynamo.reset()

    def test_the_next_step_reuses_the_compiled_backward(self) -> None:
        r, mu = torch.rand(5, dtype=DTYPE), torch.linspace(0, 1, 4, dtype=DTYPE)
        with compiled_autograd():
            for step in range(4):
                rr = (r + step).requires_grad_()
                RBF(rr, mu, 2.0).sum().backward()
                self.assertEqual(rr.grad, self._want(r + step, mu, 2.0))
                if step == 0:
                    compiled = counters["stats"]["unique_graphs"]
        self.assertEqual(counters["stats"]["unique_graphs"], compiled, "a new ctx each step: no recompile")

    def test_a_second_backward_without_retain_graph_raises(self) -> None:
        r = torch.rand(5, dtype=DTYPE, requires_grad=True)
        y = RBF(r, torch.linspace(0, 1, 4, dtype=DTYPE), 2.0).sum()
        with compiled_autograd():
            y.backward()
            with self.assertRaisesRegex(RuntimeError, "second time"):
                y.backward()


# ------------------------------------------------- the force-training step
class Potential(torch.nn.Module):
    """E(pos) = sum over pairs of MLP(rbf(|p_i - p_j|)): forces are -dE/dpos."""

    def __init__(self, rbf: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.rbf = rbf
        self.mu = torch.nn.Parameter(torch.linspace(0, 2, 8, dtype=DTYPE), requires_grad=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.SiLU(), torch.nn.Linear(16, 1)).to(DTYPE)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        i, j = torch.triu_indices(pos.shape[0], pos.shape[0], 1)
        r = (pos[i] - pos[j]).norm(dim=-1)
        return self.mlp(self.rbf(r, self.mu, 2.0)).sum()


def force_step(model: Potential, pos: torch.Tensor, target: torch.Tensor, ca: str | None) -> list[torch.Tensor]:
    """Energy, forces by autograd.grad(create_graph=True) eagerly, then loss.backward() (compiled if ``ca``)."""
    model.zero_grad()
    pos = pos.clone().requires_grad_()
    energy = model(pos)
    (forces,) = torch.autograd.grad(-energy, pos, create_graph=True)
    loss = ((forces - target) ** 2).sum() + energy
    with compiled_autograd(ca) if ca else contextlib.nullcontext():
        loss.backward()
    return [p.grad for p in model.mlp.parameters()]


class TestForceTraining(TestCase):
    @parametrize("backend", ["aot_eager", "inductor"])
    def test_force_step(self, backend: str) -> None:
        torch.manual_seed(0)
        pos, target = torch.randn(6, 3, dtype=DTYPE), torch.randn(6, 3, dtype=DTYPE)
        model = Potential(RBF)
        plain = Potential(rbf_plain)
        plain.load_state_dict(model.state_dict())
        self.assertEqual(force_step(model, pos, target, backend), force_step(plain, pos, target, None))

    @parametrize("backend", ["aot_eager", "inductor"])
    def test_compiled_forward(self, backend: str) -> None:
        torch.manual_seed(0)
        pos = torch.randn(6, 3, dtype=DTYPE)
        model, plain = Potential(RBF), Potential(rbf_plain)
        plain.load_state_dict(model.state_dict())
        compiled = torch.compile(model, backend=backend)
        with compiled_autograd(backend):
            compiled(pos).backward()
        plain(pos).backward()
        self.assertEqual(
            [p.grad for p in model.parameters() if p.requires_grad],
            [p.grad for p in plain.parameters() if p.requires_grad],
        )


instantiate_parametrized_tests(TestForceTraining)


# ------------------------------------------------------------- DDP's hooks
class _Net(torch.nn.Module):
    def __init__(self, rbf: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.rbf = rbf
        self.fc1, self.fc2 = torch.nn.Linear(4, 6).to(DTYPE), torch.nn.Linear(6 * 5, 1).to(DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.rbf(self.fc1(x), MU, 2.0).flatten(1)).squeeze(-1)


def _ddp_data(rbf: Callable[..., torch.Tensor]) -> tuple[_Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return _Net(rbf), torch.randn(8, 4, dtype=DTYPE), torch.randn(8, dtype=DTYPE)


def _ddp_worker(rank: int, port: int, out_dir: str) -> None:
    """One of two gloo ranks: a DDP step of _Net (RBF's 2x backward) under compiled autograd."""
    import datetime
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    try:
        model, x, y = _ddp_data(RBF)
        half = slice(rank * 4, rank * 4 + 4)
        # torch's own condition for DDP under compiled autograd
        torch._dynamo.config.optimize_ddp = "python_reducer"
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="aot_eager")):
            ((ddp(x[half]) - y[half]) ** 2).mean().backward()
        torch.save({k: p.grad for k, p in model.named_parameters()}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # neither rank tears gloo down while the other still uses it (a loaded machine aborted one)
    finally:
        dist.destroy_process_group()


class TestDistributed(TestCase):
    def test_ddp_all_reduces_the_registered_gradients(self) -> None:
        import os
        import socket
        import tempfile

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tempfile.TemporaryDirectory() as out_dir:
            mp.spawn(_ddp_worker, args=(port, out_dir), nprocs=2)
            ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
        model, x, y = _ddp_data(rbf_plain)  # the same parameters, the 2x derivative by autograd
        ((model(x) - y) ** 2).mean().backward()
        for grads in ranks:
            self.assertEqual(grads, {k: p.grad for k, p in model.named_parameters()})


if __name__ == "__main__":
    run_tests()
