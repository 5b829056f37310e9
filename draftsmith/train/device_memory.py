"""Before the first step on a GPU: the memory the step needs, by the estimate's own rule (estimate.train_memory, the
figure `draftsmith estimate` prints), against what the device has free now.

A training run that starts while another process holds the GPU (the vLLM server of a generate or extract that did
not stop, a user's own server) runs out of memory in its first step, minutes after a long load, with CUDA's traceback
that reads like a bug in draftsmith. So the stage asks first: when the device has less free than the step needs and
other processes hold some of it, the stage refuses in one line naming them (nvidia-smi's compute processes: pid,
name, memory); when nothing else holds it and the device is simply too small by the estimate, one note says so and
names `draftsmith estimate`, whose train line lists the settings that fit (the estimate is a first-order model:
training is not refused on it alone). Each rank checks its own device; a refusal on any is every rank's."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from draftsmith.estimate import HARDWARE, target_shape, train_memory
from draftsmith.released import as_trained
from draftsmith.train.distributed import Ranks, first_refusal

GB = 1e9
GPU_PROFILE = "h100"  # the rules the estimate applies to a GPU (bf16 on CUDA); the size is the device's own


def compute_processes() -> list[str]:
    """The other processes holding GPU memory, as nvidia-smi lists them ("pid 4242 (python3) 61,440 MiB"); empty
    where nvidia-smi is absent or says nothing."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        p = subprocess.run([smi, "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in p.stdout.splitlines() if p.returncode == 0 else []:
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) != os.getpid():
            mib = f"{int(parts[2]):,} MiB" if parts[2].isdigit() else parts[2]
            out.append(f"pid {parts[0]} ({Path(parts[1]).name}) {mib}")
    return out


def step_bytes(cfg, info, draft_vocab: int, num_aux: int, world: int, total: float) -> float:
    """Peak bytes per device of one training step by the estimate's rule (estimate.train_memory) for this target."""
    cfg = as_trained(cfg)  # a released drafter (train.init_from) is built with its own layers, not the settings'
    shape = target_shape(Path(info.path) / "config.json", info.name, train=cfg.train)
    return train_memory(cfg.train, shape, replace(HARDWARE[GPU_PROFILE], mem=total), world, draft_vocab,
                        num_aux)["total"]


def check_free_memory(cfg, info, draft_vocab: int, num_aux: int, ranks: Ranks, say: Callable[[str], None], *,
                      mem_get_info: Callable = torch.cuda.mem_get_info,
                      holders: Callable[[], list[str]] = compute_processes) -> None:
    """On a CUDA device: refuse (DraftsmithError, on every rank) when the step needs more than the device has free
    and other processes hold memory on it; a note when the device is too small by the estimate alone. Nothing on
    other devices."""
    if ranks.device.type != "cuda":
        return
    free, total = mem_get_info(ranks.device)
    need = step_bytes(cfg, info, draft_vocab, num_aux, ranks.world, total)
    refusal = None
    if free < need:
        others = holders()
        where = f"{ranks.device} (rank {ranks.rank})" if ranks.world > 1 else str(ranks.device)
        if others:
            refusal = (f"train: one step needs ~{need / GB:.1f} GB on {where} (estimate.train_memory, as `draftsmith "
                       f"estimate` prints it), but {free / GB:.1f} of {total / GB:.1f} GB are free; held by "
                       f"{'; '.join(others)}: stop what holds it (a vLLM server a stage or you started), or lower "
                       "train.batch_tokens")
        else:
            say(f"note: one step needs ~{need / GB:.1f} GB on {where} by the estimate, more than its "
                f"{free / GB:.1f} GB free of {total / GB:.1f}; it may run out of memory (`draftsmith estimate` "
                "names settings that fit)")
    first_refusal(refusal, ranks)
