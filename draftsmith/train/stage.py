"""The `train` stage: fit the EAGLE-3 drafter to the target with training-time test (TTT).

    run_train = read_inputs -> (up to date: done) -> setup -> fit -> finish

Data (data.py). `train.mode=offline` reads the target's hidden states from extract/;
`online` runs the target in this process on prepare/samples.jsonl and writes nothing but train/
(with `extract.backend=vllm` the states stream from vLLM server(s) instead, through a buffer of at
most extract.concurrency files, each deleted once read). All feed the same loop: samples packed
into rows of `train.seq_len` tokens, `train.batch_tokens // seq_len` rows per micro-batch,
`train.grad_accum` micro-batches per rank per optimizer step.

Objective (objective.py): the forward KL from the target's next-token distribution to the
drafter's (or a mix with other distances, train.loss_*), over `train.ttt_steps` unrolled drafting
steps weighted gamma**k.

Validation (validation.py): train.validation holds samples out by a hash of their prompt's id; every
train.validate_every steps and after the last, their chain acceptance (the acceptance length a greedy
verifier gets) is measured with the objective's own forward, logged beside the training figures, written
to metrics.jsonl and kept in every checkpoint. A pass that beats every earlier one (tau) writes its
weights to best/ (export.checkpoint=best exports them; the card says its figure is the best of N passes).

Outputs (docs/run-directory.md, train/): checkpoints/step_{N}/, final/ and best/ (checkpoint.py),
metrics.jsonl and tb/ (report.py), the manifest. A run killed at any point resumes from its
newest checkpoint to the same final weights as a run never interrupted.

Ranks (distributed.py, launch.py): torchrun runs DDP or FSDP; `train.processes` starts local
ranks itself. State lives in one TrainState; every rank runs the same code, rank 0 writes.
"""

import contextlib
import functools
import gc
import math
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from draftsmith import DraftsmithError, heldout, kinds
from draftsmith.checkpoint_format import BEST_DIR, FINAL_DIR
from draftsmith.journal import env_rank
from draftsmith.model.ttt import FLEX_GRAPHS
from draftsmith.prepared_format import iter_prepared, prepared_groups
from draftsmith.progress import Progress, log
from draftsmith.released import Released, draft_vocab_size, open_released
from draftsmith.rundir import RunDir, atomic_write_json, fingerprinted, read_json_object
from draftsmith.stage import StageBook, stage_run
from draftsmith.target import target_info
from draftsmith.train.checkpoint import (CKPT_STATE, Checkpoint, clear_for_attempt, complete_checkpoints,
                                         load_training_state, pick_checkpoint, save_checkpoint)
from draftsmith.train.data import (DeviceFeeder, Packing, PreparedSource, count_steps, open_source, open_upstream,
                                   served_states, step_stream)
from draftsmith.train.distributed import Ranks, distribute, on_rank0, process_group, resolve_precision, sum_by_name
from draftsmith.train.device_memory import check_free_memory
from draftsmith.train.drafter import build_drafter, drafter_config, drafter_record, read_init_layers
from draftsmith.train.launch import launch_ranks, launches
from draftsmith.train.objective import ObjectiveOptions, objective_options, resolve_attention
from draftsmith.train.report import Window
from draftsmith.train.validation import Validation
from draftsmith.train.schedule import TimeBudget, load_ema, make_optimizer, make_scheduler, update_ema
from draftsmith.train.stop import DeferredStop
from draftsmith.train.trackers import Trackers
from draftsmith.vocab import load_vocab

STAGE = "train"
TRAIN_VERSION = 1
# How long the run is, not what a step computes: a run whose settings differ from a checkpoint's in
# these alone continues from it (its schedule re-planned) instead of starting over.
LENGTH_KEYS = ("max_steps", "epochs", "max_minutes")
# Settings that change how a run is watched, stored or sharded, not what it computes: left out
# of the fingerprint, so that changing one resumes the run instead of restarting it.
NOT_FINGERPRINTED = ("log_every_s", "tensorboard", "checkpoint_every", "keep_checkpoints", "fsdp", "processes",
                     "attention", "loss_chunk_tokens", "validate_every", "report_to", "tracker_project")
# Train settings added after runs already existed, each with the default that keeps those older
# runs' fingerprint unchanged: `fingerprinted` (its later_defaults) leaves a setting out while it
# holds this value, so an older run stays current instead of training again.
ADDED_LATER_DEFAULTS = {"freeze_lm_head": False, "max_minutes": None, "loss_kl": 1.0, "loss_rkl": 0.0,
                        "loss_tv": 0.0, "loss_top1": 0.0, "lr_schedule": "cosine", "cooldown_share": 0.2,
                        "ema": 0.0, "loss_skip_tokens": 0, "optimizer": "adamw", "method": "eagle3",
                        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "mask_token_id": None,
                        "dflash_anchors": 64, "block_size": None, "drafter_options": {},
                        "loss_chain": False, "init_from": None, "init_vocab": "remap"}

say = functools.partial(log, stage=STAGE)  # console on rank 0, and stage.log


