"""Kill anywhere: SIGKILL a stage at random points, start it again, and compare the result with an
uninterrupted run. `generate` (local backend, temperature 0) and `extract` must end with the same
bytes, `train` with the same final weights, and `draftsmith run` with the same artifacts.

How a kill point is drawn: the stage runs as a subprocess (the way a user runs it); once its
progress journal holds the start line of *this* attempt (its pid), the harness waits, then sends
SIGKILL. It waits a random share of the time the uninterrupted stage took (scaled by the share of
work still left, read from that start line), or, for extract, until a random number of sample
files are on disk. Each seed is a chain: two to four such kills, each attempt resuming the last,
then an attempt that runs to the end. So kills land anywhere: while the target loads, between and
inside file writes, mid-step and mid-checkpoint, and (through `run`) in any stage. A kill that comes
after the attempt ended counts as nothing; each chain must have killed at least one live attempt.

One seed by default keeps the module near two minutes on two busy cores;
DRAFTSMITH_KILL_SEEDS=0,1,2,... searches wider.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO
from tiny_pipeline import (THREADS, TRAIN_STEPS, assert_same_weights, build_talkative_target, load_weights, stage_files,
                           write_config, write_prompts)

SEEDS = [int(s) for s in os.environ.get("DRAFTSMITH_KILL_SEEDS", "0").split(",") if s.strip()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    target = build_talkative_target(root / "target")
    prompts = write_prompts(root / "prompts.jsonl", 24)
    return root, target, prompts


# -------------------------------------------------------------------------------------------------
# The harness


def journal_start(path: Path, pid: int) -> dict | None:
    """The start line of a stage's journal when it belongs to process `pid`, else None."""
    try:
        with open(path, "rb") as f:
            ev = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return ev if ev.get("ev") == "start" and ev.get("pid") == pid else None


def stage_seconds(run: Path, stage: str) -> float:
    """How long the stage's finished attempt took, from its journal (start line to end line)."""
    lines = (run / stage / "progress.jsonl").read_text().splitlines()
    first, last = json.loads(lines[0]), json.loads(lines[-1])
    assert last["ev"] == "end", f"{stage} did not finish: {last}"
    return last["t"] - first["t"]


def after_time(seconds: dict[str, float]):
    """Kill points in time: a random share of what the stage took uninterrupted (scaled by the
    share of its work still left, from its start line), counted from that start line."""
    def wait(run: Path, stage: str, start: dict, rng: random.Random, proc) -> str:
        left = 1.0 - start["done"] / start["total"] if start.get("total") else 1.0
        delay = rng.uniform(0.0, seconds[stage] * max(left, 0.25))
        time.sleep(delay)
        return f"{delay:.3f}s after {stage} started with {start.get('done')}/{start.get('total')} done"
    return wait


def after_files(pattern: str, total: int):
    """Kill points in the writing: once k of the stage's `total` files are on disk, k drawn from
    what it had at its start to total - 1 (the kill then lands while file k + 1 or a later one,
    or a shard record, is being written: the writer thread does not wait for the harness)."""
    def wait(run: Path, stage: str, start: dict, rng: random.Random, proc) -> str:
        d = run / stage
        # every file may already be on disk (an earlier attempt was killed while sealing its shards):
        # then the kill lands at once, in the shard records or the manifest
        k = rng.randint(min(len(list(d.glob(pattern))), total - 1), total - 1)
        while len(list(d.glob(pattern))) < k and proc.poll() is None:
            time.sleep(0.001)
        return f"after {k} of {total} files"
    return wait


@dataclass
class Attempt:
    stage: str | None  # the stage the kill was aimed at (None: the attempt ran to its end)
    point: str  # where, in words
    killed_alive: bool  # SIGKILL reached a process that was still running
    returncode: int


