"""The one stage bookkeeping every `run_<stage>` uses: upstream checks, fingerprint, the
up-to-date rule, the resolved config beside the outputs, and the manifest written last.

A stage reads like this (vocab, in short):

    @stage_run("vocab")                  # one process at a time on it; an error it raises is in its journal
    def run_vocab(run, cfg):
        prep = upstream(run, "prepare", by="draftsmith vocab", target=info)
        book = StageBook(run, "vocab", cfg, settings={...}, upstream={"prepare": prep}, target=info)
        if (done := book.skip_or_begin(outputs_ok=st_path.is_file(), said=...)) is not None:
            return done                  # same inputs and settings, outputs present: skip
        # begun: the manifest is gone (not done meanwhile), config.yaml written
        with book.progress(total=n, unit="samples") as prog:   # journal, heartbeats, log lines
            ...                          # the work
            return book.finish(counts={...}, outputs=[...])

The fingerprint covers the stage's settings, what identifies its inputs that are not another
stage (`fingerprint_extra`: a prompt file's hash, the dtype), the target's fingerprint and the
fingerprints of the upstream manifests; `run` reruns a stage, and through its fingerprint every
later one, whenever any of these changes.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from draftsmith import DraftsmithError
from draftsmith.journal import env_rank
from draftsmith.progress import Progress, journal_failures, log
from draftsmith.rundir import RunDir, check_files, stage_fingerprint, write_stage_config


def one_process(stage: str):
    """Decorator of `run_<stage>(run, cfg, ...)`: the call holds the stage's lock
    (RunDir.stage_lock; per rank: a `rank` argument, else torchrun's RANK), so that a second
    process on the same stage of the same run is refused in one line before it reads or writes
    anything. Put it above @journal_failures: the refused process must not journal its refusal
    into the live one's journal. eval's `folder` keyword names the folder it writes."""
    def wrap(fn):
        @functools.wraps(fn)
        def locked(run, cfg, *args, **kwargs):
            run = run if isinstance(run, RunDir) else RunDir(run)
            rank = kwargs.get("rank")
            rank = env_rank()[0] if rank is None else rank
            if not run.path.exists() and stage != "generate":
                # no process can be on a run that does not exist, and this stage fails at its upstream
                # check: taking the lock would create the (mistyped) run folder for nothing
                return fn(run, cfg, *args, **kwargs)
            with run.stage_lock(kwargs.get("folder", stage), by=f"draftsmith {stage}", rank=rank):
                return fn(run, cfg, *args, **kwargs)
        return locked
    return wrap


def stage_run(stage: str):
    """The frame of every `run_<stage>(run, cfg, ...)`: the stage's lock held for the call (one_process: a second
    process is refused in one line), and an error it raises recorded in the stage's journal
    (progress.journal_failures: `status` shows it, a bug's traceback goes to its stage.log), in that order."""
    def wrap(fn):
        return one_process(stage)(journal_failures(stage)(fn))
    return wrap


def recorded_target_fingerprint(manifest: dict) -> str | None:
    """The target fingerprint a manifest records, under the keys stages use (`inputs`, or the
    manifest itself, as `target_fingerprint` or `target: {fingerprint}`)."""
    inputs = manifest.get("inputs") or {}
    for holder in (inputs, manifest):
        fp = holder.get("target_fingerprint")
        if isinstance(fp, str):
            return fp
        t = holder.get("target")
        if isinstance(t, dict) and isinstance(t.get("fingerprint"), str):
            return t["fingerprint"]
    return None


def check_target(run: RunDir, stage: str, manifest: dict, target) -> None:
    """Refuse an upstream stage built for another target than `target` (a TargetInfo)."""
    fp = recorded_target_fingerprint(manifest)
    if fp is not None and fp != target.fingerprint:
        raise DraftsmithError(
            f"{run.manifest_path(stage)}: built for another target (fingerprint {fp}) than the configured "
            f"target {target.name} ({target.fingerprint}); use the same `target` for every stage of a run")


def upstream(run: RunDir, stage: str, by: str, target=None) -> dict:
    """The completed manifest of `stage`, which `by` (a command line) needs; when `target` is
    given, refused if that stage was built for another target."""
    manifest = run.require_manifest(stage, by=by)
    if target is not None:
        check_target(run, stage, manifest, target)
    # what the stage wrote is checked by what it is, not trusted because its manifest says it finished
    if (problem := check_files(manifest, run.path / stage)) is not None:
        raise DraftsmithError(f"{problem} (changed since {stage} finished; `{by}` reads it): rerun "
                              f"`draftsmith {stage} --run {run.path}`")
    return manifest


@dataclass
class StageBook:
    """One stage's bookkeeping in a run directory. `name` is the stage folder ("eval-vllm" for
    a second evaluation); `settings` is what the manifest records (usually the config section
    with the stage's format version)."""

    run: RunDir
    name: str
    cfg: Any
    settings: dict[str, Any]
    upstream: dict[str, dict | None] = field(default_factory=dict)
    target: Any = None
    fingerprint_extra: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    @property
    def fingerprint(self) -> str:
        own = {**self.settings, **self.fingerprint_extra}
        if self.target is not None:
            own["target_fingerprint"] = self.target.fingerprint
        return stage_fingerprint(own, self.upstream)

    @property
    def inputs(self) -> dict[str, Any]:
        """What the manifest records as this stage's inputs."""
        inputs: dict[str, Any] = {k: (m or {}).get("fingerprint") for k, m in self.upstream.items()}
        if self.target is not None:
            inputs.update(target=self.target.name, target_fingerprint=self.target.fingerprint)
        return inputs

    def previous(self) -> dict | None:
        """The manifest of the last completed build of this stage, if any."""
        return self.run.read_manifest(self.name)

    def up_to_date(self, outputs_ok: bool = True) -> dict | None:
        """The previous manifest when it was built from the same inputs and settings and its
        outputs are in place (`outputs_ok`, checked by the stage); else None."""
        old = self.previous()
        if old is not None and old.get("fingerprint") == self.fingerprint and outputs_ok:
            if (problem := check_files(old, self.run.path / self.name)) is None:
                return old
            log(f"{problem}: done again", stage=self.name)
        return None

    def skip(self, outputs_ok: bool = True, said: Callable[[dict], str] | None = None,
             holds: Callable[[dict], bool] | None = None) -> dict | None:
        """The previous manifest when the stage is up to date (up_to_date) and, given `holds`, its outputs
        still hold on a closer look than the checked files' hashes (extract: a stat of every file, the damaged
        ones removed), with the line `up to date (<said(manifest)>); nothing to do` when `said` is given; else
        None. skip_or_begin begins then; a stage that must check more first calls begin itself (train: a bad
        value leaves a finished run as it was; extract: under the ranks' lock, after its store's own check)."""
        old = self.up_to_date(outputs_ok)
        if old is None or (holds is not None and not holds(old)):
            return None
        if said is not None:
            log(f"up to date ({said(old)}); nothing to do", stage=self.name)
        return old

    def skip_or_begin(self, outputs_ok: bool = True, said: Callable[[dict], str] | None = None) -> dict | None:
        """The previous manifest when the stage is up to date (skip, its line when `said` is given); else None,
        and the stage begun (begin)."""
        if (old := self.skip(outputs_ok, said)) is None:
            self.begin()
        return old

    def progress(self, total: int | None, unit: str, **kwargs) -> Progress:
        """The stage's progress reporter (journal, heartbeats, log lines) in its folder, stalled after the
        config's stall_after_s; `kwargs` as Progress takes them (done, rank, world_size, console, shared)."""
        return Progress(self.run, self.name, total=total, unit=unit, stall_after_s=self.cfg.stall_after_s, **kwargs)

    def begin(self) -> None:
        """From here until `finish` the stage counts as not done (its files stay, for resume);
        the resolved config goes beside what it writes."""
        self.run.invalidate(self.name)
        self.write_config()

    def write_config(self) -> None:
        """The resolved config beside the stage's outputs, without touching its manifest (a check of
        a finished stage, such as `extract --verify`, keeps it done unless it finds damage)."""
        write_stage_config(self.run, self.name, self.cfg)

    def finish(self, counts: dict[str, Any], outputs: list[str] | None = None, extra: dict[str, Any] | None = None,
               inputs: dict[str, Any] | None = None, checked: list[str] | None = None) -> dict:
        """Write the manifest (the record that the stage completed, with the size and hash of each file of
        `checked`, default the outputs: RunDir.write_manifest) and return it."""
        return self.run.write_manifest(self.name, fingerprint=self.fingerprint,
                                       inputs={**self.inputs, **(inputs or {})},
                                       settings=self.settings, counts=counts, started=self.started,
                                       outputs=outputs, extra=extra, checked=checked)