@dataclass
class TrainState:
    """A training run: what setup builds, fit advances and finish reads."""

    # -- fixed for the run
    run: RunDir
    cfg: Any
    book: StageBook  # fingerprint, settings and upstream manifests; writes the manifest
    ranks: Ranks
    source: Any  # OfflineSource | OnlineSource | ServerSource
    packing: Packing
    objective: Any  # the kind's objective (kinds/<kind>/model.py): the drafter plus the frozen target head
    model: torch.nn.Module  # what the loop calls: objective, or its DDP wrapper (FSDP shards objective in place)
    params: list  # the trainable parameters, clipped together
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    budget: TimeBudget
    fc_scale: Any  # [3H] train.fc_input_norm factor, or None; saved in every checkpoint
    meta: dict  # drafter.json of every checkpoint
    precision: str  # "bf16" (autocast) or "fp32"
    cpu0: float  # process CPU seconds when the stage began
    # -- where the run is (every checkpoint's state.json)
    start_step: int  # the step this attempt resumed from
    step: int
    total_steps: int  # the run ends after this step (lowered when the time budget ends it)
    planned: int  # what the log and status show: with a time budget, the steps it is expected to allow
    position: tuple[int, int]  # (epoch, micro-batch) of the data stream after the last step
    tokens_seen: int = 0
    samples_seen: int = 0
    metrics: dict | None = None  # the last log interval's metrics
    validation: Validation | None = None  # the held-out samples (None: train.validation 0, or too few samples)
    val_metrics: dict | None = None  # the last validation pass's figures (with its step)
    best_val: dict | None = None  # the figures of the pass with the highest tau so far: those of train/best/
    val_passes: int = 0  # validation passes made in the run (best/ is the best of them: its figure is a maximum)
    trackers: Trackers | None = None  # train.report_to (rank 0; closed with the stage)
    flex_bound: int | None = None  # flex attention: the most graphs it may compile (FlexShape.graph_bound); else None
    flex_before: int = 0  # graphs flex had compiled in this process before this run (len(FLEX_GRAPHS))
    flex_noted: int = 0  # graphs logged so far

    @property
    def folder(self) -> Path:
        return self.run.path / STAGE


def run_train(run, cfg) -> dict:
    """Train the drafter (train.mode offline or online); returns the train manifest.

    Resumes from the newest complete checkpoint of a run with the same fingerprint; moves the
    checkpoints of a run with other settings to train/previous/ and starts over.
    With train.processes > 1 outside torchrun, launches that many local ranks (they journal
    their own failures).
    """
    run = run if isinstance(run, RunDir) else RunDir(run)
    if env_rank()[0] == 0:
        # the run folder, before the launch writes the ranks' config into it and before any rank's lock: made by
        # rank 0 alone, so that the ranks of a torchrun do not race to create it
        run.ensure()
    if launches(cfg):
        return launch_ranks(run, cfg, STAGE)
    return _train(run, cfg)


def summary(run: RunDir, manifest: dict) -> str:
    """The line `draftsmith train` prints when done: steps, tokens, the validation acceptance length if measured."""
    c = manifest.get("counts", {})
    val = (c.get("validation") or {}).get("acceptance_length")
    return (f"trained {c.get('done')} steps ({c.get('tokens')} tokens)"
            + (f", validation acceptance length {val:.2f}" if isinstance(val, (int, float)) else "")
            + f" -> {run.path / STAGE / 'final'}")


@stage_run(STAGE)
def _train(run, cfg) -> dict:
    started, cpu0 = time.time(), time.process_time()
    with process_group(cfg.device) as ranks:
        # The DDP/FSDP model dies here, inside the group: its reducer holds the process group, and freed after
        # destroy_process_group it dropped the group's last reference, whose destructor joined gloo's threads
        # while holding the GIL one of them waited for (a two-rank run hung at exit, 1 in 5 on a loaded CPU).
        # The model sits in reference cycles (hooks), so only a collection frees it; a raised error's traceback
        # keeps the frames' locals (the model) unless they are cleared.
        try:
            manifest = _train_in_group(run, cfg, ranks, started, cpu0)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)
            gc.collect()
            raise
        gc.collect()
    return manifest if manifest is not None else (run.read_manifest(STAGE) or {})


def _train_in_group(run, cfg, ranks: Ranks, started: float, cpu0: float) -> dict | None:
    """The stage inside the process group; everything it builds is freed when it returns."""
    with contextlib.ExitStack() as closing:
        inputs = read_inputs(run, cfg, ranks, started)
        if (done := finished_run(run, inputs)) is not None:
            return done
        # before the data and the drafter are loaded: a GPU another process holds is one line, not an OOM later
        check_free_memory(cfg, inputs.info, int(inputs.d2t.numel()), len(inputs.layers), ranks, say)
        ts = setup(run, cfg, ranks, inputs, closing, cpu0)
        with ts.book.progress(total=ts.total_steps, unit="steps", done=ts.start_step, console=False,
                              shared=True) as prog, DeferredStop(say) as stop:
            if inputs.released is not None and ts.validation is not None and ts.step == 0:
                # the released drafter on this run's held-out answers before any step: what it does as released
                say(f"validating the released drafter ({inputs.released.source}) before the first step")
                _validate(ts, prog, None)
            fit(ts, prog, stop)  # a SIGTERM/SIGINT: the step's checkpoint, then raised (train/stop.py)
            manifest = finish(ts, prog)
            if stop.requested:  # it came during the last step or finish: the run is complete, and still stops
                stop.raise_now()
        if ranks.world > 1:
            dist.barrier()
    return manifest


# -------------------------------------------------------------------------------------------------
# read_inputs: the target, upstream and vocabulary, checked; setup: data, drafter, resume, optimizer


@dataclass
class Inputs:
    """The stage's inputs, read and checked before anything is decided (read_inputs)."""

    info: Any  # the target's TargetInfo
    layers: list[int]  # the aux layers
    store: Any  # the extract store (train.mode=offline), else None
    d2t: torch.Tensor  # [Dv] int64, the draft vocabulary's offsets
    vocab_info: dict  # the vocabulary's own record (its fingerprint)
    precision: str  # train.precision resolved: "bf16" or "fp32"
    attention: str  # train.attention resolved: "sdpa" or "flex"
    book: StageBook  # fingerprint, settings and upstream manifests
    released: Released | None = None  # the released drafter training starts from (train.init_from), else None


