"""A custom op inside a model trained with DistributedDataParallel (CPU, gloo, 2 processes).

Two worker processes, started with torch.multiprocessing (spawn), each train one
step of the same model (Linear -> custom `softclip` op with a hand-written
backward -> Linear) on their half of a batch; DDP all-reduces the gradients
through the op's registered backward. Each worker also computes per-sample
gradients with vmap(grad) over torch.func.functional_call. The parent process
checks, against a single-process run on the whole batch, that the averaged
gradients, the updated parameters and the per-sample gradients all match.
Workers write their results to files in a temporary directory; every wait has
a timeout, and any failure exits non-zero.

Run: python examples/distributed.py   (asserts; prints what it checked; ~10-20 s)
"""

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.func import functional_call, grad, vmap

import torch_autobatch

WORLD_SIZE, BATCH = 2, 16
TIMEOUT_S = 90.0  # a safety net for a busy machine: it takes ~20 s


@torch_autobatch.custom_op("distributed_example::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


def setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def backward(ctx, grad_out):
    (y,) = ctx.saved_tensors
    return grad_out * (1 - (y / ctx.scale) ** 2), None


softclip.register_autograd(backward, setup_context=setup_context)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(softclip(self.fc1(x), 1.5)).squeeze(-1)


def make_data():
    torch.manual_seed(0)
    model = Model().double()
    x = torch.randn(BATCH, 8, dtype=torch.float64)
    y = torch.randn(BATCH, dtype=torch.float64)
    return model, x, y


def loss_fn(model, x, y):
    return torch.nn.functional.mse_loss(model(x), y)


def per_sample_grads(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(params, xi, yi):
        return loss_fn(lambda a: functional_call(model, params, (a,)), xi[None], yi[None])

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def one_step(model, module, x, y):
    """One SGD step of model (module, or DDP around it); returns module's grads and parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    loss_fn(model, x, y).backward()
    grads = {k: p.grad.detach().clone() for k, p in module.named_parameters()}
    optimizer.step()
    return grads, {k: p.detach().clone() for k, p in module.named_parameters()}


def worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        model, x, y = make_data()  # the same seed: the same initial parameters on each rank
        shard = slice(rank * BATCH // WORLD_SIZE, (rank + 1) * BATCH // WORLD_SIZE)
        x, y = x[shard], y[shard]
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        psg = per_sample_grads(model, x, y)  # functional_call on DDP's module
        grads, params = one_step(ddp, model, x, y)
        torch.save({"grads": grads, "params": params, "per_sample": psg}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out_dir:
        workers = mp.spawn(worker, args=(free_port(), out_dir), nprocs=WORLD_SIZE, join=False)
        deadline = time.monotonic() + TIMEOUT_S
        try:
            # The single-process reference on the whole batch, while the workers run.
            model, x, y = make_data()
            psg = per_sample_grads(model, x, y)
            grads, params = one_step(model, model, x, y)
            while not workers.join(timeout=1.0):  # raises if a worker failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the workers were still running after {TIMEOUT_S} s")
        finally:
            for p in workers.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(5)
        results = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(WORLD_SIZE)]

    close = dict(rtol=1e-10, atol=1e-12)
    for k in grads:
        for r in results:
            torch.testing.assert_close(r["grads"][k], grads[k], **close)
            torch.testing.assert_close(r["params"][k], params[k], **close)
        torch.testing.assert_close(torch.cat([r["per_sample"][k] for r in results]), psg[k], **close)
        torch.testing.assert_close(psg[k].mean(0), grads[k], **close)
    print(
        f"ok  DDP (gloo, {WORLD_SIZE} processes) gradients and updated parameters "
        f"== one process on the whole batch of {BATCH}"
    )
    print("ok  per-sample gradients (vmap(grad)) in each worker == single-process ones; their mean == the gradient")
    print(f"ok  finished in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
