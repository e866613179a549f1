"""torch_autobatch quickstart: a Python custom op whose own backward every transform honours.

Run: python examples/quickstart.py   (asserts; prints what it checked)
"""

import torch
from torch.func import grad, jacrev, vjp, vmap

import torch_autobatch

CALLS = [0]


@torch_autobatch.custom_op("quickstart::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    """scale * tanh(x / scale): a smooth clip to (-scale, scale)."""
    CALLS[0] += 1
    return scale * torch.tanh(x / scale)


def setup_context(ctx, inputs, output):
    x, scale = inputs
    ctx.save_for_backward(output)
    ctx.scale = scale


def backward(ctx, grad_out):
    (y,) = ctx.saved_tensors
    # d/dx scale*tanh(x/scale) = 1 - tanh^2 = 1 - (y/scale)^2
    return grad_out * (1 - (y / ctx.scale) ** 2), None


softclip.register_autograd(backward, setup_context=setup_context)


def reference(x, scale):
    return scale * torch.tanh(x / scale)


def main() -> None:
    torch.manual_seed(0)
    x = torch.randn(8, dtype=torch.float64)
    loss = lambda x: softclip(x, 2.0).sum()  # noqa: E731
    ref_loss = lambda x: reference(x, 2.0).sum()  # noqa: E731

    # It is a real operator.
    assert torch.equal(torch.ops.quickstart.softclip(x, 2.0), softclip(x, 2.0))

    # Reverse mode, under every torch.func transform, with the registered backward.
    checks = {
        "x.backward()": (
            lambda: torch.autograd.grad(loss(x.requires_grad_()), x)[0],
            lambda: torch.autograd.grad(ref_loss(x.requires_grad_()), x)[0],
        ),
        "torch.func.grad": (lambda: grad(loss)(x.detach()), lambda: grad(ref_loss)(x.detach())),
        "torch.func.vjp": (
            lambda: vjp(lambda x: softclip(x, 2.0), x.detach())[1](torch.ones(8, dtype=x.dtype))[0],
            lambda: vjp(lambda x: reference(x, 2.0), x.detach())[1](torch.ones(8, dtype=x.dtype))[0],
        ),
        "jacrev": (
            lambda: jacrev(lambda x: softclip(x, 2.0))(x.detach()),
            lambda: jacrev(lambda x: reference(x, 2.0))(x.detach()),
        ),
        "hessian (jacrev(jacrev))": (
            lambda: jacrev(jacrev(loss))(x.detach()),
            lambda: jacrev(jacrev(ref_loss))(x.detach()),
        ),
        "vmap(grad) per-sample": (
            lambda: vmap(grad(loss))(x.detach().view(2, 4)),
            lambda: vmap(grad(ref_loss))(x.detach().view(2, 4)),
        ),
    }
    for name, (got, want) in checks.items():
        torch.testing.assert_close(got(), want())
        print(f"ok  {name}")

    # torch.compile keeps the op as one node and backprops through its backward.
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    xc = x.detach().requires_grad_()
    compiled(xc).backward()
    torch.testing.assert_close(xc.grad, grad(ref_loss)(x.detach()))
    print("ok  torch.compile(fullgraph=True) + .backward()")

    # Forward mode: no jvp registered, so it is derived from softclip itself.
    t = torch.randn_like(x)
    _, tangent = torch.func.jvp(lambda x: softclip(x, 2.0), (x,), (t,))
    _, want = torch.func.jvp(lambda x: reference(x, 2.0), (x,), (t,))
    torch.testing.assert_close(tangent, want)
    torch.testing.assert_close(torch.func.hessian(loss)(x), torch.func.hessian(ref_loss)(x))
    print("ok  torch.func.jvp and torch.func.hessian (forward over reverse)")

    # vmap runs softclip once on the whole batch, not once per example.
    CALLS[0] = 0
    out = vmap(softclip, in_dims=(0, None))(torch.randn(1000, 64), 2.0)
    assert CALLS[0] == 1 and out.shape == (1000, 64), CALLS
    print("ok  vmap over 1000 examples ran softclip once")


if __name__ == "__main__":
    main()