def read_inputs(run, cfg, ranks: Ranks, started: float) -> Inputs:
    """The target, the upstream stage's data and the vocabulary, refusing missing or mismatched
    ones, and the stage's book (its fingerprint). Writes nothing."""
    tc = cfg.train
    info = target_info(cfg.target, cfg.trust_remote_code, log=say)
    rel = open_released(cfg, info, say)
    layers, upstream, store = open_upstream(run, cfg, info, rel)
    d2t, t2d, vocab_info = load_vocab(run, expect_target_fingerprint=info.fingerprint,
                                      expect_size=draft_vocab_size(cfg, rel), by="draftsmith train")
    if t2d.numel() != info.vocab_size:
        raise DraftsmithError(f"vocab/vocab.safetensors: t2d has {t2d.numel()} entries but target {info.name} "
                              f"has a vocabulary of {info.vocab_size}")
    upstream["vocab"] = run.read_manifest("vocab")
    precision = resolve_precision(tc.precision, ranks.device)
    attention = resolve_attention(tc.attention, ranks.device)
    book = StageBook(run, STAGE, cfg, settings=_settings(cfg, layers, precision, rel), upstream=upstream,
                     target=info, started=started)
    return Inputs(info=info, layers=layers, store=store, d2t=d2t, vocab_info=vocab_info, precision=precision,
                  attention=attention, book=book, released=rel)


def finished_run(run, inputs: Inputs) -> dict | None:
    """The manifest of the finished run when it is up to date with these inputs (nothing to do),
    else None."""
    return inputs.book.skip(outputs_ok=(run.path / STAGE / "final" / CKPT_STATE).is_file(),
                            said=lambda m: f"{m['counts'].get('done')} steps")


