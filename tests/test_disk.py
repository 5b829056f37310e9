"""A full disk. extract's preflight refuses through the CLI; a disk that fills while generate,
extract or train writes (a real 16 MiB tmpfs that a ballast file fills, as another process
would) ends with one line naming the file, exit 2, nothing corrupt under a final name, no
manifest and the stage `failed` in status; once the ballast is removed, the same command
completes with the outputs of an uninterrupted run.

The tmpfs tests need root to mount (they skip otherwise); the unit tests of the pieces that turn
ENOSPC into that one line (rundir.is_disk_full, atomic_path, append_bytes) run anywhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, run_cli
from draftsmith import DraftsmithError
from draftsmith.rundir import DiskFull, append_bytes, atomic_write_bytes, is_disk_full
from tiny_pipeline import (THREADS, assert_same_weights, build_talkative_target, load_weights, stage_files,
                           write_config, write_prompts)

FULL = re.compile(r"^draftsmith: error: (\S+): no space left on device; free some space and run the same command again")


# -------------------------------------------------------------------------------------------------
# The pieces (no root needed)


def test_is_disk_full_knows_the_errors_of_os_and_libraries():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    # safetensors' Rust error carries only the text
    assert is_disk_full(RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)"))
    # torch.save into a Python file object raises its own error with the OSError behind it
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    except RuntimeError as e:
        assert is_disk_full(e)
    assert not is_disk_full(RuntimeError("unexpected pos 576 vs 534"))


def test_atomic_write_on_a_full_disk_names_the_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    target = tmp_path / "meta.json"
    target.write_bytes(b"old")
    real = Path.write_bytes

    def half_then_enospc(self, data):
        real(self, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", half_then_enospc)
    with pytest.raises(DiskFull) as e:
        atomic_write_bytes(target, b"new contents")
    assert isinstance(e.value, DraftsmithError) and str(e.value).startswith(f"{target}: no space left on device")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["meta.json"]


def test_append_on_a_full_disk_leaves_no_torn_line(tmp_path, monkeypatch):
    import draftsmith.rundir as rundir

    path = tmp_path / "samples.jsonl"
    path.write_bytes(b'{"id": "a"}\n')
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    real = os.write
    calls = []

    def short_then_enospc(fd_, data):  # what a filling disk does: a short write, then ENOSPC
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd_, data[:5])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rundir.os, "write", short_then_enospc)
    try:
        with pytest.raises(DiskFull, match="samples.jsonl: no space left on device"):
            append_bytes(fd, b'{"id": "b", "messages": []}\n', path)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert calls == [28, 23]  # the short write was continued before the disk gave out
    assert path.read_bytes() == b'{"id": "a"}\n'  # cut back: the next append starts on a clean line


@pytest.mark.parametrize("where", ["under-a-file", "under-proc"])
def test_run_directory_that_cannot_be_made_is_one_line(tmp_path, where):
    """`--run` under a file, or where no folder can be made: one line naming it, exit 2, nothing written."""
    if where == "under-a-file":
        (tmp_path / "f").write_text("x")
        run = tmp_path / "f" / "run"
    else:
        run = Path("/proc/draftsmith-run")
    p = subprocess.run([sys.executable, "-m", "draftsmith", "generate", "--run", str(run), "--backend", "dataset"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [f"draftsmith: error: {run}: cannot create the run directory "
                                             f"({'Not a directory' if where == 'under-a-file' else 'No such file or directory'})"]


@pytest.mark.parametrize("err, line", [
    ((errno.ENOSPC, "No space left on device", "/runs/r1/eval/report.md"),
     "draftsmith: error: /runs/r1/eval/report.md: no space left on device"),
    ((errno.EROFS, "Read-only file system", "/runs/r1/eval/report.md"),
     "draftsmith: error: /runs/r1/eval/report.md: Read-only file system"),
])
def test_cli_reports_a_refused_write_in_one_line(monkeypatch, capsys, err, line):
    """A write no stage code wraps (a library's own file, a log) on a full disk or a read-only file
    system: still one line naming the file, exit 2."""
    import draftsmith.cli as cli

    def app(**kw):
        raise OSError(*err)

    monkeypatch.setattr(cli, "app", app)
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--run", "/runs/r1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith(line)


# -------------------------------------------------------------------------------------------------
# A real full disk


class SmallDisk:
    """A 16 MiB tmpfs; `fill()` takes its free space with a ballast file, `release()` frees it."""

    def __init__(self, path: Path):
        self.path = path
        self.ballast = path / "ballast"

    def free(self) -> int:
        return shutil.disk_usage(self.path).free

    def fill(self, leave: int = 0) -> None:
        with open(self.ballast, "ab") as f:
            if self.free() > leave + (1 << 20):
                os.posix_fallocate(f.fileno(), 0, self.free() - leave - (1 << 19))
            chunk = b"\0" * 4096
            try:
                while self.free() > leave:
                    f.write(chunk)
                    f.flush()
            except OSError as e:
                assert e.errno == errno.ENOSPC and leave == 0
        assert self.free() <= leave + 4096

    def release(self) -> None:
        self.ballast.unlink()


@pytest.fixture
def small_disk(tmp_path):
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {p.stderr.strip()}")
    try:
        yield SmallDisk(mnt)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_thread):
    """generate .. train, uninterrupted, in-process on one thread (the same numbers as the CLI)."""
    from draftsmith.config import load_config
    from draftsmith.pipeline import run_pipeline
    from draftsmith.rundir import RunDir

    root = tmp_path_factory.mktemp("disk")
    config = write_config(root / "config.yaml", build_talkative_target(root / "target"),
                          write_prompts(root / "prompts.jsonl", 24))
    run = RunDir(root / "reference")
    run_pipeline(run, load_config(config), until_stage="train")
    return run.path, config


def copy_stages(src: Path, dst: Path, stages: list[str]) -> Path:
    dst.mkdir(parents=True)
    shutil.copy(src / "run.json", dst / "run.json")
    for s in stages:
        shutil.copytree(src / s, dst / s)
    return dst


def draftsmith(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftsmith", *args], cwd=REPO, env={**os.environ, **THREADS},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"the stage ended before {what}: {proc.communicate()}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def check_full_disk_failure(run: Path, stage: str, code: int, err: str) -> Path:
    """Exit 2, one line naming a file of the stage, no traceback, no manifest, status `failed`."""
    assert code == 2 and "Traceback" not in err, err
    m = FULL.match(err.strip().splitlines()[-1])
    assert m, err
    named = Path(m.group(1))
    assert named.is_relative_to(run / stage), named
    assert not (run / stage / "manifest.json").exists()
    st = json.loads(run_cli("status", str(run), "--json").stdout)
    row = next(s for s in st["stages"] if s["name"] == stage)
    assert row["state"] == "failed" and "no space left on device" in row["error"], row
    return named


def temp_leftovers(d: Path) -> list[str]:
    return [str(p) for p in d.rglob(".*") if p.name.endswith(".tmp") or ".tmp-" in p.name]


def test_extract_preflight_then_a_disk_that_fills_then_resume(reference, small_disk):
    ref, config = reference
    run = copy_stages(ref, small_disk.path / "run", ["generate", "prepare", "vocab"])
    store = sum(len(b) for b in stage_files(ref, "extract", "rows_*/*.safetensors").values())
    small_disk.fill(leave=store // 2)
    args = ["extract", "--run", str(run), "--config", str(config)]

    # The preflight: refused before any sample file is written.
    p = run_cli(*args, env=THREADS)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert re.match(r"^draftsmith: error: \S+/extract: not enough disk space: extract needs .* but .* is free; "
                    r"free space, use another run dir, or pass --force$", p.stderr.strip()), p.stderr
    assert not list((run / "extract").glob("rows_*/*.safetensors"))

    # --force: the disk fills half-way through the store.
    p = run_cli(*args, "--force", env=THREADS)
    named = check_full_disk_failure(run, "extract", p.returncode, p.stderr)
    assert named.name.endswith(".safetensors") or named.name.endswith(".json"), named
    want = stage_files(ref, "extract", "rows_*/*.safetensors")
    got = stage_files(run, "extract", "rows_*/*.safetensors")
    assert 0 < len(got) < len(want)
    assert all(got[k] == want[k] for k in got)  # every file under a final name is whole and right
    assert not temp_leftovers(run / "extract")
    # the journal counts what is on disk: a sample is counted once its file is committed, never before
    row = next(x for x in json.loads(run_cli("status", str(run), "--json").stdout)["stages"] if x["name"] == "extract")
    assert row["done"] == row["on_disk"] == len(got), row

    # Space freed: the same command completes and equals an uninterrupted run.
    small_disk.release()
    p = run_cli(*args, env=THREADS)
    assert p.returncode == 0, p.stderr
    assert f"resuming: {len(got)} of 24 samples already done" in p.stdout
    assert stage_files(run, "extract", "rows_*/*.safetensors") == want
    assert json.loads((run / "extract" / "manifest.json").read_text())["counts"]["done"] == 24


def test_train_disk_fills_between_checkpoints_then_resume(reference, small_disk):
    import torch
    from safetensors.torch import load_file

    ref, config = reference
    run = copy_stages(ref, small_disk.path / "run", ["generate", "prepare", "vocab", "extract"])
    args = ["train", "--run", str(run), "--config", str(config)]
    ck = run / "train" / "checkpoints"
    proc = draftsmith(*args)
    wait_for(lambda: (ck / "step_7" / "state.json").is_file(), proc, "the first checkpoint")
    small_disk.fill()
    out, err = proc.communicate(timeout=300)
    check_full_disk_failure(run, "train", proc.returncode, err)
    assert not (run / "train" / "final").exists() and not temp_leftovers(run / "train")
    complete = sorted(ck.glob("step_*"))
    assert complete
    for d in complete:  # every checkpoint under a final name loads whole
        assert sorted(p.name for p in d.iterdir()) == ["drafter.json", "model.safetensors", "optimizer.pt",
                                                       "rng.safetensors", "state.json"]
        load_file(str(d / "model.safetensors"))
        load_file(str(d / "rng.safetensors"))
        torch.load(d / "optimizer.pt", weights_only=True)
        assert json.loads((d / "state.json").read_text())["step"] == int(d.name[5:])
    lines = (run / "train" / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x)["step"] for x in lines)  # whole lines only

    small_disk.release()
    p = run_cli(*args, env=THREADS)
    assert p.returncode == 0, p.stderr
    assert f"resumed from {complete[-1]}" in p.stdout
    assert_same_weights(load_weights(ref / "train" / "final" / "model.safetensors"),
                        load_weights(run / "train" / "final" / "model.safetensors"))


@pytest.mark.parametrize("stage", ["prepare", "vocab", "extract", "train", "export"])
def test_a_disk_full_when_a_stage_starts_names_a_file(reference, small_disk, stage):
    """No room at all before the stage writes anything: the one line names the file it could not write (its lock,
    its journal, its config), not just "no space left"."""
    ref, config = reference
    before = {"prepare": ["generate"], "vocab": ["generate", "prepare"], "extract": ["generate", "prepare", "vocab"],
              "train": ["generate", "prepare", "vocab", "extract"],
              "export": ["generate", "prepare", "vocab", "extract", "train"]}[stage]
    run = copy_stages(ref, small_disk.path / "run", before)
    small_disk.fill()
    p = run_cli(stage, "--run", str(run), "--config", str(config), "--set", "extract.force=true", env=THREADS)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    m = FULL.match(p.stderr.strip().splitlines()[-1])
    assert m and Path(m.group(1)).is_relative_to(run), p.stderr


def test_generate_disk_fills_mid_run_then_resume(reference, small_disk):
    ref, config = reference
    run = small_disk.path / "run"
    args = ["generate", "--run", str(run), "--config", str(config)]
    samples = run / "generate" / "samples.jsonl"
    proc = draftsmith(*args)
    wait_for(lambda: samples.is_file() and samples.stat().st_size > 0, proc, "the first samples")
    small_disk.fill()
    out, err = proc.communicate(timeout=300)
    check_full_disk_failure(run, "generate", proc.returncode, err)
    want = (ref / "generate" / "samples.jsonl").read_bytes()
    got = samples.read_bytes()
    assert got.endswith(b"\n") and want.startswith(got)  # whole lines, the first ones of an uninterrupted run

    small_disk.release()
    p = run_cli(*args, env=THREADS)
    assert p.returncode == 0, p.stderr
    assert samples.read_bytes() == want
