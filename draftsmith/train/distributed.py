"""Where the ranks of a training run compute and how they agree.

`torchrun --nproc-per-node N -m draftsmith -- train --run DIR ...` runs DDP (gloo on CPU, NCCL on
GPUs) or FSDP (`train.fsdp`); rank r takes micro-batches r, r+N, ... of each optimizer step, so N
ranks at batch b compute the same update as one rank at batch N*b. Once per step the ranks sum a
few named numbers in one all-reduce (sum_by_name).
"""

import contextlib
import datetime
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from draftsmith import DraftsmithError, one_line
from draftsmith.journal import env_rank
from draftsmith.host import bf16_is_fast, pick_device


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: rank of world (1 outside torchrun), on device."""

    rank: int
    world: int
    device: torch.device


# How long a rank waits in a collective before the group gives up on the others. The longest lawful wait is
# the other ranks' while rank 0 alone writes a checkpoint (on_rank0: ~11 GB written and fsynced at Kimi-K2.5's
# widths, minutes on network storage) or reads the target's head; NCCL's default, 10 minutes, would abort a healthy
# run there. A rank that really hangs is still told by the stall line and `draftsmith status` long before this.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=60)


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
            dist.init_process_group("nccl", device_id=device, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
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
    all-gathers a [V, H] table that never changes (the target head is a buffer, never sharded).
    Under bf16 the target head [Dv, H] is stored in bf16 on every path (one rank, DDP, FSDP)."""
    if precision == "bf16":
        # the teacher's head [Dv, H] only ever enters a matmul under autocast, which rounds it to
        # bf16 anyway: stored in bf16 it computes the same numbers in half the memory, on any world
        objective.target_head = objective.target_head.to(torch.bfloat16)
    if ranks.world > 1 and fsdp:
        # fully_shard is importable from torch.distributed.fsdp from torch 2.6 on (draftsmith
        # allows 2.4): imported only when train.fsdp asks for it
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if "ignored_params" not in inspect.signature(fully_shard).parameters:
            raise DraftsmithError("train.fsdp: needs torch >= 2.7 (fully_shard's ignored_params); "
                                  f"this is {torch.__version__}")

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
        # gradient_as_bucket_view: each .grad is a view into DDP's all-reduce bucket instead of a
        # second copy of every gradient; accumulation under no_sync and clip_grad_norm_'s in-place
        # scaling write into the same memory
        return DistributedDataParallel(objective, device_ids=device_ids, gradient_as_bucket_view=True,
                                       **NO_BUFFER_SYNC)
    return objective


# the buffers (the frozen target head, fc's input scale) are the same on every rank: no copy from rank 0 before
# each forward. torch 2.13 renamed the switch (`broadcast_buffers` now warns, a FutureWarning on every rank); the
# GPU machines' torch 2.11 may only know the old name
NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                  if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                  else {"broadcast_buffers": False})


def sum_by_name(values: dict, ranks: Ranks) -> dict:
    """Each value summed over all ranks, in one all-reduce of one float64 tensor.

    values: {name: a number or a 1-D tensor}; returns {name: a float, or a list of floats for a
    tensor}. A value only rank 0 knows (a decision, a clock) is shared by passing 0 on the others.
    """
    # tensors (already on the device) first, then the plain numbers as one host tensor moved in a
    # single copy: one host-to-device transfer per call, not one per number (each a sync on CUDA)
    tensors = {k: v for k, v in values.items() if torch.is_tensor(v)}
    numbers = {k: float(v) for k, v in values.items() if not torch.is_tensor(v)}
    parts, spans, off = [], {}, 0
    for name, v in tensors.items():
        t = v.to(ranks.device, torch.float64).reshape(-1)
        spans[name] = (off, off + t.numel(), True)
        parts.append(t)
        off += t.numel()
    for name in numbers:
        spans[name] = (off, off + 1, False)
        off += 1
    if numbers:
        parts.append(torch.tensor(list(numbers.values()), dtype=torch.float64).to(ranks.device))
    flat = torch.cat(parts)
    if ranks.world > 1:
        dist.all_reduce(flat)
    out = flat.tolist()
    return {name: out[a:b] if is_vector else out[a] for name, (a, b, is_vector) in spans.items()}


def on_rank0(fn: Callable[[], Any], ranks: Ranks) -> Any:
    """fn() run on rank 0 alone (it reads or writes files); its result, a small picklable object,
    sent to every rank in one broadcast_object_list. An error of fn is raised on every rank as
    the same one line (rank 0 raises its own), where rank 0 failing alone would leave the others
    waiting in their next collective. The broadcast also holds the others until fn is done."""
    if ranks.world == 1:
        return fn()
    box: list = [None, None]  # [result, error line]
    error = None
    if ranks.rank == 0:
        try:
            box[0] = fn()
        except Exception as e:  # noqa: BLE001 - every kind must reach the other ranks, then rank 0 re-raises it
            error = e
            box[1] = (str(e) if isinstance(e, DraftsmithError)
                      else f"rank 0: {type(e).__name__}: {one_line(str(e))[:300]}")
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[1] is not None:
        raise DraftsmithError(box[1])
    return box[0]


def first_refusal(line: str | None, ranks: Ranks) -> None:
    """Each rank's own check (`line`: why it refuses, or None) decided together: when any rank refuses, every rank
    raises the first refusal's line, rank order, as a DraftsmithError (one rank raising alone would leave the others
    waiting in their next collective)."""
    lines = [line]
    if ranks.world > 1:
        lines = [None] * ranks.world
        dist.all_gather_object(lines, line)
    first = next((x for x in lines if x is not None), None)
    if first is not None:
        raise DraftsmithError(first)


def from_rank0(tensors: list | None, ranks: Ranks) -> list:
    """Rank 0's `tensors` (a list of tensors or None) on every rank, on the CPU: first their
    shapes and dtypes (one broadcast_object_list), then each tensor's bytes (dist.broadcast, on
    this rank's device: the GPU under NCCL). A tensor listed twice (a tied head) is sent once.
    The other ranks pass None; rank 0 gets its own tensors back."""
    if ranks.world == 1:
        return list(tensors)
    head: list = [None]
    if ranks.rank == 0:
        first: dict[int, int] = {}  # id(tensor) -> index of its first listing
        head[0] = []
        for i, t in enumerate(tensors):
            if t is None:
                head[0].append(None)
            elif id(t) in first:
                head[0].append(("same", first[id(t)]))
            else:
                first[id(t)] = i
                head[0].append((tuple(t.shape), t.dtype))
    dist.broadcast_object_list(head, src=0)
    out: list = []
    for i, desc in enumerate(head[0]):
        if desc is None:
            out.append(None)
        elif desc[0] == "same":
            out.append(out[desc[1]])
        elif ranks.rank == 0:
            t = tensors[i].contiguous()
            # sent as bytes: gloo and NCCL move uint8 whatever the dtype (bf16, fp8)
            dist.broadcast(t.reshape(-1).view(torch.uint8).to(ranks.device), src=0)
            out.append(tensors[i])
        else:
            shape, dtype = desc
            buf = torch.empty(math.prod(shape) * torch.empty((), dtype=dtype).element_size(), dtype=torch.uint8,
                              device=ranks.device)
            dist.broadcast(buf, src=0)
            out.append(buf.cpu().view(dtype).reshape(shape))
    return out