def setup(run, cfg, ranks: Ranks, inputs: Inputs, closing: contextlib.ExitStack, cpu0: float) -> TrainState:
    """Everything before the first step of a run that is not up to date (finished_run). The data
    source is closed by `closing`.

        check the drafter and the data -> prepare the folder -> held-out samples -> drafter and objective
        -> pick the checkpoint -> optimizer -> TrainState, trackers -> load the checkpoint's training state"""
    tc = cfg.train
    info, layers, d2t, precision, book = inputs.info, inputs.layers, inputs.d2t, inputs.precision, inputs.book
    folder = run.path / STAGE

    # the init layer and the data are read and checked before anything in train/ is touched: a bad
    # value must not move a good run's checkpoints aside
    dcfg = drafter_config(info, cfg, int(d2t.numel()), len(layers), inputs.released)
    # what export.format cannot hold of this drafter, said before hours of training rather than at export
    kinds.get(dcfg.kind).check_format(cfg.export.format, dcfg, layers)
    init_layers = read_init_layers(info, tc, dcfg)
    source = open_source(run, cfg, info, layers, inputs.store, ranks.device, ranks.world, run.stage_dir(STAGE), say)
    closing.callback(source.close)
    ids, held_split, packing = _packing(run, tc, source)
    total_steps = count_steps(tc, packing, ranks.world * tc.grad_accum)
    continues = _continues(book, total_steps)

    _prepare_folder(book, ranks, folder, continues)
    validation = _validation(run, cfg, held_split, ids, source.lengths, packing, ranks)
    n_truncated = sum(1 for n in packing.lengths if n > packing.row_len)
    if n_truncated:
        say(f"{n_truncated} of {len(packing.lengths)} samples are longer than a row ({packing.row_len} tokens) "
            "and are cut to it")

    drafter, objective, scale, opts = _objective(cfg, ranks, inputs, dcfg, init_layers, source, packing)
    meta = _drafter_meta(run, tc, inputs, dcfg, opts)
    resume, state, total_steps = _pick_resume(folder, continues, drafter, ranks, tc, book.fingerprint, total_steps)
    start_step = int(state.get("step", 0))

    model = distribute(objective, ranks, tc.fsdp, precision)
    named = [(n, p) for n, p in objective.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = make_optimizer(named, tc,
                               fused=ranks.device.type in ("cpu", "cuda") and not (ranks.world > 1 and tc.fsdp))
    budget = TimeBudget.resume(tc, state)
    scheduler = make_scheduler(optimizer, tc, total_steps, budget)
    ts = TrainState(run=run, cfg=cfg, book=book, ranks=ranks, source=source, packing=packing, objective=objective,
                    model=model, params=params, optimizer=optimizer, scheduler=scheduler, budget=budget, fc_scale=scale,
                    meta=meta, precision=precision, cpu0=cpu0, start_step=start_step, step=start_step,
                    total_steps=total_steps, planned=total_steps,
                    position=(int(state.get("epoch", 0)), int(state.get("micro_batch", 0))),
                    tokens_seen=int(state.get("tokens_seen", 0)), samples_seen=int(state.get("samples_seen", 0)),
                    metrics=state.get("metrics"), validation=validation, val_metrics=state.get("validation"),
                    # best/ may have been written after the checkpoint resumed from: what it holds is the best
                    best_val=on_rank0(lambda: _best_on_disk(folder), ranks),
                    val_passes=int(state.get("validation_passes", 0)),
                    flex_bound=opts.flex.graph_bound if opts.flex is not None else None,
                    flex_before=len(FLEX_GRAPHS), flex_noted=len(FLEX_GRAPHS))
    ts.trackers = _trackers(ts)
    closing.callback(ts.trackers.close)
    if resume is not None:
        load_training_state(resume, objective, optimizer, scheduler, ranks)
        say(f"resumed from {resume.folder} (step {start_step}/{total_steps}, epoch {ts.position[0]}, "
            f"micro-batch {ts.position[1]})")
    _say_plan(ts, inputs, kinds.get(dcfg.kind))
    return ts


def _packing(run, tc, source) -> tuple[list[str], heldout.Split, Packing]:
    """(the source's sample ids, the held-out split, the training packing): the held-out samples get length 0 in
    the packing, so no micro-batch ever holds them."""
    ids = source.sample_ids()
    held_split = heldout.split_of(tc, ids, prepared_groups(run))
    held_set = set(held_split.indices)
    return ids, held_split, Packing.of([0 if i in held_set else n for i, n in enumerate(source.lengths)], tc)


def _continues(book: StageBook, total_steps: int) -> Callable[[dict], bool]:
    """The test clear_for_attempt and pick_checkpoint apply to a checkpoint's state.json: whether this attempt
    continues its run. It does with the same fingerprint, or with one that differs only in the run's length
    (LENGTH_KEYS) when the run is not shorter than the steps the checkpoint made."""
    fp, resume_fp = book.fingerprint, _resume_fingerprint(book)

    def continues(state: dict) -> bool:
        return (state.get("train_fingerprint") == fp
                or (state.get("resume_fingerprint") == resume_fp and int(state.get("step", 0)) <= total_steps))
    return continues


def _prepare_folder(book: StageBook, ranks: Ranks, folder: Path, continues: Callable[[dict], bool]) -> None:
    """Rank 0 begins the stage and clears train/ for this attempt (a run it cannot continue moved aside, a killed
    attempt's leftovers removed); the other ranks wait for it, so none reads a folder being cleared."""
    if ranks.rank == 0:
        book.begin()  # finished_run's book.skip said not up to date; begun only now, the inputs checked before
        clear_for_attempt(folder, continues, book.fingerprint, say)
    if ranks.world > 1:
        dist.barrier()


def _objective(cfg, ranks: Ranks, inputs: Inputs, dcfg: Any, init_layers: list[dict] | None, source: Any,
               packing: Packing) -> tuple[torch.nn.Module, torch.nn.Module, Any, ObjectiveOptions]:
    """(the drafter, its kind's objective on the device, the fc input scale or None, the objective's options): the
    drafter built from the target (and train.init_from's released drafter), seeded, before any checkpoint's
    weights are loaded into it (_pick_resume)."""
    tc = cfg.train
    drafter, target_head, scale = build_drafter(dcfg, inputs.info, inputs.d2t, tc,
                                                # on the host in float32: the stored states decoded
                                                lambda: source.batch(packing.plan(0)[0], packing.row_len).to(
                                                    torch.device("cpu"), torch.float32),
                                                init_layers, inputs.layers, say, ranks, inputs.released)
    opts = objective_options(tc, inputs.attention)
    objective = kinds.get(dcfg.kind).runtime().objective(drafter, target_head, scale, opts).to(ranks.device)
    return drafter, objective, scale, opts


def _drafter_meta(run, tc, inputs: Inputs, dcfg: Any, opts: ObjectiveOptions) -> dict:
    """The drafter.json of every checkpoint: the drafter's config, the aux layers, the target, vocabulary and
    settings it was trained with (export and eval read it back), and the released drafter it started from."""
    meta = {
        "format": "draftsmith-drafter", "version": TRAIN_VERSION, "config": asdict(dcfg),
        "aux_layers": inputs.layers, "target": {"name": inputs.info.name, "fingerprint": inputs.info.fingerprint},
        "vocab_fingerprint": inputs.vocab_info.get("fingerprint"), "draft_vocab_size": int(inputs.d2t.numel()),
        "ttt_steps": opts.steps, "train_fingerprint": inputs.book.fingerprint, "precision": inputs.precision,
        **drafter_record(tc),
    }
    if inputs.released is not None:  # what it started from: export's config.json, provenance and card name it
        meta["init_from"] = inputs.released.record(run.path)
    return meta


def _pick_resume(folder: Path, continues: Callable[[dict], bool], drafter: torch.nn.Module, ranks: Ranks, tc,
                 fp: str, total_steps: int) -> tuple[Checkpoint | None, dict, int]:
    """(the checkpoint this attempt resumes from or None, its state.json or {}, the step the run ends after).
    Resume in two parts: rank 0 picks the checkpoint and loads its weights now; optimizer/scheduler/RNG (and on
    the other ranks the weights) once the optimizer exists (setup: load_training_state). Says when the run's
    length or its global batch differs from the checkpoint's."""
    resume = pick_checkpoint(folder / "checkpoints", continues, drafter, ranks, say)
    state = resume.state if resume is not None else {}
    start_step = int(state.get("step", 0))
    lengthened = bool(state) and state.get("train_fingerprint") != fp
    if lengthened:
        say(f"train.max_steps / epochs / max_minutes changed: continuing from step {start_step} to {total_steps}; "
            "the learning-rate schedule is re-planned over the new length (docs/pipeline.md)")
    elif state and int(state.get("total_steps", -1)) == start_step:
        total_steps = start_step  # the run had ended there (at its last step, or by train.max_minutes' clock)
    per_step = ranks.world * tc.grad_accum
    if state and state.get("world_size", ranks.world) * state.get("grad_accum", tc.grad_accum) != per_step:
        say(f"note: resuming with {ranks.world} ranks x grad_accum {tc.grad_accum} instead of "
            f"{state.get('world_size')} x {state.get('grad_accum')}: the global batch changes from here on")
    return resume, state, total_steps


def _trackers(ts: TrainState) -> Trackers:
    """The trackers of train.report_to (with train.tensorboard's), each named once; rank 0's only (trackers.py),
    each told the run's config and the step it resumes from."""
    tc = ts.cfg.train
    names = list(dict.fromkeys([*tc.report_to, *(["tensorboard"] if tc.tensorboard else [])]))
    return Trackers(ts.folder, names, tc.tracker_project, ts.cfg.model_dump(mode="json"), ts.start_step,
                    ts.ranks.rank, say)


def _say_plan(ts: TrainState, inputs: Inputs, kind: kinds.Kind) -> None:
    """The line that opens training: samples, steps (and time budget), batch, kind, precision, attention, ranks,
    device, draft vocabulary and aux layers."""
    budget, packing = ts.budget, ts.packing
    budget_note = ("" if budget.budget_s is None
                   else f" or {budget.budget_s / 60:g} min of steps ({budget.done_s / 60:.1f} done)")
    trained = sum(1 for n in packing.lengths if n > 0)
    say(f"{ts.source.mode} training: {trained} samples, {ts.total_steps} steps{budget_note} of "
        f"{ts.ranks.world * ts.cfg.train.grad_accum} "
        f"micro-batches ({packing.rows_per_batch} x {packing.row_len} tokens), {kind.label} drafting "
        f"{ts.meta['drafts']} tokens a step, "
        f"{ts.precision}, {inputs.attention} attention, {ts.ranks.world} rank(s) "
        f"on {ts.ranks.device}, draft vocab {inputs.d2t.numel()}, aux layers {inputs.layers}")


def _validation(run, cfg, held_split: heldout.Split, ids: list[str], lengths: list[int], packing: Packing,
                ranks: Ranks) -> Validation | None:
    """The held-out samples' Validation (None without any), said in one line: how many groups and samples, measured
    on what; rank 0 writes them to train/validation.json (draftsmith/heldout.py)."""
    tc = cfg.train
    held = held_split.indices
    if ranks.rank == 0:
        path = run.path / STAGE / heldout.FILE
        if held:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, heldout.record(held_split, ids, heldout.settings(tc)))
        else:
            path.unlink(missing_ok=True)
    if not held:
        if tc.validation > 0:
            say(f"validation: off (train.validation={tc.validation:g} of {len(lengths)} samples holds out none); "
                "the train line's tau is then measured on the samples being fitted, which overstates the served one")
        return None
    validation = Validation(held, ids, lengths, packing.row_len, packing.rows_per_batch, ranks.rank, ranks.world)
    resampled = len(held) - len(validation.measured)
    say(f"validation: {len(held_split.groups)} groups ({len(held)} samples) held out by a hash of their group "
        f"(a conversation, a prompt and its answers), never trained on nor counted in the draft vocabulary "
        f"(train/{heldout.FILE}); {len(validation.measured)} measured ({validation.tokens:,} tokens"
        + (f"; their prompts' {resampled} resampled answers held out too, not measured" if resampled else "")
        + f") every {tc.validate_every} steps and after the last, on the answers' tokens" + _sampled_note(run, cfg))
    if line := heldout.shortfall(held_split, tc):
        say(line)
    return validation