def attempt(args: list[str], run: Path, stages: list[str], wait=None, rng: random.Random | None = None,
            log: Path | None = None) -> Attempt:
    """Start `draftsmith ARGS`. With `wait` and `rng`: pick one of `stages` that is not complete yet,
    wait for its journal to show this process's start line, then for `wait(...)`, and SIGKILL.
    Without: let it run to the end."""
    todo = [s for s in stages if not (run / s / "manifest.json").is_file()]
    with open(log, "a") as out:
        out.write(f"\n$ draftsmith {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen([sys.executable, "-m", "draftsmith", *args], cwd=REPO, env={**os.environ, **THREADS},
                                stdout=out, stderr=subprocess.STDOUT)
    try:
        if wait is None or not todo:
            return Attempt(None, "to the end", False, proc.wait(timeout=300))
        stage = rng.choice(todo[:3])  # one of the next three: a chain of kills then walks the whole run
        journal = run / stage / "progress.jsonl"
        deadline = time.time() + 120
        while (start := journal_start(journal, proc.pid)) is None:
            if proc.poll() is not None or time.time() > deadline:  # it ended before reaching that stage
                return Attempt(stage, "never started", False, proc.wait(timeout=300))
            time.sleep(0.002)
        point = wait(run, stage, start, rng, proc)
        alive = proc.poll() is None
        proc.send_signal(signal.SIGKILL)
        return Attempt(stage, point, alive, proc.wait(timeout=60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def kill_chain(args: list[str], run: Path, stages: list[str], wait, seed: int, log: Path, kills: int = 3) -> list[Attempt]:
    """`kills` attempts killed at random points, then one that runs to the end."""
    rng = random.Random(seed)
    history = []
    for _ in range(kills):
        a = attempt(args, run, stages, wait, rng, log)
        history.append(a)
        with open(log, "a") as out:
            out.write(f"-> {a}\n")
        if a.returncode != -signal.SIGKILL:  # it finished before the kill
            assert a.returncode == 0, log.read_text()[-3000:]
            break
    last = attempt(args, run, stages, log=log)
    assert last.returncode == 0, log.read_text()[-3000:]
    history.append(last)
    assert any(a.killed_alive for a in history), f"no kill landed before the end: {history}"
    return history


def copy_inputs(src: Path, dst: Path, stages: list[str]) -> Path:
    """A new run folder holding `stages` of the run `src` (finished upstream stages)."""
    dst.mkdir(parents=True)
    shutil.copy(src / "run.json", dst / "run.json")
    for s in stages:
        shutil.copytree(src / s, dst / s)
    return dst


def no_leftovers(run: Path) -> None:
    """No temporary folder of a killed attempt (a train checkpoint, an export) and no temporary
    sample file of extract survives a completed stage. A kill inside a single small atomic write
    (pipeline.json, a manifest, config.yaml) may leave its hidden `.NAME.RANDOM.tmp` file: never
    read, never under a final name, so nothing is corrupt."""
    left = [p for p in run.rglob(".*") if p.name.endswith(".tmp") or ".tmp-" in p.name]
    bad = [str(p.relative_to(run)) for p in left if p.is_dir() or p.parent.name.startswith("rows_")]
    assert not bad, bad


# -------------------------------------------------------------------------------------------------
# The reference: one uninterrupted run of every stage


STAGES = ["generate", "prepare", "vocab", "extract", "train", "export", "eval"]


@pytest.fixture(scope="module")
def reference(inputs):
    """One uninterrupted `draftsmith run` (a subprocess like every attempt below, so that the time
    each stage takes there scales the kill delays)."""
    root, target, prompts = inputs
    config = write_config(root / "config.yaml", target, prompts)
    run = root / "reference"
    a = attempt(["run", str(config), "--run", str(run)], run, [], log=root / "reference.log")
    assert a.returncode == 0, (root / "reference.log").read_text()[-3000:]
    return run, config, {s: stage_seconds(run, s) for s in STAGES}


# -------------------------------------------------------------------------------------------------
# generate


@pytest.mark.parametrize("seed", SEEDS)
def test_generate_killed_anywhere_resumes_to_the_same_file(reference, tmp_path, seed):
    ref, config, seconds = reference
    run = tmp_path / "run"
    # (two kills: the states a kill leaves in samples.jsonl are covered more cheaply by the next test)
    history = kill_chain(["generate", "--run", str(run), "--config", str(config)], run, ["generate"],
                         after_time(seconds), seed, tmp_path / "log", kills=2)
    # Byte for byte and in the same order: finished samples are a prefix of the batch order.
    assert (run / "generate" / "samples.jsonl").read_bytes() == (ref / "generate" / "samples.jsonl").read_bytes(), history
    assert not (run / "generate" / "failures.jsonl").exists()
    assert json.loads((run / "generate" / "manifest.json").read_text())["fingerprint"] == \
        json.loads((ref / "generate" / "manifest.json").read_text())["fingerprint"]
    no_leftovers(run)


def test_generate_cut_at_any_byte_resumes_to_the_same_file(reference, tmp_path, one_thread):
    """What a SIGKILL leaves while generate appends is samples.jsonl cut at some byte: whole
    lines, maybe a torn one, maybe part of a batch (the local backend appends a batch's samples
    one by one). Random cuts, each resumed (in-process: the same numbers as the CLI on one
    thread), must end with the uninterrupted file, byte for byte. A resumed attempt batches what
    is left differently (a partly written batch shifts the later ones); left padding keeps each
    sample's greedy answer the same."""
    from draftsmith.config import load_config
    from draftsmith.generate.stage import run_generate
    from draftsmith.rundir import RunDir

    ref, config, _ = reference
    want = (ref / "generate" / "samples.jsonl").read_bytes()
    newlines = [i for i, b in enumerate(want) if b == ord("\n")]
    rng = random.Random(0)
    cuts = [rng.randrange(1, len(want)), newlines[4] + 1, newlines[9] + 1 + 10]  # anywhere; after 5 lines; 10 lines + a torn one
    for cut in cuts:
        run = copy_inputs(ref, tmp_path / f"cut{cut}", ["generate"])
        (run / "generate" / "manifest.json").unlink()
        (run / "generate" / "samples.jsonl").write_bytes(want[:cut])
        run_generate(RunDir(run), load_config(config))
        assert (run / "generate" / "samples.jsonl").read_bytes() == want, cut


# -------------------------------------------------------------------------------------------------
# extract: more samples than the pipeline makes, so that kills land among the file writes


EXTRACT_SAMPLES = 240


@pytest.fixture(scope="module")
def extract_reference(inputs, one_thread):
    """A run with prepared samples (random tokens, lengths 8-100) and its uninterrupted extract
    (in-process, one thread: the same bytes as the CLI)."""
    import yaml

    from draftsmith.config import load_config
    from draftsmith.extract.stage import run_extract
    from draftsmith.rundir import RunDir, fingerprint
    from draftsmith.target import target_info

    root, target, _ = inputs
    info = target_info(str(target))
    config = root / "extract.yaml"
    config.write_text(yaml.safe_dump({"target": str(target), "extract": {"shard_size": 50, "batch_tokens": 128}}))
    run = RunDir(root / "extract-reference").ensure()
    rng = random.Random(0)
    lines = []
    for i in range(EXTRACT_SAMPLES):
        n = rng.randint(8, 100)
        ids = [rng.randrange(3, info.vocab_size) for _ in range(n)]
        lines.append(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [int(j >= n // 3) for j in range(n)]}) + "\n")
    text = "".join(lines)
    (run.stage_dir("prepare") / "samples.jsonl").write_text(text)
    run.write_manifest("prepare", fingerprint=fingerprint(text), settings={},
                       inputs={"target": info.name, "target_fingerprint": info.fingerprint},
                       counts={"done": EXTRACT_SAMPLES, "total": EXTRACT_SAMPLES, "unit": "samples"},
                       started=time.time(), outputs=["samples.jsonl"])
    run_extract(run, load_config(config))
    return run.path, config


@pytest.mark.parametrize("seed", SEEDS)
def test_extract_killed_anywhere_resumes_to_the_same_files(extract_reference, tmp_path, seed):
    ref, config = extract_reference
    run = copy_inputs(ref, tmp_path / "run", ["prepare"])
    history = kill_chain(["extract", "--run", str(run), "--config", str(config)], run, ["extract"],
                         after_files("rows_*/*.safetensors", EXTRACT_SAMPLES), seed, tmp_path / "log")
    want, got = stage_files(ref, "extract", "rows_*/*"), stage_files(run, "extract", "rows_*/*")
    assert len(want) == EXTRACT_SAMPLES + 5 and want.keys() == got.keys(), history  # + 5 shard.json
    for name in want:
        if name.endswith("shard.json"):  # its "finished" time differs; names, sizes and checksums must not
            a, b = json.loads(want[name]), json.loads(got[name])
            assert {k: v for k, v in a.items() if k != "finished"} == {k: v for k, v in b.items() if k != "finished"}, name
        else:
            assert got[name] == want[name], (name, history)
    assert (run / "extract" / "meta.json").read_bytes() == (ref / "extract" / "meta.json").read_bytes()
    assert json.loads((run / "extract" / "manifest.json").read_text())["counts"]["done"] == EXTRACT_SAMPLES
    no_leftovers(run)


# -------------------------------------------------------------------------------------------------
# train


@pytest.mark.parametrize("seed", SEEDS)
def test_train_killed_anywhere_resumes_to_the_same_weights(reference, tmp_path, seed):
    ref, config, seconds = reference
    run = copy_inputs(ref, tmp_path / "run", ["generate", "prepare", "vocab", "extract"])
    history = kill_chain(["train", "--run", str(run), "--config", str(config)], run, ["train"],
                         after_time(seconds), seed, tmp_path / "log")
    assert_same_weights(load_weights(ref / "train" / "final" / "model.safetensors"),
                        load_weights(run / "train" / "final" / "model.safetensors"))
    rows = [json.loads(x) for x in (run / "train" / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r.get("split") is None]  # the train lines (validation passes have their own)
    assert steps == sorted(set(steps)) and steps[-1] == TRAIN_STEPS, history
    assert len(list((run / "train" / "checkpoints").glob("step_*"))) <= 2
    no_leftovers(run)


# -------------------------------------------------------------------------------------------------
# The same through `draftsmith run`


@pytest.mark.parametrize("seed", SEEDS)
def test_run_killed_anywhere_ends_like_an_uninterrupted_run(reference, tmp_path, seed):
    ref, config, seconds = reference
    run = tmp_path / "run"
    history = kill_chain(["run", str(config), "--run", str(run)], run, STAGES, after_time(seconds), seed, tmp_path / "log",
                         kills=4)
    for stage in ("generate", "prepare"):
        assert (run / stage / "samples.jsonl").read_bytes() == (ref / stage / "samples.jsonl").read_bytes(), (stage, history)
    # (safetensors writes its metadata in hash-map order, so equal vocabularies may differ in bytes)
    assert_same_weights(load_weights(ref / "vocab" / "vocab.safetensors"), load_weights(run / "vocab" / "vocab.safetensors"))
    assert stage_files(run, "extract", "rows_*/*.safetensors") == stage_files(ref, "extract", "rows_*/*.safetensors")
    assert_same_weights(load_weights(ref / "train" / "final" / "model.safetensors"),
                        load_weights(run / "train" / "final" / "model.safetensors"))
    assert_same_weights(load_weights(ref / "export" / "model.safetensors"), load_weights(run / "export" / "model.safetensors"))
    report = json.loads((run / "eval" / "report.json").read_text())
    want = json.loads((ref / "eval" / "report.json").read_text())
    assert report["acceptance_length"] == want["acceptance_length"] and report["prompts"] == 2
    answers = [json.loads(x) for x in (run / "eval" / "answers.jsonl").read_text().splitlines()]
    assert sorted(a["id"] for a in answers) == ["p0", "p1"]  # each prompt once
    pipeline = json.loads((run / "pipeline.json").read_text())
    assert pipeline["finished"] and pipeline["error"] is None
    no_leftovers(run)
