"""register_vjp(fwd, bwd): the forward's intermediates reach the backward (NOTE [Residuals of register_vjp]).

The op is ``tanh(x) * w``; ``fwd`` saves ``t = tanh(x)`` and ``w``. ``bwd`` is
deliberately 2x in x, so a path that used the function's own derivative, or
recomputed through another rule, fails. Counters prove ``fwd`` ran instead of
the function, once, and only when something is differentiated.
"""

from __future__ import annotations

import threading

import torch
from oracles import twice, unique_op_name
from torch._subclasses.fake_tensor import FakeTensor
from torch.func import grad, hessian, jacrev, vjp, vmap
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_autobatch

# Calls on real data. The function also runs on meta (or fake) tensors, as
# the op's fake kernel, once per input metadata to check fwd's output (NOTE [fwd
# returns what the op returns]): "fake" counts those.
CALLS = {"fn": 0, "fwd": 0, "bwd": 0, "fake": 0}


def plain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The oracle: the op's math with a derivative 2x the true one in x."""
    return torch.tanh(twice(x)) * w


def make_op() -> torch_autobatch.CustomOpDef:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        CALLS["fake" if isinstance(x, FakeTensor) or x.is_meta else "fn"] += 1
        return torch.tanh(x) * w

    def fwd(x, w):
        CALLS["fwd"] += 1
        t = torch.tanh(x)
        return t * w, (t, w, "a python value")

    def bwd(residuals, g):
        CALLS["bwd"] += 1
        t, w, value = residuals
        assert value == "a python value"
        return 2 * g * w * (1 - t * t), g * t

    op = torch_autobatch.custom_op(unique_op_name("tab_vjp", "tanh_mul"), fn, mutates_args=())
    op.register_vjp(fwd, bwd)
    return op


def counts() -> dict[str, int]:
    out = dict(CALLS)
    for k in CALLS:
        CALLS[k] = 0
    return out


def _fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * w


def _fwd(x, w):
    t = torch.tanh(x)
    return t * w, (t, w)


def _bwd(r, g):
    t, w = r
    return 2 * g * w * (1 - t * t), g * t


def _ops_on_every_vmap_path() -> dict[str, torch_autobatch.CustomOpDef]:
    """``tanh(x) * w`` with a 2x-in-x register_vjp, batched by its composite, by vmap="loop", and by a rule."""
    ops = {}
    for path in ("composite", "loop", "rule"):
        op = torch_autobatch.custom_op(
            unique_op_name("tab_vjp", path), _fn, mutates_args=(), vmap="loop" if path == "loop" else "auto"
        )
        op.register_vjp(_fwd, _bwd)
        if path == "rule":
            op.register_vmap(lambda info, in_dims, x, w: (_fn(x.movedim(in_dims[0], 0), w), 0))
        ops[path] = op
    return ops


