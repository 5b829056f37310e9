"""Checkpoints: written, pruned, found, loaded (docs/run-directory.md, train/).

    checkpoints/step_{N}/   model.safetensors, drafter.json, optimizer.pt, rng.safetensors,
                            state.json (written last; a folder is complete when it has it);
                            built as a hidden temporary folder and renamed into place
    final/                  the last weights, same format

A run killed at any point resumes from its newest checkpoint to the same final weights as a run
never interrupted (model, optimizer, scheduler, data position and RNG are all restored).
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from draftsmith import DraftsmithError, one_line
from draftsmith.model import FC_INPUT_SCALE
from draftsmith.rundir import naming_full_disk, read_json_object, replace_dir

CKPT_WEIGHTS, CKPT_META, CKPT_OPTIM, CKPT_RNG, CKPT_STATE = (
    "model.safetensors", "drafter.json", "optimizer.pt", "rng.safetensors", "state.json")


def complete_checkpoints(ck_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete step_N folder in `ck_dir`, oldest first."""
    out = []
    if ck_dir.is_dir():
        for d in ck_dir.iterdir():
            if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and (d / CKPT_STATE).is_file():
                out.append((int(d.name[5:]), d))
    return sorted(out)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(folder)


def write_checkpoint(dest: Path, model_sd: dict, meta: dict, optim: dict, rng: dict, state: dict) -> None:
    """Build the checkpoint in a hidden temporary folder beside `dest`, state.json last, then
    rename it into place: a folder named step_N (or final) is always complete."""
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with naming_full_disk(dest):  # a full disk: one line naming the checkpoint, no half folder
            tmp.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in model_sd.items()}, str(tmp / CKPT_WEIGHTS), metadata={"format": "pt"})
            (tmp / CKPT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            with open(tmp / CKPT_OPTIM, "wb") as f:  # (a file object: torch then chains the OSError behind its own error)
                torch.save(optim, f)
            save_file(rng, str(tmp / CKPT_RNG))
            (tmp / CKPT_STATE).write_text(json.dumps(state, indent=2, sort_keys=True, default=float) + "\n")
            _fsync_tree(tmp)
            replace_dir(tmp, dest)  # final/ may be rewritten: swapped whole, never mixed
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(dest.parent)


def prune_checkpoints(ck_dir: Path, keep: int) -> None:
    for _, d in complete_checkpoints(ck_dir)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def clear_for_attempt(folder: Path, fingerprint: str, say) -> None:
    """Rank 0, before an attempt: remove a killed attempt's temporary folders; move the
    checkpoints of a run with another fingerprint (other settings or inputs) to previous/, so
    that training starts over; else remove final/ (rewritten at the end of this attempt)."""
    ck_dir, final_dir = folder / "checkpoints", folder / "final"
    for stale in list(folder.glob(".step_*")) + list(ck_dir.glob(".step_*")) + list(folder.glob(".final.*")):
        shutil.rmtree(stale, ignore_errors=True)  # temporary folders of a killed attempt
    newest = complete_checkpoints(ck_dir)

    def other_run(ck: Path) -> bool:
        try:
            return (ck / CKPT_STATE).is_file() and read_json_object(ck / CKPT_STATE).get("train_fingerprint") != fingerprint
        except DraftsmithError:
            return False  # a damaged state.json: newest_readable passes over that checkpoint

    if (newest and other_run(newest[-1][1])) or other_run(final_dir):
        prev = folder / "previous"
        shutil.rmtree(prev, ignore_errors=True)
        prev.mkdir()
        for p in (ck_dir, final_dir):
            if p.exists():
                os.replace(p, prev / p.name)
        say(f"checkpoints of a run with other settings or inputs moved to {prev}; starting over")
    elif final_dir.exists():
        shutil.rmtree(final_dir)


@dataclass
class Checkpoint:
    """A checkpoint folder read whole: every file of it opened before training resumes from it."""

    folder: Path
    state: dict  # state.json
    weights: dict[str, torch.Tensor]  # model.safetensors
    saved: dict  # optimizer.pt: {"optimizer", "scheduler"}
    rng: dict[str, torch.Tensor]  # rng.safetensors


class DamagedCheckpoint(DraftsmithError):
    """A file of a checkpoint folder cannot be read back (cut short, overwritten, a disk error)."""


def read_checkpoint(ck: Path, fingerprint: str) -> Checkpoint:
    """Every file of checkpoint folder `ck`; a damaged one is a DamagedCheckpoint naming it."""
    try:
        state = read_json_object(ck / CKPT_STATE)
    except DraftsmithError as e:
        raise DamagedCheckpoint(str(e)) from None
    if state.get("train_fingerprint") != fingerprint:
        raise DraftsmithError(f"{ck}: a checkpoint of other settings (fingerprint mismatch); remove it")
    parts: dict[str, Any] = {}
    for name, read in ((CKPT_WEIGHTS, lambda p: load_file(str(p))), (CKPT_RNG, lambda p: load_file(str(p))),
                       # weights_only: a checkpoint folder is a file anyone could have put there
                       (CKPT_OPTIM, lambda p: torch.load(p, weights_only=True, map_location="cpu"))):
        try:
            parts[name] = read(ck / name)
        except MemoryError:
            raise  # no damage: the machine is short of memory
        except Exception as e:  # safetensors, torch.load (cut zip, bad pickle) and the system raise many kinds
            raise DamagedCheckpoint(f"{ck / name}: cannot read ({type(e).__name__}: {one_line(str(e))[:200]})") from None
    saved = parts[CKPT_OPTIM]
    if not isinstance(saved, dict) or not {"optimizer", "scheduler"} <= set(saved):
        raise DamagedCheckpoint(f"{ck / CKPT_OPTIM}: not an optimizer checkpoint (no optimizer/scheduler state)")
    return Checkpoint(folder=ck, state=state, weights=parts[CKPT_WEIGHTS], saved=saved, rng=parts[CKPT_RNG])


def newest_readable(ck_dir: Path, fingerprint: str, say) -> Checkpoint | None:
    """The newest complete checkpoint whose files all read; past a damaged one (a disk error, a file
    cut or overwritten by hand) the one before it. The damaged folder stays for the user to look
    at (every rank reads; none may move it under another) and is pruned as newer ones come."""
    found = complete_checkpoints(ck_dir)
    for _, ck in reversed(found):
        try:
            return read_checkpoint(ck, fingerprint)
        except DamagedCheckpoint as e:
            say(f"{e}; resuming from the checkpoint before it")
    if found:  # never start over silently while checkpoints exist
        raise DraftsmithError(f"{ck_dir}: none of its {len(found)} checkpoint(s) can be read (see the lines above); "
                              "move the folder away to train from scratch")
    return None


def load_weights(ck: Checkpoint, drafter) -> dict:
    """Resume, part one (before the drafter is wrapped for DDP/FSDP): the drafter's weights; returns
    the checkpoint's state.json."""
    sd = dict(ck.weights)
    sd.pop(FC_INPUT_SCALE, None)  # recomputed by the caller, from the same first micro-batch
    missing, unexpected = drafter.load_state_dict(sd, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise DraftsmithError(f"{ck.folder / CKPT_WEIGHTS}: tensors do not match the drafter "
                              f"(missing {sorted(set(missing) - {'embed_tokens.weight'})[:3]}, unexpected {unexpected[:3]})")
    return ck.state


def load_training_state(ck: Checkpoint, objective, optimizer, scheduler, rank: int, device) -> None:
    """Resume, part two (once the optimizer exists): optimizer, scheduler and this rank's RNG."""
    set_optimizer_state_dict(objective, optimizer, ck.saved["optimizer"], options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(ck.saved["scheduler"])
    if f"cpu.rank{rank}" in ck.rng:
        torch.set_rng_state(ck.rng[f"cpu.rank{rank}"])
    if device.type == "cuda" and f"cuda.rank{rank}" in ck.rng:
        torch.cuda.set_rng_state(ck.rng[f"cuda.rank{rank}"], device)


def save_checkpoint(dest: Path, objective, optimizer, scheduler, *, rank: int, world: int, device, meta: dict,
                    state: dict, fc_scale=None, keep: int | None = None) -> None:
    """Every rank takes part (FSDP gathers shards, RNG states are gathered); rank 0 writes `dest`
    with drafter.json `meta` and state.json `state`, then, with `keep`, leaves the newest `keep`
    checkpoints of its folder. fc_scale: [3H] train.fc_input_norm factor or None."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(objective, options=opts)
    osd = get_optimizer_state_dict(objective, optimizer, options=opts)
    rng_states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        rng_states["cuda"] = torch.cuda.get_rng_state(device)
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, rng_states)
    else:
        gathered = [rng_states]
    if rank == 0:
        model_sd = {k[len("drafter."):]: v for k, v in full.items()
                    if k.startswith("drafter.") and k != "drafter.embed_tokens.weight"}
        bad = [k for k, v in model_sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:  # never a checkpoint that a later error would call "the last good one"
            raise DraftsmithError(f"train: the weights are non-finite ({', '.join(bad[:3])}) at step {state.get('step')}; "
                                  f"not writing {dest}; lower train.lr or check the samples")
        if fc_scale is not None:
            model_sd[FC_INPUT_SCALE] = fc_scale.detach().cpu()  # export folds it into fc.weight
        rng = {f"{name}.rank{r}": t.cpu() for r, g in enumerate(gathered) for name, t in g.items()}
        write_checkpoint(dest, model_sd, meta, {"optimizer": osd, "scheduler": scheduler.state_dict()}, rng, state)
        if keep is not None:
            prune_checkpoints(dest.parent, keep)
    if world > 1:
        dist.barrier()
