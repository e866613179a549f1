"""Per-sample gradients for DP-SGD through a custom op whose backward reuses its forward's work.

A small MLP (Linear -> custom `swish` op -> Linear) is called functionally with
torch.func.functional_call; `vmap(grad(loss), in_dims=(None, 0, 0))` gives one
gradient per example in one batched call. Each is clipped to norm C, summed,
and Gaussian noise is added (DP-SGD). `swish` takes its derivative from
`register_vjp`: its `fwd` keeps `sigmoid(x)` for the backward, which then
recomputes nothing. Checked against a per-example Python loop of
torch.autograd.grad, and against the same model with a plain-function swish
(autograd's own derivative), with counters showing that `fwd` and the backward
each ran once, batched.

Run: python examples/per_sample_grads.py   (asserts; prints what it checked)
"""

import time

import torch
from torch.func import functional_call, grad, vmap

import torch_autobatch

CALLS = {"fwd": 0, "bwd": 0}


@torch_autobatch.custom_op("per_sample_grads::swish", mutates_args=())
def swish(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) (SiLU)."""
    return x * torch.sigmoid(x)


def swish_fwd(x: torch.Tensor):
    """Runs instead of swish when it is differentiated: the output and what the backward needs."""
    CALLS["fwd"] += 1
    s = torch.sigmoid(x)
    return x * s, (x, s)


def swish_bwd(residuals, grad_out):
    CALLS["bwd"] += 1
    x, s = residuals
    return grad_out * (s + x * s * (1 - s))  # d/dx x*sigmoid(x), with the forward's sigmoid


swish.register_vjp(swish_fwd, swish_bwd)


def swish_plain(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class MLP(torch.nn.Module):
    def __init__(self, activation, d_in: int = 16, d_hidden: int = 32, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(d_in, d_hidden)
        self.fc2 = torch.nn.Linear(d_hidden, d_out)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


def make_loss(model: torch.nn.Module):
    def loss(params, x, y):  # one example: x (d_in,), y ()
        logits = functional_call(model, params, (x.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, y.unsqueeze(0))

    return loss


def loop_grads(model, params, X, Y):
    """The oracle: torch.autograd.grad once per example, stacked."""
    loss = make_loss(model)
    leaves = {k: v.detach().requires_grad_() for k, v in params.items()}
    per_example = [torch.autograd.grad(loss(leaves, x, y), list(leaves.values())) for x, y in zip(X, Y)]
    return {k: torch.stack([g[i] for g in per_example]) for i, k in enumerate(leaves)}


def clip_and_noise(per_sample, clip_norm, noise_multiplier, generator):
    """DP-SGD: clip each example's whole gradient to clip_norm, sum, add noise, average."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    factor = (clip_norm / (norms + 1e-6)).clamp(max=1.0)
    batch = norms.shape[0]
    clipped = {k: g * factor.view(-1, *[1] * (g.dim() - 1)) for k, g in per_sample.items()}
    noisy = {
        k: (g.sum(0) + noise_multiplier * clip_norm * torch.randn(g.shape[1:], dtype=g.dtype, generator=generator))
        / batch
        for k, g in clipped.items()
    }
    return norms, clipped, noisy


def best_of(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # timings of one thread, as in docs/benchmarks.md; steady on a busy machine
    batch, clip_norm, noise_multiplier = 64, 2.0, 1.1
    model = MLP(swish).double()
    params = {k: v.detach() for k, v in model.named_parameters()}
    X = torch.randn(batch, 16, dtype=torch.float64)
    Y = torch.randint(0, 4, (batch,))
    per_sample_fn = vmap(grad(make_loss(model)), in_dims=(None, 0, 0))

    # 1. vmap(grad) equals the per-example loop of torch.autograd.grad.
    CALLS.update(fwd=0, bwd=0)
    per_sample = per_sample_fn(params, X, Y)
    assert CALLS == {"fwd": 1, "bwd": 1}, CALLS  # fwd and the backward ran once, batched
    CALLS.update(fwd=0, bwd=0)
    expected = loop_grads(model, params, X, Y)
    assert CALLS == {"fwd": batch, "bwd": batch}, CALLS  # ... and once per example in the loop
    for k in params:
        assert per_sample[k].shape == (batch, *params[k].shape), k
        torch.testing.assert_close(per_sample[k], expected[k], rtol=1e-10, atol=1e-12)
    print(
        f"ok  vmap(grad) per-sample gradients ({batch} examples, {len(params)} tensors) "
        "== per-example torch.autograd.grad loop; fwd and the backward ran once under vmap"
    )

    # 2. The registered backward is the swish derivative: the same model with a plain swish.
    plain = MLP(swish_plain).double()
    plain.load_state_dict(model.state_dict())
    reference = vmap(grad(make_loss(plain)), in_dims=(None, 0, 0))(params, X, Y)
    for k in params:
        torch.testing.assert_close(per_sample[k], reference[k], rtol=1e-10, atol=1e-12)
    print("ok  custom backward == autograd of the plain-function model")

    # 3. DP-SGD: per-sample clipping to norm C, Gaussian noise, one SGD step.
    norms, clipped, noisy = clip_and_noise(per_sample, clip_norm, noise_multiplier, torch.Generator().manual_seed(1))
    _, clipped_loop, _ = clip_and_noise(expected, clip_norm, noise_multiplier, torch.Generator().manual_seed(1))
    clipped_norms = torch.stack([g.flatten(1).norm(dim=1) for g in clipped.values()]).norm(dim=0)
    assert (clipped_norms <= clip_norm + 1e-9).all(), clipped_norms.max()
    small = norms <= clip_norm  # left as they were
    torch.testing.assert_close(clipped_norms[small], norms[small])
    for k in params:
        torch.testing.assert_close(clipped[k], clipped_loop[k], rtol=1e-10, atol=1e-12)
        assert noisy[k].shape == params[k].shape and torch.isfinite(noisy[k]).all(), k
    new_params = {k: p - 0.1 * noisy[k] for k, p in params.items()}  # the DP-SGD update
    assert all(not torch.equal(new_params[k], params[k]) for k in params)
    n_clipped = int((~small).sum())
    print(
        f"ok  clipped {n_clipped}/{batch} per-sample gradients to norm <= {clip_norm}, "
        f"added noise (sigma = {noise_multiplier} * C), took one SGD step"
    )

    # 4. Speed: one batched call against the Python loop.
    t_vmap = best_of(lambda: per_sample_fn(params, X, Y))
    t_loop = best_of(lambda: loop_grads(model, params, X, Y))
    print(
        f"ok  batch {batch}: vmap(grad) {t_vmap * 1e3:.2f} ms, loop {t_loop * 1e3:.2f} ms, "
        f"speed-up {t_loop / t_vmap:.1f}x"
    )


if __name__ == "__main__":
    main()
