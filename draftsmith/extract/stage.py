"""The `extract` stage: run the target over the prepared samples and store, per sample, what
offline training needs: the hidden states entering the auxiliary layers and the target's final
normed hidden state (target logits = lm_head(last_hidden)).

Two backends fill the same store: `hf` (hf.py: a transformers forward in this process) and
`vllm` (vllm_backend.py: vLLM servers with the extract_hidden_states method, for targets too big
for one process; not named vllm.py, which would read like the vllm package). Only how a sample's
states are obtained differs; the files, shard records, preflight, resume and --verify are the
same (store.py, which also documents the layout under extract/).

How the stage runs (run_extract, below):
- checks: prepare is complete and for this target; the disk holds what is still to write.
- resume: a file under its final name is done; temp files are removed; `--verify` re-reads
  every finished file (and shard.json checksums) and redoes the bad ones.
- scale-out: shard i belongs to rank i % world_size; the last rank to finish writes the manifest.
- failures (vllm only): a sample whose states fail after retries is listed in failures.jsonl, its
  shard stays unsealed and the stage fails once the others are stored; a rerun retries it.
"""

import contextlib
import json
import shutil

from draftsmith import DraftsmithError
from draftsmith.config import Config
from draftsmith.extract import hf, store, vllm_backend
from draftsmith.extract.store import (FAILURES, FILE_OVERHEAD, FORMAT_VERSION, META, SHARD_RECORD, STAGE,
                                      StoreFormat, shard_name, shard_ranges)
from draftsmith.journal import env_rank
from draftsmith.prepared_format import Prepared, index_prepared, prepared_path
from draftsmith.progress import log
from draftsmith.released import aux_layers, open_released
from draftsmith.rundir import RunDir
from draftsmith.stage import StageBook, check_target, stage_run, upstream
from draftsmith.host import pick_device, pick_dtype
from draftsmith.target import TargetInfo, target_info


@stage_run(STAGE)
def run_extract(run: RunDir, cfg, verify: bool = False, force: bool = False, rank: int | None = None,
                world_size: int | None = None, target=None) -> dict | None:
    """Extract hidden states for every prepared sample of this rank's shards.

    Returns the manifest when the whole store is complete, or None on a rank that finished its
    shards while another rank's are still missing (the last rank to finish writes the manifest).
    `target`: an already loaded `draftsmith.target.Target` to reuse (else loaded here).
    """
    extract_cfg = cfg.extract
    verify = verify or extract_cfg.verify
    force = force or extract_cfg.force
    rank, world_size = _resolve_rank(rank, world_size)

    # -- upstream checks (before anything is written) ---------------------------------------------
    prep = upstream(run, "prepare", by="draftsmith extract")
    info = target.info if target is not None else target_info(cfg.target, cfg.trust_remote_code)
    check_target(run, "prepare", prep, info)
    layers = aux_layers(cfg, info, open_released(cfg, info))  # a released drafter's (train.init_from), if any
    prepared_path(run, by="draftsmith extract")  # refuses a missing prepare/samples.jsonl before anything starts
    compute_dtype = _compute_dtype(cfg, target)
    settings = {"target": cfg.target, "layers": layers, "shard_size": extract_cfg.shard_size,
                "backend": extract_cfg.backend, "compute_dtype": compute_dtype}
    fmt = extract_cfg.format
    settings.update(fmt.settings)
    book = StageBook(run, STAGE, cfg, settings=settings, upstream={"prepare": prep}, target=info)
    damaged: list[str] = []  # files of a store complete by its manifest that changed since (whole, below)

    def whole(current: dict) -> bool:
        """Every file of the store complete by its manifest still the size its shard recorded (stat only,
        fast); the changed ones go, and `verify` becomes the shards whose record went with them."""
        nonlocal damaged, verify
        with store.ranks_lock(run.path / STAGE):
            damaged, verify = _remove_damaged(run.path / STAGE)
            if damaged:  # no longer complete: no rank (nor `run`) may take the old manifest as done
                run.invalidate(STAGE)
        return not damaged

    # begun below, under the ranks' lock once the store is checked (a rank may complete it meanwhile)
    current = book.skip(outputs_ok=not verify, holds=whole,
                        said=lambda m: f"{m['counts']['done']} samples; --verify re-checks the files")
    if current is not None:
        return current

    # -- the store: this attempt's meta.json; not complete from here unless it already is -----------
    prepared = index_prepared(run, info.vocab_size, by="draftsmith extract")
    meta = _store_meta(cfg, info, layers, compute_dtype, prep, prepared)
    d = run.stage_dir(STAGE)
    with store.ranks_lock(d):
        store.check_store(d, meta, extract_cfg.overwrite)
        if book.skip_or_begin() is not None:  # complete (another rank finished it meanwhile, or --verify of a
            book.write_config()  # complete store): it stays so unless a file turns out bad (below); else begun
        store.write_meta(d, meta)

    shards = shard_ranges(len(prepared), extract_cfg.shard_size)
    mine = [s for i, s in enumerate(shards) if i % world_size == rank]
    present = {s: store.present(d, s) for s in mine}
    total = sum(e - s for s, e in mine)
    with book.progress(total=total, unit="samples", done=sum(len(p) for p in present.values()), rank=rank,
                       world_size=world_size) as prog:
        if damaged:
            prog.log(f"{len(damaged)} file(s) of the finished store changed since ({', '.join(damaged[:3])}"
                     + (", ..." if len(damaged) > 3 else "") + "); extracting them again")
        _preflight(d, prepared, shards, present, layers, info.hidden_size, force, prog, fmt)
        if world_size > 1:
            prog.log(f"rank {rank}/{world_size}: {len(mine)} of {len(shards)} shards, {total} samples")
        todo = _resume(d, mine, present, prepared, layers, info.hidden_size, verify, prog, fmt)
        unsealed = [s for s in mine if not (d / shard_name(*s) / SHARD_RECORD).is_file()]
        if unsealed:
            run.invalidate(STAGE)  # files are about to change: the store is not complete meanwhile
            _extract(run, cfg, target, info, layers, prepared, unsealed, todo, prog)
        manifest = _try_finish(book, meta, shards)
        if manifest is None:
            prog.log(f"rank {rank}: its shards are complete; other ranks' shards are still missing "
                     "(the last rank to finish writes extract/manifest.json)")
        prog.end(samples=total, complete=manifest is not None)
    return manifest


