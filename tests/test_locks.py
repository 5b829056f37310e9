"""One process per stage of a run, one `run` per run: a second one is refused in one line, before
it reads or writes anything, and the live one's files (its journal, pipeline.json) stay as they are.

A holder process takes the lock exactly as a running stage does (RunDir.stage_lock / run_lock, what
stage.one_process and pipeline.run_pipeline take), so each refusal is tested without racing a real
stage's timing."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_cli
from draftsmith.rundir import RunDir

STAGE_COMMANDS = ["generate", "prepare", "vocab", "extract", "train", "export", "eval"]


class Holder:
    """A process that holds a run's lock (`stage` or `run`) until closed."""

    def __init__(self, run: Path, what: str):
        take = "r.run_lock()" if what == "run" else f"r.stage_lock({what!r}, by='draftsmith {what}')"
        code = ("import sys, time; from draftsmith.rundir import RunDir; r = RunDir(sys.argv[1]); "
                f"lock = {take}; lock.__enter__(); print('held', flush=True); sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code, str(run)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "held"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.parts[-2] != ".locks"}


@pytest.fixture
def live_run(tmp_path, tiny_target):
    """A run folder whose generate stage has a journal and a log, as a live stage leaves them."""
    run = RunDir(tmp_path / "run").ensure()
    d = run.stage_dir("generate")
    (d / "progress.jsonl").write_text(json.dumps({"ev": "start", "t": 1.0, "pid": 1, "total": 3}) + "\n")
    (d / "stage.log").write_text("12:00:00 [generate] decoding batch 1/1 ...\n")
    return run


@pytest.mark.parametrize("stage", STAGE_COMMANDS)
def test_a_second_process_on_a_stage_is_refused_in_one_line(live_run, tiny_target, stage):
    holder = Holder(live_run.path, stage)
    try:
        before = snapshot(live_run.path)
        p = run_cli(stage, "--run", str(live_run.path), "--set", f"target={tiny_target}", timeout=300)
        assert p.returncode == 2, (p.stdout, p.stderr)
        assert p.stderr.strip().splitlines() == [
            f"draftsmith: error: {live_run.path / stage}: another `draftsmith {stage}` is running on this run "
            f"(pid {holder.proc.pid})"], p.stderr
        assert snapshot(live_run.path) == before  # not even a journal line of its own
    finally:
        holder.close()


def test_run_is_refused_while_a_stage_or_another_run_lives(live_run, tiny_target, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tiny_target}\n")
    for what, message in (("train", f"{live_run.path / 'train'}: `draftsmith train` is running on this run (pid "),
                          ("run", f"{live_run.path}: another `draftsmith run` is running on it (pid ")):
        holder = Holder(live_run.path, what)
        try:
            before = snapshot(live_run.path)
            p = run_cli("run", str(recipe), "--run", str(live_run.path), timeout=300)
            assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
            assert p.stderr.startswith(f"draftsmith: error: {message}{holder.proc.pid})"), p.stderr
            assert snapshot(live_run.path) == before and not (live_run.path / "pipeline.json").exists()
            st = run_cli("status", str(live_run.path), "--json")
            assert st.returncode == 0 and "pipeline" not in json.loads(st.stdout)
        finally:
            holder.close()


def cli_in_process(capsys, *args: str) -> tuple[int, str]:
    """(exit code, stderr) of `draftsmith ARGS` run in this process (draftsmith.cli.main, as the console script
    runs it): the refusals below come before any stage starts, so no interpreter start is worth paying for each."""
    from draftsmith.cli import main

    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    return code, capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2"}, "$WORLD_SIZE=2 without $MASTER_ADDR and $MASTER_PORT: start the ranks with torchrun"),
    ({"WORLD_SIZE": "0"}, "$WORLD_SIZE=0: must be 1 or more"),
    ({"WORLD_SIZE": "-1"}, "$WORLD_SIZE=-1: must be 1 or more"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "$RANK=2: must be in 0..1"),
    ({"RANK": "one"}, "$RANK='one': not a whole number"),
], ids=["no-torchrun", "zero", "negative", "rank-outside", "not-a-number"])
@pytest.mark.parametrize("command", ["train", "extract", "run"])
def test_distributed_variables_torchrun_cannot_have_set_are_refused_before_any_work(tmp_path, tiny_target, env,
                                                                                    message, command, capsys,
                                                                                    monkeypatch):
    """Garbage in RANK/WORLD_SIZE: one line naming the variable, nothing started, and the finished
    stage's status untouched (it was shown `failed` after a torch traceback)."""
    from draftsmith.progress import Progress

    with Progress(RunDir(tmp_path).ensure(), "train", total=3, unit="steps", console=False) as prog:
        prog.advance(3)  # a finished stage, as sim_stage.py leaves one
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"target: {tiny_target}\n")
    args = ["run", str(recipe), "--run", str(tmp_path)] if command == "run" else [command, "--run", str(tmp_path)]
    before = snapshot(tmp_path)
    with monkeypatch.context() as m:
        for k, v in env.items():
            m.setenv(k, v)
        code, err = cli_in_process(capsys, *args, "--set", f"target={tiny_target}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"draftsmith: error: {message}"), err
    assert snapshot(tmp_path) == before
    row = next(s for s in json.loads(run_cli("status", str(tmp_path), "--json").stdout)["stages"] if s["name"] == "train")
    assert row["state"] == "done"


@pytest.mark.parametrize("stage", ["prepare", "vocab", "extract"])  # (train, export and eval make the folder first)
def test_a_stage_on_a_run_that_does_not_exist_creates_nothing(tmp_path, tiny_target, stage, capsys):
    """A mistyped --run: the stage's one line about its missing upstream, and no folder made for the
    lock (only generate, the stage that starts a run, creates it)."""
    missing = tmp_path / "typo"
    code, err = cli_in_process(capsys, stage, "--run", str(missing), "--set", f"target={tiny_target}")
    assert code == 2 and ("before" in err or "first" in err), err  # names what to run
    assert len(err.strip().splitlines()) == 1, err
    assert not missing.exists()
