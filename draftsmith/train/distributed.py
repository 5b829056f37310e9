"""Where the ranks of a training run compute and how they agree.

`torchrun --nproc-per-node N -m draftsmith -- train --run DIR ...` runs DDP (gloo on CPU, NCCL on
GPUs) or FSDP (`train.fsdp`); rank r takes micro-batches r, r+N, ... of each optimizer step, so N
ranks at batch b compute the same update as one rank at batch N*b. Once per step the ranks sum a
few named numbers in one all-reduce (sum_by_name).
"""

import contextlib
import inspect
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from draftsmith import DraftsmithError
from draftsmith.journal import env_rank
from draftsmith.target import bf16_is_fast, pick_device


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank of world (1 outside torchrun), on device."""

    rank: int
    world: int
    device: torch.device


@contextlib.contextmanager
def process_group(device_spec: str) -> Iterator[Ranks]:
    """This process's Ranks, inside the process group when there are several (joined here unless
    the caller already has one, and then left on the way out). Each rank of a GPU node takes the
    GPU of its LOCAL_RANK (pick_device's rule)."""
    rank, world = env_rank()
    device = pick_device(device_spec)
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        if device.type == "cuda":  # device_id: NCCL binds this rank's communicator to its own GPU at once
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    try:
        yield Ranks(rank, world, device)
    finally:
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def resolve_precision(spec: str, device) -> str:
    """`auto` -> bf16 where bf16 matmuls are fast (CUDA with bf16, CPUs with AMX tiles), else fp32.

    Without AMX (e.g. AVX-512-BF16 only) oneDNN's bf16 GEMMs run slower than float32 ones, and
    autocast adds casts on top: measured 1.7x slower per training step on such a CPU.
    """
    if spec != "auto":
        return spec
    return "bf16" if bf16_is_fast(device) else "fp32"


def distribute(objective, ranks: Ranks, fsdp: bool, precision: str = "fp32"):
    """What the loop calls: `objective` itself on one rank; on several, wrapped in DDP, or with
    train.fsdp sharded in place (each decoder layer, then the whole) and returned as is.

    FSDP: with bf16 precision, parameters are gathered in bf16 and gradients reduced in float32
    (MixedPrecisionPolicy). Frozen parameters (the target's embedding the drafter reads) are no
    shard of anything: kept whole on every rank, in bf16 under bf16 precision, so that no forward
    all-gathers a [V, H] table that never changes (the target head is a buffer, never sharded)."""
    if ranks.world > 1 and fsdp:
        # fully_shard is importable from torch.distributed.fsdp from torch 2.6 on (draftsmith
        # allows 2.4): imported only when train.fsdp asks for it
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise DraftsmithError(f"train.fsdp: needs torch >= 2.7 (fully_shard's ignored_params); this is {torch.__version__}")

        frozen = {p for p in objective.parameters() if not p.requires_grad}
        if precision == "bf16":
            for p in frozen:
                p.data = p.data.to(torch.bfloat16)
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if precision == "bf16" else MixedPrecisionPolicy())
        for layer in objective.drafter.layers:
            fully_shard(layer, mp_policy=policy, ignored_params=frozen)
        fully_shard(objective, mp_policy=policy, ignored_params=frozen)
        return objective
    if ranks.world > 1:
        device_ids = [ranks.device.index] if ranks.device.type == "cuda" else None
        return DistributedDataParallel(objective, device_ids=device_ids, broadcast_buffers=False)
    return objective


def sum_by_name(values: dict, ranks: Ranks) -> dict:
    """Each value summed over all ranks, in one all-reduce of one float64 tensor.

    values: {name: a number or a 1-D tensor}; returns {name: a float, or a list of floats for a
    tensor}. A value only rank 0 knows (a decision, a clock) is shared by passing 0 on the others.
    """
    parts, spans, off = [], {}, 0
    for name, v in values.items():
        t = torch.as_tensor(v, dtype=torch.float64).reshape(-1).to(ranks.device)
        spans[name] = (off, off + t.numel(), torch.is_tensor(v))
        parts.append(t)
        off += t.numel()
    flat = torch.cat(parts)
    if ranks.world > 1:
        dist.all_reduce(flat)
    out = flat.tolist()
    return {name: out[a:b] if is_vector else out[a] for name, (a, b, is_vector) in spans.items()}