def _store_meta(cfg: Config, info: TargetInfo, layers: list[int], compute_dtype: str, prep: dict,
                prepared: Prepared) -> dict:
    """The store's meta.json for this attempt: what its files hold (target, layers, widths, format), of which
    prepared samples (their count, lengths and ids) and how they are sharded. store.check_store holds an
    existing store to it (one built differently is refused, or replaced with extract.overwrite)."""
    extract_cfg, fmt = cfg.extract, cfg.extract.format
    return {
        "format": FORMAT_VERSION, "target": info.name, "target_fingerprint": info.fingerprint,
        "layers": layers, "num_layers": info.num_layers, "hidden_size": info.hidden_size,
        "vocab_size": info.vocab_size, "store_format": fmt.name, "dtype": fmt.dtype,
        "compute_dtype": compute_dtype, "prepare_fingerprint": prep.get("fingerprint"), "num_samples": len(prepared),
        "shard_size": extract_cfg.shard_size, "fields": list(fmt.fields),
        "backend": extract_cfg.backend, "lengths": prepared.lengths,
        "ids": prepared.ids,  # train's validation split is drawn by id (train/validation.py)
    }


def summary(run: RunDir, manifest: dict | None) -> None:
    """After `draftsmith extract`: a rank that finished before the others says so (the last one writes the
    manifest); nothing more is printed."""
    if manifest is None:
        log("this rank is done; extract/manifest.json is written when the other ranks finish", stage=STAGE)


def _remove_damaged(d) -> tuple[list[str], set | bool]:
    """store.remove_damaged over every shard meta.json describes: (what it found, the shards whose
    files must be opened to be judged; True: all of them)."""
    try:
        meta = json.loads((d / META).read_text())
        shards = shard_ranges(int(meta["num_samples"]), int(meta["shard_size"]))
    except (OSError, ValueError, KeyError, TypeError):
        return [], False  # no meta.json to judge the files by: the store reader names that file itself
    return store.remove_damaged(d, shards)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None:
        return env_rank()
    if rank is None or world_size is None:
        raise DraftsmithError("--rank and --world-size go together")
    if world_size < 1 or not 0 <= rank < world_size:
        raise DraftsmithError(f"--rank {rank} --world-size {world_size}: need 0 <= rank < world-size")
    return rank, world_size


def _compute_dtype(cfg, target) -> str:
    """The dtype the states are computed in (before the store's bfloat16)."""
    if cfg.extract.backend == "vllm":
        return vllm_backend.server_dtype(cfg)  # what the server runs in (its files are checked to hold it)
    return str(target.dtype if target is not None
               else pick_dtype(cfg.dtype, pick_device(cfg.device))).replace("torch.", "")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _preflight(d, prepared: Prepared, shards, present: dict, layers: list[int], hidden_size: int, force: bool,
               prog, fmt: StoreFormat) -> None:
    """Refuse to start when the disk cannot hold what all ranks still have to write (ranks
    normally share the run's disk); `force` only logs it."""
    bpt = fmt.bytes_per_token(len(layers), hidden_size)
    all_present = {s: (present[s] if s in present else store.present(d, s)) for s in shards}
    remaining = sum(prepared.lengths[i] * bpt + FILE_OVERHEAD
                    for s in shards for i in range(*s) if i not in all_present[s])
    full = sum(n * bpt + FILE_OVERHEAD for n in prepared.lengths)
    free = shutil.disk_usage(d).free
    prog.log(f"{len(prepared)} samples, {sum(prepared.lengths):,} tokens, layers {layers} + last, "
             f"{bpt:,} bytes/token ({fmt.name}): store {_fmt_bytes(full)}, still to write {_fmt_bytes(remaining)}, "
             f"free {_fmt_bytes(free)}")
    if remaining * 1.1 > free:
        msg = (f"{d}: not enough disk space: extract needs {_fmt_bytes(remaining)} (+10% margin) "
               f"but {_fmt_bytes(free)} is free")
        if not force:
            raise DraftsmithError(msg + "; free space, use another run dir, or pass --force")
        prog.log(msg + " (--force: going on)")