def _sampled_note(run, cfg) -> str:
    """What the validation figure means when the answers were sampled (the generate stage's settings)."""
    gen = ((run.read_manifest("generate") or {}).get("settings") or {}).get("generate") or cfg.generate.model_dump()
    temperature, answers = float(gen.get("temperature") or 0.0), int(gen.get("answers_per_prompt") or 1)
    if temperature <= 0 and answers <= 1:
        return ""
    return (f"; note: answers were sampled (generate.temperature {temperature:g}, {answers} answer(s) per prompt), "
            "so its tau is taken on sampled continuations and predicts greedy serving (T=0) less closely")


def _resume_fingerprint(book: StageBook) -> str:
    """The fingerprint of the run's settings less its length (LENGTH_KEYS): checkpoints carrying it
    are continued by a run that is only longer (or shorter, down to the steps they made)."""
    settings = {**book.settings, STAGE: {k: v for k, v in book.settings[STAGE].items() if k not in LENGTH_KEYS}}
    return replace(book, settings=settings).fingerprint


def _settings(cfg, layers: list[int], precision: str, rel: Released | None = None) -> dict:
    """What the manifest records and the fingerprint covers: the train section (less
    NOT_FINGERPRINTED, less ADDED_LATER_DEFAULTS at their defaults), the aux layers, the precision used, and the
    released drafter's contents when the run starts from one."""
    section = cfg.section(STAGE)
    section[STAGE] = fingerprinted(section[STAGE], NOT_FINGERPRINTED, ADDED_LATER_DEFAULTS)
    settings = {**section, "aux_layers": layers, "precision_used": precision, "version": TRAIN_VERSION}
    if rel is not None:
        settings["init_from"] = rel.settings()
    if (served := served_states(cfg)) is not None:
        settings["online_states"] = served
    return settings


# -------------------------------------------------------------------------------------------------
# fit: the loop


def fit(ts: TrainState, prog: Progress, stop: DeferredStop) -> None:
    """Optimizer steps until ts.total_steps (or the time budget), logging every train.log_every_s
    and checkpointing every train.checkpoint_every steps; on a stop signal (`stop`, noted on any
    rank) a checkpoint of the step just made on every rank, then the signal raised."""
    tc, device = ts.cfg.train, ts.ranks.device
    data = step_stream(ts.packing, ts.source, ts.position, ts.ranks.rank, ts.ranks.world, tc.grad_accum,
                       prepare=_host_step(ts), feeder=DeviceFeeder(device, _act_dtype(ts), tc.grad_accum))
    window = Window(ts.folder, tc.log_every_s, ts.objective.steps, ts.ranks.rank, device, ts.start_step, say,
                    ts.trackers)
    ts.budget.start()
    try:
        while ts.step < ts.total_steps:
            t = time.perf_counter()
            ts.position, micro_batches = next(data)  # on the device, with their layouts
            window.times["data"] += time.perf_counter() - t

            shared = _share_step(ts, micro_batches, window, stop)
            if shared["bad_states"][0] > 0:
                raise _non_finite_states(ts, micro_batches)
            ts.budget.clock_s = shared["clock_s"]
            grad_norm = _optimizer_step(ts, micro_batches, shared["denom"], window)
            ts.step += 1
            ts.tokens_seen += int(shared["tokens"])
            ts.samples_seen += int(shared["samples"])
            window.tokens += int(shared["tokens"])
            window.steps += 1
            stop_now = shared["stop"] > 0
            if stop_now:
                ts.total_steps = ts.planned = ts.step  # the time budget ends the run here
                prog.set_total(ts.step)
            prog.advance(1)

            _note_flex(ts)
            if shared["log"] > 0:
                _log_window(ts, window, grad_norm, stop_now, prog)
            if stop_now:
                break
            if ts.validation is not None and ts.step % tc.validate_every == 0 and ts.step < ts.total_steps:
                _validate(ts, prog, window)  # before a checkpoint of this step, which keeps its figures
                _note_flex(ts)
            if shared["interrupt"] > 0 and ts.step < ts.total_steps:  # every rank sees it at the same step
                _save(ts, ts.folder / "checkpoints" / f"step_{ts.step}", keep=tc.keep_checkpoints)
                say(f"checkpoint of step {ts.step} written: the same command resumes from it")
                stop.raise_now()
            if ts.step % tc.checkpoint_every == 0 and ts.step < ts.total_steps:
                _save(ts, ts.folder / "checkpoints" / f"step_{ts.step}", keep=tc.keep_checkpoints)
    finally:
        data.close()


