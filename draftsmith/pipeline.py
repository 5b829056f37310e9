"""`draftsmith run` and `draftsmith demo`: the stages in order, each skipped when current.

Every stage's `run_<stage>(run, cfg)` compares the fingerprint of its current inputs and settings
with its manifest and returns at once when they match ("up to date"); a changed input changes
that stage's fingerprint and, through it, every later one, so they all rerun. A killed `run`
started again resumes: finished stages are skipped and the interrupted one resumes from its files.

`RUN/pipeline.json` records the pid, the planned stages and the current one, so that `status`
and `watch` can follow a whole run.
"""

from __future__ import annotations

import functools
import json
import os
import re
import socket
import time

from draftsmith import DraftsmithError, one_line
from draftsmith import stages as registry
from draftsmith.estimate import DEFAULT_PROMPT_TOKENS, HARDWARE, RUN_ESTIMATE, estimate_config, save_run_estimate
from draftsmith.generate.samples import SAMPLES, measured_lengths
from draftsmith.progress import error_line, log
from draftsmith.released import preflight
from draftsmith.host import gpu_names, release_device_memory, thread_policy
from draftsmith.rundir import RunDir, atomic_write_json
from draftsmith.store_format import format_name


def planned_stages(cfg, from_stage: str | None = None, until_stage: str | None = None) -> list[str]:
    """The stages `run` executes: those of the registry its config runs (not extract when training online)."""
    stages = list(registry.planned(cfg))
    for name, flag in ((from_stage, "--from"), (until_stage, "--until")):
        if name is not None and name not in stages:
            raise DraftsmithError(f"{flag} {name}: not a stage of this run (stages: {', '.join(stages)})")
    lo = stages.index(from_stage) if from_stage else 0
    hi = stages.index(until_stage) + 1 if until_stage else len(stages)
    if lo >= hi:
        raise DraftsmithError(f"--from {from_stage} comes after --until {until_stage}")
    return stages[lo:hi]


def run_pipeline(run: RunDir, cfg, from_stage: str | None = None, until_stage: str | None = None,
                 extra_engines: tuple[str, ...] = (), on_stage_done=None, retake_threads: bool = False
                 ) -> dict[str, dict]:
    """Run the planned stages; then, for each of extra_engines, eval again with that engine into
    RUN/eval-<engine>/ (the demo's vLLM evaluation beside the local one). on_stage_done(stage,
    seconds) is called after each stage (the demo's estimate of what is left). retake_threads: the
    thread rule (host.thread_policy) taken again before each stage after the first (the CLI's
    `run` and `demo`: what kept the cores busy at the start, setup or a server, may have ended since).

    One `run` per run folder, and none while a stage of it runs in another process: refused in
    one line before pipeline.json or any journal of the live one is touched."""
    preflight(cfg, functools.partial(log, stage="run"))  # train.init_from refused in one line before any stage
    with run.run_lock():
        run.refuse_if_busy()
        return _run_stages(run, cfg, from_stage, until_stage, extra_engines, on_stage_done, retake_threads)