class TestRegisterVjp(TestCase):
    def setUp(self) -> None:
        self.op = make_op()
        self.x, self.w = torch.randn(5), torch.randn(5)
        counts()

    def test_nothing_differentiated_runs_the_function_not_fwd(self):
        self.assertEqual(self.op(self.x, self.w), torch.tanh(self.x) * self.w)
        self.assertEqual(counts(), {"fn": 1, "fwd": 0, "bwd": 0, "fake": 0})

    def test_backward_uses_fwds_residuals_once(self):
        x, w = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        self.op(x, w).sum().backward()
        self.assertEqual(counts(), {"fn": 0, "fwd": 1, "bwd": 1, "fake": 1})  # fake: fwd's output checked
        x2, w2 = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        plain(x2, w2).sum().backward()
        self.assertEqual((x.grad, w.grad), (x2.grad, w2.grad))
        self.op(x, w).sum().backward()
        self.assertEqual(counts(), {"fn": 0, "fwd": 1, "bwd": 1, "fake": 0})  # once per input metadata

    def test_fwd_without_residuals_runs_as_often_as_with_them(self):
        # Residuals may be None (a bwd that needs nothing): they still answer
        # the request, so fwd runs as often as when it returns tensors (once on
        # the composite's paths), never again in setup_context or the
        # backward. Both bwds return 6x the gradient (2x the true derivative).
        runs = {"none": 0, "tensor": 0}

        def make(kind: str, residuals: str) -> torch_autobatch.CustomOpDef:
            def fwd(x):
                runs[residuals] += 1
                return 3 * x, (None if residuals == "none" else (x,))

            op = torch_autobatch.custom_op(
                unique_op_name("tab_vjp", f"{residuals}_{kind}"),
                lambda x: 3 * x,
                mutates_args=(),
                schema="(Tensor x) -> Tensor",
                vmap="loop" if kind == "loop" else "auto",
            )
            op.register_vjp(fwd, lambda r, g: 6 * g)
            if kind == "rule":
                op.register_vmap(lambda info, in_dims, x: (3 * x, in_dims[0]))
            return op

        xs = torch.randn(3)

        def backward(op: torch_autobatch.CustomOpDef) -> torch.Tensor:
            leaf = xs.clone().requires_grad_()
            op(leaf).sum().backward()
            return leaf.grad

        def on_thread(op: torch_autobatch.CustomOpDef) -> torch.Tensor:
            out: list[torch.Tensor] = []
            thread = threading.Thread(target=lambda: out.append(backward(op)))
            thread.start()
            thread.join()
            return out[0]

        def compiled(op: torch_autobatch.CustomOpDef) -> torch.Tensor:
            torch._dynamo.reset()
            leaf = xs.clone().requires_grad_()
            torch.compile(lambda x: op(x).sum(), fullgraph=True)(leaf).backward()
            return leaf.grad

        paths = {
            ".backward()": backward,
            "grad": lambda op: grad(lambda x: op(x).sum())(xs),
            "vmap(grad)": lambda op: vmap(grad(lambda x: op(x).sum()))(xs),
            "grad(vmap)": lambda op: grad(lambda x: vmap(op)(x).sum())(xs),
            "compiled": compiled,
            "another thread": on_thread,
        }
        for kind in ("composite", "loop", "rule"):
            ops = {residuals: make(kind, residuals) for residuals in runs}
            for path, run in paths.items():
                with self.subTest(kind=kind, path=path):
                    counted = {}
                    for residuals, op in ops.items():
                        runs[residuals] = 0
                        self.assertEqual(run(op), torch.full_like(xs, 6.0))
                        counted[residuals] = runs[residuals]
                    self.assertEqual(counted["none"], counted["tensor"])
                    if kind == "composite" and path != "compiled":
                        self.assertEqual(counted["none"], 1)

    def test_torch_func_transforms(self):
        x, w = self.x, self.w
        for name, t in {
            "grad": lambda f: grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)),
            "jacrev": lambda f: jacrev(f, argnums=(0, 1)),
            "vjp": lambda f: lambda x, w: vjp(f, x, w)[1](torch.ones(5)),
        }.items():
            with self.subTest(name):
                got = t(self.op)(x, w)
                c = counts()
                self.assertEqual(got, t(plain)(x, w))
                self.assertEqual((c["fn"], c["fwd"]), (0, 1), name)

    def test_vmap_runs_fwd_once_batched(self):
        xs = torch.randn(7, 5)
        for name, t in {
            "vmap(grad)": lambda f: vmap(grad(lambda x, w: f(x, w).sum()), in_dims=(0, None)),
            "grad(vmap)": lambda f: grad(lambda x, w: vmap(f, in_dims=(0, None))(x, w).sum(), argnums=(0, 1)),
            "vmap(vmap(grad))": lambda f: vmap(
                vmap(grad(lambda x, w: f(x, w).sum()), in_dims=(0, None)), in_dims=(0, None)
            ),
        }.items():
            with self.subTest(name):
                x = xs if name != "vmap(vmap(grad))" else xs.reshape(7, 1, 5)
                got = t(self.op)(x, self.w)
                c = counts()
                self.assertEqual(got, t(plain)(x, self.w))
                self.assertEqual(c["fn"], 0, name)
                if name == "grad(vmap)":
                    self.assertEqual(c["fwd"], 1, name)  # once, on the batched tensors

    def test_every_vmap_path_gives_the_same_gradients(self):
        # The composite, vmap="loop" (one call per example must not answer the
        # batched call's request) and a register_vmap rule (fwd runs in setup).
        ops = _ops_on_every_vmap_path()
        xs, w = torch.randn(4, 5), self.w
        for path, op in ops.items():
            with self.subTest(path):
                self.assertEqual(
                    vmap(grad(lambda w, x: op(x, w).sum()), in_dims=(None, 0))(w, xs),
                    vmap(grad(lambda w, x: plain(x, w).sum()), in_dims=(None, 0))(w, xs),
                )
                self.assertEqual(
                    grad(lambda x, w: vmap(op, in_dims=(0, None))(x, w).sum(), argnums=(0, 1))(xs, w),
                    grad(lambda x, w: vmap(plain, in_dims=(0, None))(x, w).sum(), argnums=(0, 1))(xs, w),
                )

    def test_second_derivatives_differentiate_bwd_through_fwd(self):
        # NOTE [Second derivatives through residuals]: the oracle is bwd's
        # result as a function of the inputs through fwd (JAX's custom_vjp);
        # residuals taken as constants would drop d t / d x and fail it.
        x, w, xs = self.x.double(), self.w.double(), torch.randn(3, 5, dtype=torch.float64)
        ops = _ops_on_every_vmap_path()

        def first(x, w):  # d op(x, w).sum() / dx, by the registered rule
            return _bwd(_fwd(x, w)[1], torch.ones_like(x))[0]

        hess = jacrev(first)(x, w)
        for path, op in ops.items():
            xr = x.clone().requires_grad_()
            (g,) = torch.autograd.grad(op(xr, w).sum(), xr, create_graph=True)
            (gg,) = torch.autograd.grad(g.sum(), xr)
            got = {
                "create_graph=True": gg,
                "hessian": hessian(lambda x: op(x, w).sum())(x),
                "grad(grad)": grad(lambda x: grad(lambda x: op(x, w).sum())(x).sum())(x),
                "jacrev(jacrev)": jacrev(jacrev(lambda x: op(x, w)))(x).sum(0),
                "jacfwd(jacrev)": torch.func.jacfwd(jacrev(lambda x: op(x, w).sum()))(x),
                "grad(vjp)": grad(lambda x: vjp(lambda x: op(x, w), x)[1](torch.ones_like(x))[0].sum())(x),
                "d/dw of d/dx": jacrev(grad(lambda x, w: op(x, w).sum()), argnums=1)(x, w),
                "vmap(hessian)": vmap(hessian(lambda x: op(x, w).sum()))(xs),
                # differentiated again by the same level: the backward keeps its graph
                "grad(autograd.grad)": grad(
                    lambda x: torch.autograd.grad(op(x, w).sum(), x, create_graph=True)[0].sum()
                )(x),
                "vmap(grad(autograd.grad))": vmap(
                    grad(lambda x: torch.autograd.grad(op(x, w).sum(), x, create_graph=True)[0].sum())
                )(xs),
            }
            want = {
                "create_graph=True": hess.sum(0),
                "grad(grad)": hess.sum(0),
                "grad(vjp)": hess.sum(0),
                "jacrev(jacrev)": hess,
                "d/dw of d/dx": jacrev(first, argnums=1)(x, w),
                "vmap(hessian)": vmap(jacrev(first), in_dims=(0, None))(xs, w),
                "grad(autograd.grad)": hess.sum(0),
                "vmap(grad(autograd.grad))": vmap(jacrev(first), in_dims=(0, None))(xs, w).sum(1),
            }
            for name, value in got.items():
                with self.subTest(path=path, transform=name):
                    self.assertEqual(value, want.get(name, hess))

    def test_forward_mode_takes_register_jvp_or_derives_it(self):
        # register_vjp governs reverse mode only: a registered jvp (3x here)
        # governs forward mode on every path; without one, forward mode is
        # derived from the function (the true derivative), never from fwd/bwd.
        x, w, xs, t = self.x, self.w, torch.randn(3, 5), torch.ones(5)
        true = 1 - torch.tanh(x) ** 2
        derived = self.op
        jvp_op = torch_autobatch.custom_op(unique_op_name("tab_vjp", "with_jvp"), _fn, mutates_args=())
        jvp_op.register_vjp(_fwd, _bwd)

        def setup(ctx, inputs, output):
            ctx.save_for_forward(*inputs)

        def jvp_rule(ctx, tx, tw):
            x, w = ctx.saved_tensors
            return 3 * tx * w * (1 - torch.tanh(x) ** 2) + (0 if tw is None else tw * torch.tanh(x))

        jvp_op.register_jvp(jvp_rule, setup_context=setup)
        for op, scale in ((derived, 1), (jvp_op, 3)):
            with self.subTest(scale=scale):
                self.assertEqual(torch.func.jvp(lambda x: op(x, w), (x,), (t,))[1], scale * true * w)
                self.assertEqual(
                    vmap(lambda x: torch.func.jvp(lambda x: op(x, w), (x,), (t,))[1])(xs),
                    scale * (1 - torch.tanh(xs) ** 2) * w,
                )
                self.assertEqual(torch.func.jacfwd(lambda x: op(x, w))(x), torch.diag(scale * true * w))
                # reverse mode stays bwd's (2x)
                self.assertEqual(grad(lambda x: op(x, w).sum())(x), 2 * true * w)

    def test_first_derivatives_do_not_run_fwd_again(self):
        # Only a differentiated backward runs fwd a second time; torch.func's
        # own backward of a level runs with grad mode on, but keeps no graph.
        x, w, xs = self.x, self.w, torch.randn(3, 5)
        for name, run in {
            "grad": lambda: grad(lambda x: self.op(x, w).sum())(x),
            "vmap(grad)": lambda: vmap(grad(lambda x: self.op(x, w).sum()))(xs),
            "vjp": lambda: vjp(lambda x: self.op(x, w), x)[1](torch.ones(5)),
            "jacrev": lambda: jacrev(lambda x: self.op(x, w))(x),
            "vmap(jacrev)": lambda: vmap(jacrev(lambda x: self.op(x, w)))(xs),
        }.items():
            with self.subTest(name):
                run()
                self.assertEqual(counts()["fwd"], 1, name)
        x = self.x.clone().requires_grad_()
        (g,) = torch.autograd.grad(self.op(x, self.w).sum(), x)
        self.assertEqual(counts(), {"fn": 0, "fwd": 1, "bwd": 1, "fake": 0})  # checked above already
        (g,) = torch.autograd.grad(self.op(x, self.w).sum(), x, create_graph=True)
        g.sum().backward()
        self.assertEqual(counts(), {"fn": 0, "fwd": 2, "bwd": 1, "fake": 0})

    def test_residuals_that_are_inputs_differentiate_twice_right(self):
        # Residuals that are the inputs themselves carry their own history.
        op = torch_autobatch.custom_op(
            unique_op_name("tab_vjp", "sq"), lambda x: x * x, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        op.register_vjp(lambda x: (x * x, x), lambda x, g: 2 * twice(g * x))
        x = torch.randn(4)
        self.assertEqual(hessian(lambda x: op(x).sum())(x), 4 * torch.eye(4))
        self.assertEqual(grad(lambda x: grad(lambda x: op(x).sum())(x).sum())(x), torch.full((4,), 4.0))

    def test_a_residual_mutated_before_backward_is_torchs_error(self):
        def fwd(x):
            t = torch.tanh(x)
            RESIDUAL.append(t)
            return t.clone(), t

        RESIDUAL: list[torch.Tensor] = []
        op = torch_autobatch.custom_op(
            unique_op_name("tab_vjp", "mut"), torch.tanh, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        op.register_vjp(fwd, lambda t, g: g * (1 - t * t))
        x = torch.randn(3, requires_grad=True)
        y = op(x)
        RESIDUAL[0].add_(1)
        with self.assertRaisesRegex(RuntimeError, "modified by an inplace operation"):
            y.sum().backward()

    def test_retain_graph_and_freed_graph(self):
        x, w = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        y = self.op(x, w).sum()
        y.backward(retain_graph=True)
        y.backward()  # the residuals are still there
        x2, w2 = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        plain(x2, w2).sum().backward()
        self.assertEqual((x.grad, w.grad), (2 * x2.grad, 2 * w2.grad))
        self.assertEqual(counts()["bwd"], 2)
        with self.assertRaisesRegex(RuntimeError, "backward through the graph a second time"):
            y.backward()  # freed with the graph, as save_for_backward frees

    def test_calls_on_other_threads_keep_their_own_residuals(self):
        # Residuals belong to the call (a thread-local request, the node's own
        # ctx): threads differentiating the op at once, at different shapes and
        # vmap nestings, each get their own gradients.
        import threading

        results: dict[int, bool] = {}

        def work(i: int) -> None:
            torch.manual_seed(i)
            for _ in range(20):
                xs, w = torch.randn(i + 2, 5), torch.randn(5)
                if i % 2:
                    got = vmap(grad(lambda w, x: self.op(x, w).sum()), in_dims=(None, 0))(w, xs)
                    want = vmap(grad(lambda w, x: plain(x, w).sum()), in_dims=(None, 0))(w, xs)
                else:
                    got = grad(lambda x: self.op(x, w).sum())(xs)
                    want = grad(lambda x: plain(x, w).sum())(xs)
                if not torch.allclose(got, want):
                    results[i] = False
                    return
            results[i] = True

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(results, {0: True, 1: True, 2: True, 3: True})

    def test_saved_tensors_hooks_see_the_residuals(self):
        packed = []
        x, w = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
            y = self.op(x, w)
        self.assertGreaterEqual(len(packed), 2)  # t and w (and the inputs)
        y.sum().backward()

    def test_checkpoint(self):
        x, w = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        torch.utils.checkpoint.checkpoint(self.op, x, w, use_reentrant=False).sum().backward()
        x2, w2 = self.x.clone().requires_grad_(), self.w.clone().requires_grad_()
        plain(x2, w2).sum().backward()
        self.assertEqual((x.grad, w.grad), (x2.grad, w2.grad))

    def test_bwd_that_asks_gets_needs_input_grad(self):
        seen = []

        def bwd(r, g, *, needs_input_grad):
            seen.append(needs_input_grad)
            gx, gw = _bwd(r, g)
            return gx if needs_input_grad[0] else None, gw if needs_input_grad[1] else None

        op = torch_autobatch.custom_op(unique_op_name("tab_vjp", "needs"), _fn, mutates_args=())
        op.register_vjp(_fwd, bwd)
        xs, w = torch.randn(3, 5), self.w
        self.assertEqual(
            vmap(grad(lambda w, x: op(x, w).sum()), in_dims=(None, 0))(w, xs),
            vmap(grad(lambda w, x: plain(x, w).sum()), in_dims=(None, 0))(w, xs),
        )
        self.assertEqual(grad(lambda x: op(x, w).sum())(self.x), grad(lambda x: plain(x, w).sum())(self.x))
        self.assertEqual(seen, [(False, True), (True, False)])

    def test_register_autograd_and_register_vjp_exclude_each_other(self):
        with self.assertRaisesRegex(RuntimeError, "one of register_autograd and register_vjp"):
            self.op.register_autograd(lambda ctx, g: (g, g))
        other = torch_autobatch.custom_op(
            unique_op_name("tab_vjp", "both"), torch.sin, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        other.register_autograd(lambda ctx, g: g)
        with self.assertRaisesRegex(RuntimeError, "one of register_autograd and register_vjp"):
            other.register_vjp(lambda x: (torch.sin(x), x), lambda x, g: g)

    def test_fwd_returning_the_wrong_structure_names_the_op(self):
        op = torch_autobatch.custom_op(
            unique_op_name("tab_vjp", "bad"), torch.sin, mutates_args=(), schema="(Tensor x) -> Tensor"
        )
        op.register_vjp(lambda x: torch.sin(x), lambda r, g: g)
        with self.assertRaisesRegex(TypeError, r"fwd of tab_vjp::bad\w* .* must return \(output, residuals\)"):
            op(torch.randn(2, requires_grad=True))

    def test_fwd_whose_output_is_not_the_ops_is_an_error_on_every_path(self):
        # NOTE [fwd returns what the op returns]: an fwd that returns another
        # dtype or shape would change the op's result only when differentiated.
        bad_fwds = {
            "dtype": lambda x, w: (_fn(x, w).double(), (torch.tanh(x), w)),
            "shape": lambda x, w: (_fn(x, w)[None], (torch.tanh(x), w)),
        }
        xs, w = torch.randn(3, 5), self.w
        paths = {
            ".backward()": lambda op: op(xs[0].clone().requires_grad_(), w).sum().backward(),
            "grad": lambda op: grad(lambda x: op(x, w).sum())(xs[0]),
            "vmap(grad)": lambda op: vmap(grad(lambda x: op(x, w).sum()))(xs),
            "grad(vmap)": lambda op: grad(lambda x: vmap(op, in_dims=(0, None))(x, w).sum())(xs),
            "compiled": lambda op: torch.compile(lambda x: op(x, w).sum(), fullgraph=True)(
                xs[0].clone().requires_grad_()
            ),
        }
        for what, fwd in bad_fwds.items():
            for kind in ("composite", "loop", "rule", "opaque"):
                op = torch_autobatch.custom_op(
                    unique_op_name("tab_vjp", f"bad_{what}_{kind}"),
                    _fn,
                    mutates_args=(),
                    vmap="loop" if kind == "loop" else "auto",
                    compile="opaque" if kind == "opaque" else "fuse",
                )
                op.register_vjp(fwd, _bwd)
                if kind == "rule":
                    op.register_vmap(lambda info, in_dims, x, w: (_fn(x.movedim(in_dims[0], 0), w), 0))
                for path, run in paths.items():
                    with self.subTest(what=what, kind=kind, path=path):
                        torch._dynamo.reset()
                        with self.assertRaisesRegex(Exception, r"fwd of tab_vjp::bad_\w+ \(.*<lambda>\) must return"):
                            run(op)
        op = torch_autobatch.custom_op(unique_op_name("tab_vjp", "bad_msg"), _fn, mutates_args=())
        op.register_vjp(bad_fwds["shape"], _bwd)
        with self.assertRaises(TypeError) as caught:
            op(self.x.clone().requires_grad_(), self.w)
        self.assertExpectedInline(
            str(caught.exception).replace(op._qualname, "OP"),
            """torch_autobatch: the fwd of OP (TestRegisterVjp.test_fwd_whose_output_is_not_the_ops_is_an_error_on_every_path.<locals>.<lambda>) must return the op's output as its function does (fwd runs instead of it when the op is differentiated), but on these inputs fwd returned Tensor(shape=[1, 5], dtype=torch.float32, device=cpu) and the op returns Tensor(shape=[5], dtype=torch.float32) (its fake kernel: register_fake's function, else the op's own function on meta or fake tensors). Make fwd's output match.""",
        )

    def test_fwd_output_is_checked_per_shapes_and_values(self):
        # NOTE [fwd returns what the op returns]: the check's key holds the
        # arguments' metadata and their non-tensor values, so a fwd right for
        # one value of n and wrong for another is caught on the other; the
        # same key is checked once (the fake kernel, counted, runs once).
        fake_runs = []

        def fake(x, n, scale, dtype):
            fake_runs.append(n)
            return x.new_empty(x.shape[0] * n, dtype=dtype)

        def fwd(x, n, scale, dtype):
            out = (x.repeat(min(n, 2)) * scale).to(dtype)  # wrong for n > 2
            return out, None

        op = torch_autobatch.custom_op(
            unique_op_name("tab_vjp", "keyed"),
            lambda x, n, scale, dtype: (x.repeat(n) * scale).to(dtype),
            mutates_args=(),
            schema="(Tensor x, int n, float scale, ScalarType dtype) -> Tensor",
        )
        op.register_fake(fake)
        op.register_vjp(fwd, lambda r, g: (None, None, None, None))
        x = torch.randn(3, requires_grad=True)
        for n in (1, 2, 1, 2):
            self.assertEqual(op(x, n, 0.5, torch.float64).shape, (3 * n,))
        self.assertEqual(fake_runs, [1, 2])
        op(x, 2, 0.25, torch.float64)  # another value: another key
        self.assertEqual(fake_runs, [1, 2, 2])
        with self.assertRaisesRegex(
            TypeError, r"fwd returned Tensor\(shape=\[6\].* the op returns Tensor\(shape=\[9\]"
        ):
            op(x, 3, 0.5, torch.float64)
        # A new fwd (this one ignores dtype) is checked anew, on a key checked before.
        op.register_vjp(lambda x, n, scale, dtype: (x.repeat(n) * scale, None), lambda r, g: (None,) * 4)
        with self.assertRaisesRegex(TypeError, r"dtype=torch.float32.* dtype=torch.float64"):
            op(x, 1, 0.5, torch.float64)

    def test_a_new_fake_kernel_checks_fwd_anew(self):
        # NOTE [fwd returns what the op returns]: the checked keys hold for the
        # fake kernel they were checked against; register_fake (as a method,
        # or torch.library.register_fake by name) clears them, for every path
        # that runs fwd (the kernel, the per-example loop, setup_context under
        # a register_vmap rule).
        xs, w = torch.randn(3, 5), self.w
        paths = {
            ".backward()": lambda op: op(xs[0].clone().requires_grad_(), w).sum().backward(),
            "vmap(grad)": lambda op: vmap(grad(lambda x: op(x, w).sum()))(xs),
        }
        for kind, op in _ops_on_every_vmap_path().items():
            registers = {
                "method": op.register_fake,
                "by name": lambda f, op=op: torch.library.register_fake(op._qualname, f),
            }
            for path, run in paths.items():
                for how, register in registers.items():
                    with self.subTest(kind=kind, path=path, register=how):
                        for _ in range(2):
                            run(op)  # checked against the fake kernel, then cached
                        register(lambda x, w: torch.empty_like(x, dtype=torch.float64))
                        with self.assertRaisesRegex(TypeError, r"dtype=torch.float64"):
                            run(op)
                        op.register_fake(lambda x, w: torch.empty_like(x))

    def test_compiled_with_backward_takes_new_values_and_runs_no_python(self):
        # Residuals are values of the compiled forward graph, not constants of the trace.
        torch._dynamo.reset()
        f = torch.compile(lambda x, w: self.op(x, w).sum(), fullgraph=True)
        for call in range(3):
            x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
            f(x, w).backward()
            c = counts()
            x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            plain(x2, w2).sum().backward()
            self.assertEqual((x.grad, w.grad), (x2.grad, w2.grad))
            if call > 0:  # after the first call's trace: compiled code only
                self.assertEqual(c, {"fn": 0, "fwd": 0, "bwd": 0, "fake": 0})

    def test_compiled_opaque_op_computes_its_residuals_in_the_graph(self):
        # compile="opaque": the op is one extern call whose outputs are its
        # own, so its fake kernel must not hand back residuals (they were fake
        # constants of the graph: "Unexpected fake buffer"); fwd is traced.
        op = torch_autobatch.custom_op(unique_op_name("tab_vjp", "opaque"), _fn, mutates_args=(), compile="opaque")
        op.register_vjp(_fwd, _bwd)
        torch._dynamo.reset()
        f = torch.compile(lambda x, w: op(x, w).sum(), fullgraph=True)
        per_sample = torch.compile(vmap(grad(lambda x, w: op(x, w).sum(), argnums=1), in_dims=(0, None)))
        for _ in range(2):
            x, w = torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True)
            f(x, w).backward()
            x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
            plain(x2, w2).sum().backward()
            self.assertEqual((x.grad, w.grad), (x2.grad, w2.grad))
            xs = torch.randn(3, 5)
            self.assertEqual(
                per_sample(xs, w.detach()),
                vmap(grad(lambda x, w: plain(x, w).sum(), argnums=1), in_dims=(0, None))(xs, w.detach()),
            )

    def test_export_keeps_one_node(self):
        class M(torch.nn.Module):
            def forward(m, x, w):  # noqa: N805
                return self.op(x, w)

        ep = torch.export.export(M(), (self.x, self.w))
        calls = [n for n in ep.graph.nodes if n.op == "call_function"]
        self.assertEqual(len(calls), 1)
        self.assertIs(calls[0].target, self.op._opoverload)


class TestRandomFwdDifferentiatedAgain(TestCase):
    """NOTE [Second derivatives through residuals]: a rerun of a drawing fwd is an error, never other draws."""

    def test_a_drawing_fwd_differentiated_again_raises(self):
        @torch_autobatch.custom_op(unique_op_name("tab_vjp", "noisy"), mutates_args=())
        def noisy(x: torch.Tensor) -> torch.Tensor:
            return x * torch.rand_like(x)

        def fwd(x):
            u = torch.rand_like(x)
            return x * u, u

        noisy.register_vjp(fwd, lambda u, g: 2 * g * u)
        x = torch.randn(5, dtype=torch.float64)
        leaf = x.clone().requires_grad_()
        out = noisy(leaf)
        u = (out / leaf).detach()
        (g,) = torch.autograd.grad(out.sum(), leaf, retain_graph=True)  # a first derivative: the draw's
        self.assertEqual(g, 2 * u)
        paths = {
            "create_graph": lambda: torch.autograd.grad(noisy(leaf).sum(), leaf, create_graph=True),
            "grad(grad)": lambda: grad(lambda x: grad(lambda x: noisy(x).sum())(x).sum())(x),
            "jacrev(jacrev)": lambda: jacrev(jacrev(lambda x: noisy(x).sum()))(x),
        }
        for path, run in paths.items():
            # (jacrev's vmap refuses the draw itself, under its default randomness="error")
            with self.assertRaisesRegex(
                RuntimeError, "fwd of tab_vjp::noisy.* draws random|randomness error", msg=path
            ):
                run()
        with self.assertRaisesRegex(RuntimeError, "fwd of tab_vjp::noisy.* draws random numbers"):
            vmap(grad(lambda x: grad(lambda x: noisy(x).sum())(x).sum()), randomness="different")(x[None])


if __name__ == "__main__":
    run_tests()