def _note_flex(ts: TrainState) -> None:
    """A line per graph flex attention compiled since the last note (rank 0): each costs its step tens of
    seconds, and their count stays within the run's bound (past it flex stops with an error, model/ttt.py)."""
    if ts.flex_bound is None:
        return
    for n, what in enumerate(FLEX_GRAPHS[ts.flex_noted:], start=ts.flex_noted - ts.flex_before + 1):
        say(f"flex attention: compiled graph {n} ({what}); at most {ts.flex_bound} in this run")
    ts.flex_noted = len(FLEX_GRAPHS)


def _act_dtype(ts: TrainState):
    return torch.bfloat16 if ts.precision == "bf16" else torch.float32


def _host_step(ts: TrainState, validation: bool = False):
    """What a micro-batch goes through on the host before the device (in the data thread): the loss mask, then
    the sizes the loss takes from it (the objective's layout). `validation`: the answers' tokens alone, where
    serving drafts, whatever train.loss_on and loss_skip_tokens train on."""
    tc, layout_of = ts.cfg.train, ts.objective.layouts()
    loss_on, skip = ("assistant", 0) if validation else (tc.loss_on, tc.loss_skip_tokens)

    def prepare(b):
        b = replace(b, loss_mask=loss_positions(b.loss_mask, b.doc_ids, b.position_ids, loss_on, skip))
        return replace(b, layout=layout_of(b.input_ids, b.loss_mask, b.doc_ids))
    return prepare


def _validate(ts: TrainState, prog: Progress, window: Window | None) -> None:
    """A validation pass after step ts.step (every rank): its figures into ts.val_metrics, and on rank 0 a
    metrics.jsonl row and a log line. Its time counts neither in the time budget nor in the window's rate."""
    tc = ts.cfg.train
    figs = ts.validation.run(ts.objective, ts.source, _host_step(ts, validation=True), ts.ranks.device, _act_dtype(ts),
                             ts.precision, ts.ranks, say, tc.log_every_s, prog.busy)
    ts.budget.loop_t0 += figs["seconds"]
    if window is not None:
        window.t0 += figs["seconds"]
    ts.val_metrics = {"step": ts.step, **figs}
    ts.val_passes += 1
    if ts.ranks.rank == 0:
        Window.write_validation(ts.folder, ts.val_metrics, say, ts.trackers)
    tau, best = figs.get("acceptance_length"), (ts.best_val or {}).get("acceptance_length")
    if tau is not None and (best is None or tau > best):  # the same figures on every rank: the same decision
        ts.best_val = ts.val_metrics
        _save(ts, ts.folder / BEST_DIR)
        say(f"validation tau {tau:.3f} at step {ts.step}: the best of {ts.val_passes} pass(es), kept in "
            f"train/{BEST_DIR} (export.checkpoint=best exports it)")


def _best_on_disk(folder: Path) -> dict | None:
    """The validation figures train/best/ was kept for (rank 0 reads them; clear_for_attempt has moved a best/ of
    another run aside), or None."""
    path = folder / BEST_DIR / CKPT_STATE
    try:
        return (read_json_object(path).get("validation") or None) if path.is_file() else None
    except DraftsmithError:
        return None  # damaged: the next pass writes a new one


def loss_positions(loss_mask, doc_ids, position_ids, loss_on: str, skip: int):
    """[R, T] bool: where the loss is taken. `assistant`: prepare's mask; `all`: every token of every
    sample (padding, doc_ids -1, excluded); either without each sample's first `skip` tokens
    (position_ids count from 0 in each sample)."""
    mask = doc_ids >= 0 if loss_on == "all" else loss_mask
    return mask & (position_ids >= skip) if skip else mask


def trained_tokens(run, source, lengths: list[int], row_len: int, loss_on: str, skip: int) -> int | None:
    """Tokens in the loss of the samples training reads (`lengths` above 0: the held-out ones are 0), each cut to a
    row, by loss_positions' rule: what the model card calls trained (prepare's count holds every sample's answers,
    the held-out ones included, whatever train.loss_on). The masks are the online source's own; offline,
    prepare/samples.jsonl's, which extract stored and verifies; None when that file is gone or holds other samples
    (the count is the card's: it never stops a run)."""
    def masks():
        if isinstance(source, PreparedSource):
            yield from source.masks
        else:
            for _, _, _, mask in iter_prepared(run, by="counting the trained tokens"):
                yield mask
    total, seen = 0, 0
    try:
        for n, mask in zip(lengths, masks()):
            seen += 1
            if n:
                cut = min(n, row_len, len(mask))
                total += max(0, cut - skip) if loss_on == "all" else int(mask[skip:cut].sum())
    except DraftsmithError:
        return None
    return total if seen == len(lengths) else None


def _share_step(ts: TrainState, micro_batches: list, window: Window, stop: DeferredStop) -> dict:
    """What every rank needs before the step, in one all-reduce: `denom` [ttt_steps] the positions
    of each TTT step over the whole step (all ranks), the step's `tokens` and `samples`; rank 0's
    `clock_s` and decisions to `log` after this step and to `stop` after it (time budget); and
    `interrupt`, whether any rank got a stop signal (the step then ends with a checkpoint)."""
    rank = ts.ranks.rank
    denom = torch.stack([ts.objective.counts(b) for b in micro_batches]).sum(0)
    # stored states that are not finite anywhere, inside the loss or not (a damaged store file):
    # every rank learns of them here, so all stop together, each naming its own files
    bad_states = torch.stack([~(torch.isfinite(b.aux_hidden).all() & torch.isfinite(b.last_hidden).all())
                              for b in micro_batches]).sum().reshape(1)
    now_s = ts.budget.trained_s() if rank == 0 else 0.0
    last_by_time = rank == 0 and ts.budget.should_stop(now_s, ts.step - ts.start_step)
    want_log = rank == 0 and window.due(ts.step, ts.total_steps, last_by_time)
    return sum_by_name({"denom": denom, "tokens": sum(b.tokens for b in micro_batches),
                        "samples": sum(len(b.samples) for b in micro_batches),
                        "log": float(want_log), "clock_s": now_s, "stop": float(last_by_time),
                        "interrupt": float(stop.requested), "bad_states": bad_states}, ts.ranks)


