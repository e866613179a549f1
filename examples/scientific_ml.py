"""Forces and Hessians of a Lennard-Jones energy written as a custom op with its own VJP and JVP.

`lj_energy(x, epsilon, sigma)` takes N particles' positions x (N, 3) and returns
the total pair energy sum_{i<j} 4 eps ((s/r)^12 - (s/r)^6). Its gradient is
hand-written once, `energy_grad`, and used by both registered rules: the VJP
(register_autograd) and the JVP (register_jvp). The oracle is the same energy
as a plain Python function under the same torch.func transforms:

- forces = -torch.func.grad(energy)(x), the registered VJP;
- directional derivative by torch.func.jvp, the registered JVP;
- Hessian by torch.func.hessian (= jacfwd(jacrev)), jacrev(jacrev) and
  jacfwd(jacfwd); physics checks: symmetric, each row sums to zero
  (translation invariance), forces sum to zero;
- vmap of the forces over a batch of configurations (the op runs once).

Run: python examples/scientific_ml.py   (asserts; prints what it checked)
"""

import torch
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import torch_autobatch

CALLS = {"forward": 0, "vjp": 0, "jvp": 0}


def pair_terms(x: torch.Tensor, sigma: float):
    """Displacements d_ij = x_i - x_j, squared distances (1 on the diagonal), mask i != j."""
    d = x.unsqueeze(-2) - x.unsqueeze(-3)  # (N, N, 3)
    eye = torch.eye(x.shape[-2], dtype=x.dtype)
    r2 = (d * d).sum(-1) + eye
    return d, (sigma * sigma) / r2, r2, 1 - eye


def energy_plain(x: torch.Tensor, epsilon: float = 1.0, sigma: float = 1.0) -> torch.Tensor:
    _, s2, _, off = pair_terms(x, sigma)
    s6 = s2**3
    return 0.5 * (4 * epsilon * (s6 * s6 - s6) * off).sum((-1, -2))  # 0.5: each pair twice


@torch_autobatch.custom_op("scientific_ml::lj_energy", mutates_args=())
def lj_energy(x: torch.Tensor, epsilon: float, sigma: float) -> torch.Tensor:
    CALLS["forward"] += 1
    return energy_plain(x, epsilon, sigma)


def energy_grad(x: torch.Tensor, epsilon: float, sigma: float) -> torch.Tensor:
    """dE/dx_i = sum_j 2 f'(r2_ij) d_ij, with f(r2) = 4 eps ((s2/r2)^6 - (s2/r2)^3)."""
    d, s2, r2, off = pair_terms(x, sigma)
    s6 = s2**3
    f_prime = 4 * epsilon * (-6 * s6 * s6 + 3 * s6) / r2 * off
    return 2 * (f_prime.unsqueeze(-1) * d).sum(-2)


def setup_context(ctx, inputs, output):
    x, ctx.epsilon, ctx.sigma = inputs
    ctx.save_for_backward(x)
    ctx.save_for_forward(x)


def vjp_rule(ctx, grad_energy):
    CALLS["vjp"] += 1
    (x,) = ctx.saved_tensors
    grad_x = grad_energy.unsqueeze(-1).unsqueeze(-1) * energy_grad(x, ctx.epsilon, ctx.sigma)
    return grad_x, None, None


def jvp_rule(ctx, x_tangent, epsilon_tangent, sigma_tangent):
    CALLS["jvp"] += 1
    (x,) = ctx.saved_tensors
    return (energy_grad(x, ctx.epsilon, ctx.sigma) * x_tangent).sum((-1, -2))


lj_energy.register_autograd(vjp_rule, setup_context=setup_context)
lj_energy.register_jvp(jvp_rule)


def configuration(generator: torch.Generator, jitter: float = 0.08) -> torch.Tensor:
    """8 particles near the corners of a cube of side 1.12 (near the LJ minimum)."""
    corners = torch.cartesian_prod(*[torch.tensor([0.0, 1.12], dtype=torch.float64)] * 3)
    return corners + jitter * torch.randn(8, 3, dtype=torch.float64, generator=generator)


def main() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = configuration(gen)
    op = lambda x: lj_energy(x, 1.0, 1.0)  # noqa: E731
    close = dict(rtol=1e-10, atol=1e-10)

    torch.testing.assert_close(op(x), energy_plain(x), **close)
    print(f"ok  energy of 8 particles: {op(x).item():.6f} (== plain function)")

    CALLS.update(vjp=0, jvp=0)
    forces = -grad(op)(x)
    assert CALLS["vjp"] == 1, CALLS
    torch.testing.assert_close(forces, -grad(energy_plain)(x), **close)
    x_leaf = x.clone().requires_grad_()
    torch.testing.assert_close(forces, -torch.autograd.grad(op(x_leaf), x_leaf)[0], **close)
    torch.testing.assert_close(forces.sum(0), torch.zeros(3, dtype=x.dtype), rtol=0, atol=1e-10)
    print("ok  forces = -grad(energy): registered VJP == plain function == autograd.grad; sum to 0")

    tangent = torch.randn(8, 3, dtype=torch.float64, generator=gen)
    value, directional = jvp(op, (x,), (tangent,))
    assert CALLS["jvp"] == 1, CALLS
    want_value, want_directional = jvp(energy_plain, (x,), (tangent,))
    torch.testing.assert_close(value, want_value, **close)
    torch.testing.assert_close(directional, want_directional, **close)
    torch.testing.assert_close(directional, -(forces * tangent).sum(), **close)
    print("ok  jvp: registered JVP == plain function == -<forces, tangent>")

    want_hessian = hessian(energy_plain)(x)
    for name, transform, rule in [
        ("hessian", hessian, "vjp"),  # jacfwd(jacrev)
        ("jacrev(jacrev)", lambda f: jacrev(jacrev(f)), "vjp"),
        ("jacfwd(jacfwd)", lambda f: jacfwd(jacfwd(f)), "jvp"),
    ]:
        CALLS.update(vjp=0, jvp=0)
        got = transform(op)(x)
        assert got.shape == (8, 3, 8, 3) and CALLS[rule] > 0, (name, got.shape, CALLS)
        torch.testing.assert_close(got, want_hessian, **close)
    flat = want_hessian.reshape(24, 24)
    torch.testing.assert_close(flat, flat.T, **close)
    torch.testing.assert_close(want_hessian.sum(2), torch.zeros(8, 3, 3, dtype=x.dtype), rtol=0, atol=1e-8)
    print(
        "ok  Hessian (8, 3, 8, 3) by hessian, jacrev(jacrev) (registered VJP), jacfwd(jacfwd) "
        "(registered JVP) == plain function; symmetric; rows sum to 0"
    )

    batch = torch.stack([configuration(gen) for _ in range(32)])
    CALLS.update(forward=0, vjp=0, jvp=0)
    batched_forces = vmap(lambda x: -grad(op)(x))(batch)
    assert CALLS == {"forward": 1, "vjp": 1, "jvp": 0}, CALLS  # once each, batched
    torch.testing.assert_close(batched_forces, vmap(lambda x: -grad(energy_plain)(x))(batch), **close)
    torch.testing.assert_close(batched_forces, torch.stack([-grad(op)(c) for c in batch]), **close)
    print("ok  vmap(forces) over 32 configurations: the op and its VJP ran once, batched; == plain function == loop")


if __name__ == "__main__":
    main()
