"""torchrun support for every stage: ranks, one process group, and gradient reduction.

Training is data-parallel without wrapping the model in DDP.
Every rank builds the same global batches and trains on its own slice of each. Gradients are
summed over ranks together with the loss sums and the target-token count in ONE all_reduce, and
only then divided by the global token count: the update is the one a single process would make
on the whole global batch (fairseq normalises the same way).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_world() -> tuple[int, int]:
    """(RANK, WORLD_SIZE) as torchrun sets them; (0, 1) outside torchrun."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def is_main_process() -> bool:
    return rank_world()[0] == 0


def local_cuda_index() -> int:
    """The GPU of this rank: torchrun's LOCAL_RANK (0 outside torchrun)."""
    index = int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        from prlmfuse.errors import UserError

        raise UserError(
            f"LOCAL_RANK {index} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
            "start torchrun with --nproc-per-node at most the number of GPUs"
        )
    return index


def join_group(device: torch.device | str | None = None) -> bool:
    """Join torchrun's process group when WORLD_SIZE > 1; True when this call created it.

    On a CUDA device the group is NCCL's (gradients stay on the GPU); on the CPU it is gloo's.
    """
    if rank_world()[1] <= 1 or dist.is_initialized():
        return False
    if device is not None and torch.device(device).type == "cuda":
        # NCCL binds each rank to the current device: set it before the group exists.
        torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend="nccl", device_id=torch.device(device))
    else:
        dist.init_process_group(backend="gloo")
    return True


def init_distributed(device: torch.device | str | None = None) -> DistContext:
    """The process group's context under torchrun (WORLD_SIZE > 1); a single process otherwise."""
    if rank_world()[1] <= 1:
        return DistContext()
    join_group(device)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())


def _comm_device() -> torch.device:
    """Where collective tensors must live: NCCL reduces only CUDA tensors, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier(ctx: DistContext | None = None) -> None:
    """Wait for every rank (joining the group first when called outside a training context)."""
    if ctx is None:
        ctx = init_distributed()
    if ctx.enabled:
        dist.barrier()


def all_reduce_max(ctx: DistContext, value: int) -> int:
    """The largest `value` over ranks; every rank leaves with it (so it is also a barrier)."""
    if not ctx.enabled:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def broadcast_parameters(ctx: DistContext, module: torch.nn.Module) -> None:
    """Start every rank from rank 0's weights (same seed gives the same init, but don't rely on it)."""
    if not ctx.enabled:
        return
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)


def all_reduce_sum(ctx: DistContext, values: torch.Tensor) -> torch.Tensor:
    if ctx.enabled:
        reduced = values.to(_comm_device())
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM)
        values.copy_(reduced)
    return values


def reduce_gradients(ctx: DistContext, params: list[torch.nn.Parameter], stats: torch.Tensor) -> torch.Tensor:
    """Sum gradients and `stats` over ranks in one flat all_reduce; returns the summed stats.

    A parameter that got no gradient on any rank keeps grad None, so Adam skips it exactly as it
    would in a single process; one that got a gradient on some rank only gets the sum.
    """
    if not ctx.enabled:
        return stats
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + len(params) + stats.numel(), dtype=torch.float32, device=_comm_device())
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            flat[offset : offset + sizes[i]] = p.grad.detach().reshape(-1).float()
            flat[sum(sizes) + i] = 1.0
        offset += sizes[i]
    flat[sum(sizes) + len(params) :] = stats.to(flat.device, torch.float32)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    has_grad = flat[sum(sizes) : sum(sizes) + len(params)].cpu()  # one device sync, not one per parameter
    offset = 0
    for i, p in enumerate(params):
        if has_grad[i] > 0:
            grad = flat[offset : offset + sizes[i]].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
        else:
            p.grad = None
        offset += sizes[i]
    return flat[sum(sizes) + len(params) :].to(stats.device, stats.dtype)


def destroy(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
