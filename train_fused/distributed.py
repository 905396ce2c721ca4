"""Data-parallel training under torchrun (gloo on CPU), without wrapping the model in DDP.

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


def init_distributed() -> DistContext:
    """Join the torchrun process group when WORLD_SIZE > 1 (gloo: CPU only); single process otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


def broadcast_parameters(ctx: DistContext, module: torch.nn.Module) -> None:
    """Start every rank from rank 0's weights (same seed gives the same init, but don't rely on it)."""
    if not ctx.enabled:
        return
    with torch.no_grad():
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src=0)


def all_reduce_sum(ctx: DistContext, values: torch.Tensor) -> torch.Tensor:
    if ctx.enabled:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def reduce_gradients(ctx: DistContext, params: list[torch.nn.Parameter], stats: torch.Tensor) -> torch.Tensor:
    """Sum gradients and `stats` over ranks in one flat all_reduce; returns the summed stats.

    A parameter that got no gradient on any rank keeps grad None, so Adam skips it exactly as it
    would in a single process; one that got a gradient on some rank only gets the sum.
    """
    if not ctx.enabled:
        return stats
    sizes = [p.numel() for p in params]
    flat = torch.zeros(sum(sizes) + len(params) + stats.numel(), dtype=torch.float32)
    offset = 0
    for i, p in enumerate(params):
        if p.grad is not None:
            flat[offset : offset + sizes[i]] = p.grad.detach().reshape(-1).float()
            flat[sum(sizes) + i] = 1.0
        offset += sizes[i]
    flat[sum(sizes) + len(params) :] = stats.float()
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for i, p in enumerate(params):
        if flat[sum(sizes) + i] > 0:
            grad = flat[offset : offset + sizes[i]].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = grad.clone()
            else:
                p.grad.copy_(grad)
        else:
            p.grad = None
        offset += sizes[i]
    return flat[sum(sizes) + len(params) :].to(stats.dtype)


def destroy(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()
