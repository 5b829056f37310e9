"""A kill while old checkpoints are pruned leaves nothing that outlives the next attempt.

Found by the kill soak (tests/test_kill_anywhere.py, train, seed 14): a SIGKILL while a checkpoint
folder was being deleted left `step_119` without its state.json. It no longer counted as a
checkpoint, so no later prune saw it, and the finished run kept three checkpoint folders
(keep_last is 2): a whole checkpoint's disk (optimizer state included) leaked for good."""

import json

import pytest

from draftsmith.train import checkpoint as ck


def make_checkpoints(ck_dir, steps):
    for n in steps:
        d = ck_dir / f"step_{n}"
        d.mkdir(parents=True)
        for name in (ck.CKPT_WEIGHTS, ck.CKPT_META, ck.CKPT_OPTIM, ck.CKPT_RNG):
            (d / name).write_bytes(b"x" * 100)
        (d / ck.CKPT_STATE).write_text(json.dumps({"step": n, "train_fingerprint": "fp"}))


def test_prune_keeps_the_newest(tmp_path):
    ck_dir = tmp_path / "train" / "checkpoints"
    make_checkpoints(ck_dir, [10, 20, 30])
    ck.prune_checkpoints(ck_dir, 2)
    assert sorted(p.name for p in ck_dir.iterdir()) == ["step_20", "step_30"]


def test_a_kill_mid_prune_leaves_nothing_after_the_next_attempt(tmp_path, monkeypatch):
    folder = tmp_path / "train"
    ck_dir = folder / "checkpoints"
    make_checkpoints(ck_dir, [10, 20, 30])

    def killed_rmtree(path, ignore_errors=False):
        # the process dies after deleting some files, state.json among them
        (path / ck.CKPT_STATE).unlink()
        (path / ck.CKPT_OPTIM).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.shutil, "rmtree", killed_rmtree)
    with pytest.raises(KeyboardInterrupt):
        ck.prune_checkpoints(ck_dir, 2)
    monkeypatch.undo()
    # the half-deleted folder is not a checkpoint under its final name
    assert [n for n, _ in ck.complete_checkpoints(ck_dir)] == [20, 30]
    ck.clear_for_attempt(folder, lambda state: state.get("train_fingerprint") == "fp", "fp", print)  # the next attempt
    assert sorted(p.name for p in ck_dir.iterdir()) == ["step_20", "step_30"]


def test_a_leftover_of_an_earlier_version_is_removed(tmp_path):
    """A step_N without state.json older than the newest checkpoint (what the old prune left)."""
    folder = tmp_path / "train"
    ck_dir = folder / "checkpoints"
    make_checkpoints(ck_dir, [119, 147, 150])
    (ck_dir / "step_119" / ck.CKPT_STATE).unlink()
    ck.clear_for_attempt(folder, lambda state: state.get("train_fingerprint") == "fp", "fp", print)
    assert sorted(p.name for p in ck_dir.iterdir()) == ["step_147", "step_150"]


def test_a_best_of_another_run_goes_aside_alone_and_one_of_this_run_stays(tmp_path):
    folder = tmp_path / "train"
    make_checkpoints(folder / "checkpoints", [10, 20])
    make_checkpoints(folder, [15])
    (folder / "step_15").rename(folder / ck.BEST_DIR)
    keep = lambda state: state.get("train_fingerprint") == "fp"  # noqa: E731
    ck.clear_for_attempt(folder, keep, "fp", print)
    assert (folder / ck.BEST_DIR / ck.CKPT_STATE).is_file()  # this run's: kept
    state = json.loads((folder / ck.BEST_DIR / ck.CKPT_STATE).read_text())
    (folder / ck.BEST_DIR / ck.CKPT_STATE).write_text(json.dumps({**state, "train_fingerprint": "other"}))
    ck.clear_for_attempt(folder, keep, "fp", print)
    assert not (folder / ck.BEST_DIR).exists() and (folder / "previous" / ck.BEST_DIR).is_dir()
    assert [n for n, _ in ck.complete_checkpoints(folder / "checkpoints")] == [10, 20]  # the run goes on