def _optimizer_step(ts: TrainState, micro_batches: list, denom: list[float], window: Window) -> float:
    """Forward and backward over this rank's micro-batches, then (unless a loss or the gradient
    is not finite) one optimizer and scheduler step; returns the gradient norm before clipping.

    Nothing is read back from the device per micro-batch (on CUDA the host queues them all
    without waiting); the step's one read is the gradient norm with the finiteness of every loss.
    """
    tc, world = ts.cfg.train, ts.ranks.world
    autocast = torch.autocast(ts.ranks.device.type, dtype=torch.bfloat16, enabled=ts.precision == "bf16")
    losses = []  # [] per micro-batch, on the device: read one by one only when the step's check fails
    for j, b in enumerate(micro_batches):
        # gradients are reduced across ranks once per step, after the last micro-batch
        last_mb = j == len(micro_batches) - 1
        if world > 1 and tc.fsdp:
            ts.objective.set_requires_gradient_sync(last_mb)
        sync = ts.model.no_sync() if hasattr(ts.model, "no_sync") and not last_mb else contextlib.nullcontext()
        with sync:
            t = time.perf_counter()
            with autocast:
                loss, stats = ts.model(b, denom, scale=float(world))
            losses.append(loss.detach())
            window.times["forward"] += time.perf_counter() - t
            t = time.perf_counter()
            loss.backward()
            window.times["backward"] += time.perf_counter() - t
        window.stats += stats

    t = time.perf_counter()
    norm_t = torch.nn.utils.clip_grad_norm_(ts.params, tc.grad_clip)
    norm_t = norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t
    # the step's one device->host read: the norm and whether every micro-batch's loss was finite
    grad_norm, finite = torch.stack([norm_t.double(), torch.isfinite(torch.stack(losses)).all().double()]).tolist()
    if not (finite and math.isfinite(grad_norm)):
        bad = [ts.source.name(i) for b, loss in zip(micro_batches, losses) if not torch.isfinite(loss)
               for i in b.samples]
        raise _non_finite(ts, bad, grad_norm)
    ts.optimizer.step()
    if tc.ema > 0:
        update_ema(ts.optimizer, ts.params, tc.ema, ts.step + 1)
    ts.budget.stepped(ts.step)
    ts.scheduler.step()
    ts.optimizer.zero_grad(set_to_none=True)
    window.times["optimizer"] += time.perf_counter() - t
    return grad_norm


def _non_finite_states(ts: TrainState, micro_batches: list) -> DraftsmithError:
    """The error for non-finite target states in this step's micro-batches (on any rank): the
    files of the samples that hold them (offline; gathered from every rank) and the command that
    finds and redoes every such file; online, where nothing is stored, the samples."""
    mine = [(ts.source.name(i), ts.source.damaged(i)) for b in micro_batches
            if not (torch.isfinite(b.aux_hidden).all() and torch.isfinite(b.last_hidden).all()) for i in b.samples]
    everyone = [mine]
    if ts.ranks.world > 1:
        everyone = [None] * ts.ranks.world
        dist.all_gather_object(everyone, mine)
    found = [x for r in everyone for x in r]
    files = [why for _, why in found if why]
    good = complete_checkpoints(ts.folder / "checkpoints")
    kept = f"the last good checkpoint is {good[-1][1]}" if good else "no checkpoint was written yet"
    if files:
        more = f" (and {len(files) - 1} more)" if len(files) > 1 else ""
        return DraftsmithError(f"{files[0]}{more}; `draftsmith extract --run {ts.run.path} --verify` finds and "
                               f"rewrites such files; stopped at step {ts.step + 1} without updating the weights; "
                               f"{kept}")
    ids = [name for name, _ in found]
    return DraftsmithError(f"train: the target's hidden states of samples {ids[:20]} are not finite at step "
                           f"{ts.step + 1}; "
                           f"stopped without updating the weights; {kept}")


def _non_finite(ts: TrainState, bad: list[str], grad_norm: float) -> DraftsmithError:
    """The error that stops the run before a non-finite update. NaN gradients reach every rank
    through the all-reduce, so all ranks get here together and gather the bad samples' names."""
    everyone = [bad]
    if ts.ranks.world > 1:
        everyone = [None] * ts.ranks.world
        dist.all_gather_object(everyone, bad)
    ids = [i for r in everyone for i in r]
    good = complete_checkpoints(ts.folder / "checkpoints")
    kept = f"the last good checkpoint is {good[-1][1]}" if good else "no checkpoint was written yet"
    what = (f"non-finite loss in the micro-batch(es) of samples {ids[:20]}" + (" ..." if len(ids) > 20 else "")
            if ids else f"non-finite gradient norm ({grad_norm})")
    return DraftsmithError(f"train: {what} at step {ts.step + 1}; stopped without updating the weights; {kept}")