def _run_stages(run: RunDir, cfg, from_stage: str | None, until_stage: str | None, extra_engines: tuple[str, ...],
                on_stage_done, retake_threads: bool) -> dict[str, dict]:
    stages = planned_stages(cfg, from_stage, until_stage)
    if "eval" in stages:
        stages += [f"eval-{e}" for e in extra_engines]
    planned = registry.planned(cfg)
    before = planned[:planned.index(stages[0])]
    for s in before:
        run.require_manifest(s, by=f"run --from {stages[0]}")
    state = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "stages": stages,
             "current": None, "finished": False, "error": None}
    atomic_write_json(run.path / "pipeline.json", state)
    save_expectation(run, cfg)
    manifests: dict[str, dict] = {}
    t0 = time.time()
    try:
        for stage in stages:
            state["current"] = stage
            atomic_write_json(run.path / "pipeline.json", state)
            ts = time.time()
            log(f"=== {stage} ({stages.index(stage) + 1}/{len(stages)})", stage="run")
            if retake_threads and stages.index(stage) > 0:  # the CLI took it for the first
                log(thread_policy(cfg.threads, cfg.device)[1], stage="run")
            stage_cfg, fn = cfg, registry.get(stage).run_function()
            if stage not in registry.REGISTRY:  # eval-<engine>, eval[-<engine>]-k<K>
                engine, k = eval_folder(stage, cfg.eval.engine)
                stage_cfg = cfg.model_copy(deep=True)
                stage_cfg.eval.engine = engine
                if k is not None:
                    stage_cfg.eval.num_speculative_tokens = k
                fn = functools.partial(fn, folder=stage)
            if stage == "extract" and not cfg.extract.overwrite:
                # `run` promises that a changed input reruns every later stage; a store built from
                # other prepared samples or settings is useless to them, so it is replaced (a
                # store of the same build is resumed, never cleared). Not a finished store of the
                # other format, though: the default changed from bf16 to fp8, and days of
                # extraction must not go because a run was resumed with a newer draftsmith.
                _refuse_other_format(run, cfg.extract.store_format)
                stage_cfg = cfg.model_copy(deep=True)
                stage_cfg.extract.overwrite = True
            manifests[stage] = fn(run, stage_cfg)
            release_device_memory()  # a stage's models are gone with its frame: their cached GPU blocks go too
            skipped = manifests[stage].get("finished", 0) < ts
            log(f"=== {stage}: {'up to date, skipped' if skipped else f'done in {time.time() - ts:.0f}s'}", stage="run")
            if stage == stages[-1] and (confirm := confirm_stage(run, cfg, stage)):
                stages.append(confirm)
                state["stages"] = stages
                log(f"=== {stage} predicts another K faster than the one it served: measuring it ({confirm})",
                    stage="run")
            if on_stage_done is not None:
                on_stage_done(stage, None if skipped else time.time() - ts)
    except BaseException as e:
        state["error"] = error_line(e)
        state["interrupted"] = isinstance(e, KeyboardInterrupt)
        atomic_write_json(run.path / "pipeline.json", state)
        raise
    state["current"], state["finished"] = None, True
    atomic_write_json(run.path / "pipeline.json", state)
    log(f"all stages done in {time.time() - t0:.0f}s", stage="run")
    return manifests


def eval_folder(name: str, default_engine: str) -> tuple[str, int | None]:
    """(engine, K or None) of an eval folder's name: eval-<engine>, eval-k<K>, eval-<engine>-k<K>."""
    m = re.fullmatch(r"eval(?:-([a-z]+))?(?:-k(\d+))?", name)
    if m is None:
        raise DraftsmithError(f"{name}: not an eval folder name (eval-<engine>[-k<K>])")
    return m.group(1) or default_engine, int(m.group(2)) if m.group(2) else None


def confirm_stage(run: RunDir, cfg, folder: str) -> str | None:
    """With eval.num_speculative_tokens auto, the evaluation that measures the K the last one (`folder`) found
    fastest by its prediction (draftsmith/speedup.py), in the same engine: `<folder>-k<K>`; None when the last
    stage is no evaluation, K is not auto, or the best K is the one measured."""
    if cfg.eval.num_speculative_tokens != "auto" or not (folder == "eval" or folder.startswith("eval-")):
        return None
    if eval_folder(folder, cfg.eval.engine)[1] is not None:
        return None  # a confirmation itself
    try:
        kc = json.loads((run.path / folder / "report.json").read_text()).get("k_choice")
    except (OSError, ValueError):
        return None
    if not isinstance(kc, dict) or kc.get("block") or kc.get("best_k") == kc.get("measured_k"):
        return None
    return f"{folder}-k{kc['best_k']}"