def _resume(d, mine, present: dict, prepared: Prepared, layers: list[int], hidden_size: int, verify: bool | set,
            prog, fmt: StoreFormat) -> dict:
    """What an interrupted attempt left: its temp files go, with `verify` (True, or a set of shards)
    its finished files are re-checked (the bad ones go too), a shard.json whose files are no longer
    all there goes. Returns {shard: [sample indices still to extract]}."""
    done = sum(len(p) for p in present.values())
    for s in mine:
        if store.remove_temps(d, s):
            prog.log(f"{shard_name(*s)}: removed temp files of an interrupted attempt")
    check = [s for s in mine if verify is True or (verify and s in verify)]
    if check and done:
        with prog.busy(f"verifying the finished files of {len(check)} shard(s)"):
            removed = sum(store.verify_shard(d, s, prepared, layers, hidden_size, prog.log, fmt)
                          for s in check)
        present = {s: store.present(d, s) for s in mine}
        prog.done -= removed  # the journal's count must match what is on disk
        prog.log(f"verify: {done - removed} files good, {removed} redone")
    for s in mine:
        # A shard.json from a complete attempt whose files were since removed no longer holds.
        rec = d / shard_name(*s) / SHARD_RECORD
        if rec.is_file() and len(present[s]) < s[1] - s[0]:
            rec.unlink()
    todo = {s: [i for i in range(*s) if i not in present[s]] for s in mine}
    if done and any(todo.values()):
        prog.log(f"resuming: {prog.done} of {sum(e - s for s, e in mine)} samples already done")
    return todo


def _extract(run: RunDir, cfg, target, info, layers: list[int], prepared: Prepared, unsealed, todo, prog) -> None:
    """Fill the unsealed shards with the configured backend; log the rate; fail the stage when
    samples failed (they are in failures.jsonl; the others are stored)."""
    d = run.stage_dir(STAGE)
    with contextlib.suppress(FileNotFoundError):
        (d / FAILURES).unlink()  # the previous attempt's; its samples are missing, so retried now
    if cfg.extract.backend == "vllm":
        stats = vllm_backend.extract_shards(run, cfg, info, layers, prepared, unsealed, todo, prog)
    else:
        stats = hf.extract_shards(run, cfg, target, layers, prepared, unsealed, todo, prog)
    if stats["tokens"]:
        prog.log(f"extracted {stats['samples']} samples, {stats['tokens']:,} tokens in {stats['seconds']:.1f}s "
                 f"({stats['tokens'] / max(stats['seconds'], 1e-9):,.0f} tokens/s, "
                 f"{100 * stats['padding']:.1f}% padding, {stats['bytes'] / max(stats['tokens'], 1):,.0f} bytes/token)")
    if stats.get("failed"):
        raise DraftsmithError(f"{stats['failed']} samples failed, see {d / FAILURES}; the other samples are stored, "
                              "rerun `draftsmith extract` to retry the missing ones")


def _try_finish(book: StageBook, meta: dict, shards: list[tuple[int, int]]) -> dict | None:
    """Write the manifest if every shard (of every rank) is complete; else None."""
    d = book.run.stage_dir(STAGE)
    with store.ranks_lock(d):
        if any(not (d / shard_name(*s) / SHARD_RECORD).is_file() for s in shards):
            return None
        if (current := book.up_to_date()) is not None:
            return current  # another rank finished last and wrote it
        records = [store.read_shard_record(d, s) for s in shards]
        n = meta["num_samples"]
        return book.finish(
            counts={"done": n, "total": n, "unit": "samples", "tokens": sum(meta["lengths"]),
                    "shards": len(shards), "bytes": sum(r["bytes"] for r in records)},
            outputs=[store.META] + [f"{shard_name(*s)}/{SHARD_RECORD}" for s in shards],
            inputs={"samples": "prepare/samples.jsonl"},  # relative to the run: a moved run names itself
            # the shard records (each file's size and hash within its shard); meta.json is rewritten by --verify
            checked=[f"{shard_name(*s)}/{SHARD_RECORD}" for s in shards])