def _log_window(ts: TrainState, window: Window, grad_norm: float, stop_now: bool, prog: Progress) -> None:
    """The metrics of the window of steps since the last log (every rank: the statistics are
    summed over ranks); rank 0 writes them. With a time budget, the steps it is expected to allow."""
    loss_k, acc_k, dt = window.summary(ts.ranks.world)
    tps = window.tokens / dt if dt > 0 else 0.0
    eta = (ts.total_steps - ts.step) * dt / max(1, window.steps)
    if ts.budget.budget_s is not None and not stop_now:
        left_s = ts.budget.left_s()
        eta = min(eta, left_s)
        ts.planned = min(ts.total_steps, ts.step + int(left_s * window.steps / dt)) if dt > 0 else ts.planned
        prog.set_total(ts.planned)
    tau, per_pos = window.chain()
    if loss_k[0] is None and ts.ranks.rank == 0:
        say(f"warning: steps up to {ts.step} had no trained token: the answers of their samples lie past "
            f"train.seq_len ({ts.packing.row_len} tokens) or outside train.loss_on; their loss is n/a and nothing "
            "was learnt from them (raise train.seq_len, or lower prepare.max_length)")
    ts.metrics = {
        "step": ts.step, "total_steps": ts.planned, "epoch": ts.position[0], "loss": loss_k, "acc": acc_k,
        "acceptance_length": tau, "acceptance_per_position": per_pos, "lr": ts.scheduler.get_last_lr()[0],
        "grad_norm": grad_norm,
        "tokens_per_s": tps, "tokens": ts.tokens_seen, "samples": ts.samples_seen,
        "elapsed_s": time.time() - ts.book.started, "cpu_s": time.process_time() - ts.cpu0,
        "step_time_s": {k: v / max(1, window.steps) for k, v in window.times.items()},
    }
    if ts.ranks.rank == 0:
        window.write(ts.metrics, eta, ts.val_metrics)
    window.reset()


def _save(ts: TrainState, dest: Path, keep: int | None = None) -> None:
    """A checkpoint of the run as it stands (every rank calls it; rank 0 writes)."""
    now = time.time()
    state = {"step": ts.step, "total_steps": ts.total_steps, "epoch": ts.position[0], "micro_batch": ts.position[1],
             "resume_fingerprint": _resume_fingerprint(ts.book),
             "tokens_seen": ts.tokens_seen, "samples_seen": ts.samples_seen, "world_size": ts.ranks.world,
             "grad_accum": ts.cfg.train.grad_accum, "train_fingerprint": ts.book.fingerprint, "time": now,
             "elapsed_s": round(now - ts.book.started, 3), "metrics": ts.metrics,
             "train_s": round(ts.budget.trained_s(), 3), "warmup_end_s": ts.budget.warmup_end_s,
             "validation": ts.val_metrics, "best_validation": ts.best_val, "validation_passes": ts.val_passes}
    save_checkpoint(dest, ts.objective, ts.optimizer, ts.scheduler, rank=ts.ranks.rank, world=ts.ranks.world,
                    device=ts.ranks.device, meta={**ts.meta, "step": ts.step}, state=state, fc_scale=ts.fc_scale,
                    keep=keep)


# -------------------------------------------------------------------------------------------------
# finish: last checkpoint, final/, manifest


def finish(ts: TrainState, prog: Progress) -> dict | None:
    """The last step's checkpoint (unless the attempt resumed from it), final/, and on rank 0 the
    manifest, which it returns (None on the other ranks)."""
    ema = ts.cfg.train.ema > 0
    if ts.validation is not None and not ema and (ts.val_metrics or {}).get("step") != ts.step:
        _validate(ts, prog, None)  # the figures the drafter leaves training with, kept in the checkpoints below
    if ts.step > ts.start_step:
        _save(ts, ts.folder / "checkpoints" / f"step_{ts.step}", keep=ts.cfg.train.keep_checkpoints)
    final_dir = ts.folder / FINAL_DIR
    if ema:
        load_ema(ts.optimizer, ts.params)  # after the last checkpoint, which keeps the raw weights to resume from
        if ts.validation is not None:
            _validate(ts, prog, None)  # final/ holds the averaged weights: their figures, not the raw ones'
    _save(ts, final_dir)
    manifest = None
    _note_flex(ts)
    flex = None if ts.flex_bound is None else {"graphs": len(FLEX_GRAPHS) - ts.flex_before, "bound": ts.flex_bound}
    if flex is not None:
        say(f"flex attention: {flex['graphs']} graph(s) compiled in this run (at most {flex['bound']}: its length "
            "buckets x TTT steps x 2 grad modes)")
    if ts.ranks.rank == 0:
        m = ts.metrics or {}
        counts = {"done": ts.step, "total": ts.total_steps, "unit": "steps", "tokens": ts.tokens_seen,
                  "samples": ts.samples_seen, "acceptance_length": m.get("acceptance_length"),
                  "loss": m.get("loss"), "acc": m.get("acc"), "train_minutes": round(ts.budget.trained_s() / 60.0, 2),
                  "validation": ts.val_metrics, "best_validation": ts.best_val, "validation_passes": ts.val_passes,
                  "trained_samples": sum(1 for n in ts.packing.lengths if n > 0),
                  "held_out": 0 if ts.validation is None else len(ts.validation),
                  "trained_tokens": trained_tokens(ts.run, ts.source, ts.packing.lengths, ts.packing.row_len,
                                                   ts.cfg.train.loss_on, ts.cfg.train.loss_skip_tokens)}
        kept = [final_dir, *([ts.folder / BEST_DIR] if (ts.folder / BEST_DIR).is_dir() else [])]
        outputs = sorted(str(p.relative_to(ts.folder)) for d in kept for p in d.iterdir()) + ["metrics.jsonl"]
        # what a GPU run planned from: rank 0's peak of memory allocated by torch (bytes)
        peak = torch.cuda.max_memory_allocated(ts.ranks.device) if ts.ranks.device.type == "cuda" else None
        manifest = ts.book.finish(counts=counts, outputs=outputs,
                                  extra={"aux_layers": ts.meta["aux_layers"], "final": f"{STAGE}/final",
                                         "world_size": ts.ranks.world, "peak_memory_bytes": peak,
                                         "flex_graphs": flex})
    prog.end(steps=ts.step, tokens=ts.tokens_seen)
    return manifest