def save_expectation(run: RunDir, cfg) -> None:
    """RUN/estimate.json: `draftsmith estimate` of this config on this machine's hardware profile (a GPU's by
    its name, else cpu), so that `status` shows each stage's estimate beside what it took. Advisory: a GPU
    without a profile, or a target the estimate cannot read, is one line and the run goes on."""
    (run.path / RUN_ESTIMATE).unlink(missing_ok=True)  # an earlier run's, perhaps of another config
    names = gpu_names()
    hardware = "cpu" if names is None else next((k for k in HARDWARE if k != "cpu" and k in names[0].lower()), None)
    devices = 1 if names is None else len(names)
    if hardware is None:
        log(f"no estimate beside the stages in status: {names[0]} has no profile in `draftsmith estimate` "
            f"({', '.join(HARDWARE)})", stage="run")
        return
    # the answers' own lengths once generate has some (a resumed run), else the recipe's planned length
    measured = measured_lengths(run.path / "generate" / SAMPLES)
    prompt_tokens, answer_tokens = (measured[0], measured[1]) if measured else (DEFAULT_PROMPT_TOKENS, None)
    try:
        e = estimate_config(cfg, hardware, devices, None, prompt_tokens, answer_tokens)
    except (DraftsmithError, OSError, ValueError) as err:
        log(f"no estimate beside the stages in status: {one_line(err)}", stage="run")
        return
    lengths = (f"--prompt-tokens {prompt_tokens} --answer-tokens {answer_tokens} (the mean of {measured[2]} answers "
               "generate wrote)" if measured else
               f"--prompt-tokens {prompt_tokens} --answer-tokens {e['assumptions']['answer_tokens']} (planned: "
               + ("generate.planned_answer_tokens)" if cfg.generate.planned_answer_tokens else
                  "0.85 x generate.max_tokens; a reasoning recipe sets generate.planned_answer_tokens)"))
    save_run_estimate(run, e, f"draftsmith estimate CONFIG --hardware {hardware} --devices {devices} {lengths}")


def _refuse_other_format(run: RunDir, wanted: str) -> None:
    old = run.read_manifest("extract")
    if old is None:
        return
    held = format_name(old.get("settings") or {})
    if held != wanted:
        raise DraftsmithError(
            f"{run.path / 'extract'}: holds a finished {held} store, but extract.store_format is {wanted} "
            f"(the default is fp8; stores made before it are bf16); set extract.store_format={held} to keep "
            "training from it, or extract.overwrite=true to replace it")


def current_evals(run: RunDir) -> list[str]:
    """The eval folders (eval, eval-<engine>) whose report is of this run's drafter, not left from an earlier one."""
    export = (run.read_manifest("export") or {}).get("fingerprint")

    def current(folder: str) -> bool:
        m = run.read_manifest(folder)
        return (m is not None and (m.get("inputs") or {}).get("export") == export
                and (run.path / folder / "report.json").is_file())

    return [f for f in ("eval", *sorted(p.name for p in run.path.glob("eval-*"))) if current(f)]


def summarize(run: RunDir) -> str:
    """What a finished run got: acceptance length and speedup per evaluation, and where things are."""
    folders = current_evals(run)
    if not folders:
        return f"run finished: {run.path}"
    return "\n".join(_summary_line(run, f) for f in folders) + f"\ndrafter: {run.path / 'export'}"


def _summary_line(run: RunDir, folder: str) -> str:
    r = json.loads((run.path / folder / "report.json").read_text())
    tau = f"{r['acceptance_length']:.2f}" if r.get("acceptance_length") is not None else "n/a (no drafts)"
    per_pos = ", ".join("n/a" if a is None else f"{a:.2f}" for a in r.get("acceptance_per_position") or [])
    speedup = (f"speedup {r['speedup']:.2f}x" if r.get("speedup") is not None
               else "no speedup measured (eval.baseline off)")
    return (f"{r['engine']} engine: acceptance length {tau} (per position {per_pos}) "
            f"at K={r['num_speculative_tokens']}, {speedup} on {r['prompts']} prompts; "
            f"report {run.path / folder / 'report.md'}")
