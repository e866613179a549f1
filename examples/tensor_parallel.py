"""A tensor-parallel layer whose activation is a custom op on DTensors, with no sharding rule written.

Two worker processes (torch.multiprocessing spawn, gloo, CPU) split an MLP
with torch.distributed.tensor.parallel: ``fc1`` column-wise
(``ColwiseParallel(use_local_output=False)``, so its output stays a DTensor
sharded on the hidden dim), then the activation ``softclip`` -- a
``torch_autobatch.custom_op`` with a hand-written backward and *no*
``register_sharding`` rule -- then ``fc2`` row-wise. The hidden size, 7, does
not divide by the 2 ranks: the shards are uneven (4 and 3 columns).

DTensor has no rule for ``softclip``, so it receives the op's function, and
each torch op inside runs on the shards (NOTE [Subclasses receive the
function] in torch_autobatch/graphs/_subclass.py), while the gradient is the op's own
backward. The parent process checks, against a single-process run of the same
model, the output, every parameter's gradient (gathered from its shards), and
that the op's backward ran on the shards in each worker. Workers write their
results to files in a temporary directory; every wait has a timeout, and any
failure exits non-zero.

Run: python examples/tensor_parallel.py   (asserts; prints what it checked; ~10-20 s)
"""

import datetime
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_autobatch

WORLD_SIZE, BATCH, HIDDEN = 2, 6, 7
TIMEOUT_S = 90.0  # a safety net for a busy machine: it takes ~15 s


@torch_autobatch.custom_op("tensor_parallel_example::softclip", mutates_args=())
def softclip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return scale * torch.tanh(x / scale)


BACKWARD_RAN_ON: list[str] = []


def setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[1]


def backward(ctx, grad_out):
    (y,) = ctx.saved_tensors
    BACKWARD_RAN_ON.append(type(grad_out).__name__)
    return grad_out * (1 - (y / ctx.scale) ** 2), None


softclip.register_autograd(backward, setup_context=setup_context)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(softclip(self.fc1(x), 1.5))


def make_data():
    torch.manual_seed(0)
    return MLP().double(), torch.randn(BATCH, 8, dtype=torch.float64)


def run(model, x):
    """The output and each parameter's gradient (gathered whole, for a DTensor)."""
    out = model(x)
    out.square().sum().backward()
    # A DTensor gathered whole; fc2's output is a local tensor still awaiting its all-reduce (clone waits).
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.clone()  # noqa: E731
    return full(out).detach(), {k: full(p.grad).detach() for k, p in model.named_parameters()}


def worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        mesh = init_device_mesh("cpu", (WORLD_SIZE,))
        model, x = make_data()  # the same seed: the same parameters and input on each rank
        plan = {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()}
        parallelize_module(model, mesh, plan)
        shard_cols = model.fc1.weight.to_local().shape[0]
        out, grads = run(model, x)
        torch.save(
            {"out": out, "grads": grads, "backward_ran_on": BACKWARD_RAN_ON, "shard_cols": shard_cols},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
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
            out, grads = run(*make_data())  # the single-process reference, while the workers run
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
    for r in results:
        torch.testing.assert_close(r["out"], out, **close)
        for k in grads:
            torch.testing.assert_close(r["grads"][k], grads[k], **close)
        assert r["backward_ran_on"] == ["DTensor"], r["backward_ran_on"]  # the op's own backward, on the shards
    cols = [r["shard_cols"] for r in results]
    assert sorted(cols) == [3, 4], cols
    print(
        f"ok  tensor parallel (gloo, {WORLD_SIZE} processes, hidden {HIDDEN} in uneven shards {cols}): "
        f"softclip on DTensors with no sharding rule, output == one process"
    )
    print("ok  every parameter's gradient (gathered) == one process; the op's registered backward ran on the shards")
    print(f"ok  finished in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
