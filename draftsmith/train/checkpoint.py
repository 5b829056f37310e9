"""Checkpoints: written, pruned, found, loaded (docs/run-directory.md, train/).

    checkpoints/step_{N}/   model.safetensors, drafter.json, optimizer.pt, rng.safetensors,
                            state.json (written last; a folder is complete when it has it);
                            built as a hidden temporary folder and renamed into place
    final/                  the last weights, same format

A run killed at any point resumes from its newest checkpoint to the same final weights as a run
never interrupted (model, optimizer, scheduler, data position and RNG are all restored).

Several ranks: rank 0 alone picks, reads and writes checkpoint folders. On resume the others get
the folder, state.json, the scheduler and their own RNG states in one broadcast_object_list, and
the weights and optimizer state from rank 0 through torch's broadcast_from_rank0 loaders, each
keeping only its own shard under FSDP: no other rank opens a file of the checkpoint.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from draftsmith import DraftsmithError, one_line
from draftsmith.checkpoint_format import (BEST_DIR, CKPT_META, CKPT_OPTIM, CKPT_RNG, CKPT_STATE, CKPT_WEIGHTS,
                                         FC_INPUT_SCALE, FINAL_DIR)
from draftsmith.rundir import naming_full_disk, read_json_object, replace_dir
from draftsmith.train.distributed import Ranks, on_rank0


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
            save_file({k: v.contiguous() for k, v in model_sd.items()}, str(tmp / CKPT_WEIGHTS),
                      metadata={"format": "pt"})
            (tmp / CKPT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            # (a file object: torch then chains the OSError behind its own error)
            with open(tmp / CKPT_OPTIM, "wb") as f:
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
    """Remove all but the newest `keep` complete checkpoints. Each is first renamed to a hidden
    temporary name, then deleted: a kill in the middle of deleting leaves a `.step_N.tmp-prune-PID`
    folder, which the next attempt removes (clear_for_attempt), never a step_N folder that has
    lost its state.json and that no later prune would see (the kill soak found one)."""
    for _, d in complete_checkpoints(ck_dir)[:-keep]:
        doomed = d.parent / f".{d.name}.tmp-prune-{os.getpid()}"
        try:
            os.replace(d, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)


def clear_for_attempt(folder: Path, continues: Callable[[dict], bool], fingerprint: str, say) -> None:
    """Rank 0, before an attempt: remove a killed attempt's temporary folders; move the
    checkpoints of a run this attempt cannot continue (`continues(state.json)` false: other
    settings or inputs, or a length shorter than the steps made) aside into previous/ (then
    previous-2/, ...: nothing is deleted), so that training starts over (best/ with them). A final/ of the run it
    continues is rewritten at the end of this attempt: removed, unless the run is being lengthened
    (train.max_steps, epochs or max_minutes raised), when the finished drafter is kept aside too."""
    ck_dir, final_dir, best_dir = folder / "checkpoints", folder / FINAL_DIR, folder / BEST_DIR
    for stale in [*folder.glob(".step_*"), *ck_dir.glob(".step_*"), *folder.glob(f".{FINAL_DIR}.*"),
                  *folder.glob(f".{BEST_DIR}.*")]:
        shutil.rmtree(stale, ignore_errors=True)  # temporary folders of a killed attempt (a write, a prune)
    newest = complete_checkpoints(ck_dir)
    # A step_N folder without state.json older than the newest complete checkpoint is what a kill
    # while an earlier version deleted it left (write_checkpoint only ever renames whole folders in).
    if newest and ck_dir.is_dir():
        for d in ck_dir.iterdir():
            if (d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and int(d.name[5:]) < newest[-1][0]
                    and not (d / CKPT_STATE).exists()):
                shutil.rmtree(d, ignore_errors=True)

    def state_of(ck: Path) -> dict | None:
        try:
            return read_json_object(ck / CKPT_STATE) if (ck / CKPT_STATE).is_file() else None
        except DraftsmithError:
            return None  # a damaged state.json: newest_readable passes over that checkpoint

    newest_state = state_of(newest[-1][1]) if newest else None
    final_state, best_state = state_of(final_dir), state_of(best_dir)
    if any(st is not None and not continues(st) for st in (newest_state, final_state)):
        aside = _aside(folder, [p for p in (ck_dir, final_dir, best_dir) if p.exists()])
        say(f"checkpoints of a run with other settings or inputs moved to {aside}; starting over")
        return
    if best_state is not None and not continues(best_state):
        say(f"{best_dir} is of a run with other settings or inputs: moved to {_aside(folder, [best_dir])}")
    if final_state is not None and final_state.get("train_fingerprint") != fingerprint:
        # continued but not the same fingerprint: only its length changed (train/stage.LENGTH_KEYS)
        aside = _aside(folder, [final_dir])
        say(f"the run is lengthened: its finished drafter (step {final_state.get('step')}) kept in {aside}; "
            "training continues from its last checkpoint")
    elif final_dir.exists():
        shutil.rmtree(final_dir)


def _aside(folder: Path, paths: list[Path]) -> Path:
    """Move `paths` into the first free folder of previous/, previous-2/, previous-3/, ...; returns it."""
    n = 1
    while (aside := folder / ("previous" if n == 1 else f"previous-{n}")).exists():
        n += 1
    aside.mkdir()
    for p in paths:
        os.replace(p, aside / p.name)
    return aside


@dataclass
class Checkpoint:
    """A checkpoint folder read whole: every file of it opened before training resumes from it."""

    folder: Path
    state: dict  # state.json
    weights: dict[str, torch.Tensor] | None  # model.safetensors (None on ranks other than 0: never read there)
    saved: dict  # optimizer.pt: {"optimizer", "scheduler"} ({"scheduler"} alone on ranks other than 0)
    rng: dict[str, torch.Tensor]  # rng.safetensors ("{cpu|cuda}.rank{r}"; rank r > 0 gets its own entries only)


class DamagedCheckpoint(DraftsmithError):
    """A file of a checkpoint folder cannot be read back (cut short, overwritten, a disk error)."""


def read_checkpoint(ck: Path, continues: Callable[[dict], bool]) -> Checkpoint:
    """Every file of checkpoint folder `ck`; a damaged one is a DamagedCheckpoint naming it."""
    try:
        state = read_json_object(ck / CKPT_STATE)
    except DraftsmithError as e:
        raise DamagedCheckpoint(str(e)) from None
    if not continues(state):
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
            raise DamagedCheckpoint(f"{ck / name}: cannot read "
                                    f"({type(e).__name__}: {one_line(str(e))[:200]})") from None
    saved = parts[CKPT_OPTIM]
    if not isinstance(saved, dict) or not {"optimizer", "scheduler"} <= set(saved):
        raise DamagedCheckpoint(f"{ck / CKPT_OPTIM}: not an optimizer checkpoint (no optimizer/scheduler state)")
    return Checkpoint(folder=ck, state=state, weights=parts[CKPT_WEIGHTS], saved=saved, rng=parts[CKPT_RNG])


def newest_readable(ck_dir: Path, continues: Callable[[dict], bool], say) -> Checkpoint | None:
    """The newest complete checkpoint whose files all read; past a damaged one (a disk error, a file
    cut or overwritten by hand) the one before it. The damaged folder stays for the user to look
    at and is pruned as newer ones come. Rank 0 alone calls it under several ranks (pick_checkpoint)."""
    found = complete_checkpoints(ck_dir)
    for _, ck in reversed(found):
        try:
            return read_checkpoint(ck, continues)
        except DamagedCheckpoint as e:
            say(f"{e}; resuming from the checkpoint before it")
    if found:  # never start over silently while checkpoints exist
        raise DraftsmithError(f"{ck_dir}: none of its {len(found)} checkpoint(s) can be read (see the lines above); "
                              "move the folder away to train from scratch")
    return None


def pick_checkpoint(ck_dir: Path, continues: Callable[[dict], bool], drafter, ranks: Ranks, say) -> Checkpoint | None:
    """Resume, part one (before the drafter is wrapped for DDP/FSDP): on rank 0 the newest readable
    checkpoint (newest_readable), its weights loaded into `drafter`. Rank 0's choice (or error:
    none readable, weights that do not fit) reaches every rank: the others get a Checkpoint of
    its folder, state.json, scheduler state and their own RNG states, and receive the weights and
    optimizer state in load_training_state. None when there is no checkpoint."""
    read: list[Checkpoint] = []

    def pick():
        ck = newest_readable(ck_dir, continues, say)
        if ck is None:
            return None
        load_weights(ck, drafter)
        read.append(ck)
        # all ranks' RNG states: world x ~5 KB, small enough to send whole
        return str(ck.folder), ck.state, ck.saved["scheduler"], ck.rng

    shared = on_rank0(pick, ranks)
    if shared is None:
        return None
    if ranks.rank == 0:
        return read[0]
    folder, state, scheduler, rng = shared
    mine = {k: v for k, v in rng.items() if k.endswith(f".rank{ranks.rank}")}
    return Checkpoint(folder=Path(folder), state=state, weights=None, saved={"scheduler": scheduler}, rng=mine)


def load_weights(ck: Checkpoint, drafter) -> dict:
    """The drafter's weights from `ck` (read on this rank); returns the checkpoint's state.json."""
    sd = dict(ck.weights)
    sd.pop(FC_INPUT_SCALE, None)  # recomputed by the caller, from the same first micro-batch
    missing, unexpected = drafter.load_state_dict(sd, strict=False)
    if set(missing) != {"embed_tokens.weight"} or unexpected:
        raise DraftsmithError(f"{ck.folder / CKPT_WEIGHTS}: tensors do not match the drafter "
                              f"(missing {sorted(set(missing) - {'embed_tokens.weight'})[:3]}, "
                              f"unexpected {unexpected[:3]})")
    return ck.state


def load_training_state(ck: Checkpoint, objective, optimizer, scheduler, ranks: Ranks) -> None:
    """Resume, part two (once the optimizer exists, every rank): on several ranks rank 0's weights
    and optimizer state broadcast tensor by tensor, each rank keeping its shard (FSDP) or a whole
    copy (DDP); then the scheduler and this rank's RNG."""
    rank, device = ranks.rank, ranks.device
    if ranks.world > 1:
        # FSDP sharded each rank's own (freshly initialised) copy, so the resumed weights must come
        # from rank 0; strict=False: the frozen embedding is no part of a checkpoint
        opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        weights = ({f"drafter.{k}": v for k, v in ck.weights.items() if k != FC_INPUT_SCALE} if rank == 0 else {})
        set_model_state_dict(objective, weights, options=opts)
        # the other ranks pass {}: they get the param groups' values (lr) and, tensor by tensor,
        # the moments of their own shard
        set_optimizer_state_dict(objective, optimizer, ck.saved["optimizer"] if rank == 0 else {},
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    else:
        set_optimizer_state_dict(objective, optimizer, ck.saved["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(ck.saved["scheduler"])
    if f"cpu.rank{rank}" in ck.rng:
        torch.set_rng_state(ck.rng[f"cpu.rank{rank}"])
    if device.type == "cuda" and f"cuda.rank{rank}" in ck.rng:
        torch.cuda.set_rng_state(ck.rng[f"cuda.rank{rank}"], device)


def save_checkpoint(dest: Path, objective, optimizer, scheduler, *, rank: int, world: int, device, meta: dict,
                    state: dict, fc_scale=None, keep: int | None = None) -> None:
    """Every rank takes part (FSDP gathers shards, RNG states are gathered); rank 0 writes `dest`
    with drafter.json `meta` and state.json `state`, then, with `keep`, leaves the newest `keep`
    checkpoints of its folder. fc_scale: [3H] train.fc_input_norm factor or None. An error of rank
    0's (non-finite weights, a full disk) is raised on every rank as the same line (on_rank0)."""
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

    def write():
        model_sd = {k[len("drafter."):]: v for k, v in full.items()
                    if k.startswith("drafter.") and k != "drafter.embed_tokens.weight"}
        bad = [k for k, v in model_sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad:  # never a checkpoint that a later error would call "the last good one"
            raise DraftsmithError(f"train: the weights are non-finite ({', '.join(bad[:3])}) at step "
                                  f"{state.get('step')}; not writing {dest}; lower train.lr or check the samples")
        if fc_scale is not None:
            model_sd[FC_INPUT_SCALE] = fc_scale.detach().cpu()  # export folds it into fc.weight
        rng = {f"{name}.rank{r}": t.cpu() for r, g in enumerate(gathered) for name, t in g.items()}
        write_checkpoint(dest, model_sd, meta, {"optimizer": osd, "scheduler": scheduler.state_dict()}, rng, state)
        if keep is not None:
            prune_checkpoints(dest.parent, keep)

    on_rank0(write, Ranks(rank, world, device))  # the others wait in its broadcast until rank 0 has written
