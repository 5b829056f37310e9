"""Reliability by mechanism (docs/reliability.md, fourth pass): an exception that is not a known user error is one
line naming the stage and where its traceback went, never a traceback on the terminal; training whose answers all
lie past the row length says so and writes valid JSON."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from test_train import cfg_for, cycle_samples, make_run, metrics  # noqa: F401
from draftsmith.target import target_info
from draftsmith.train.stage import run_train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_bug_is_one_line_and_its_traceback_goes_to_the_stage_log(tiny8, tmp_path):
    run = make_run(tmp_path / "run", tiny8, cycle_samples(target_info(str(tiny8)).vocab_size, 8), extract=False)
    # a bug inside the vocab stage, as if select_draft_vocab had one
    code = ("import draftsmith.vocab as v\n"
            "def boom(*a, **k): raise ZeroDivisionError('a synthetic bug')\n"
            "v.select_draft_vocab = boom\n"
            "from draftsmith.cli import main\n"
            f"main(['vocab', '--run', {str(run.path)!r}, '--set', 'target={tiny8}', '--set', 'vocab.draft_vocab_size=32'])\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "Traceback" not in p.stderr + p.stdout, p.stderr
    lines = p.stderr.strip().splitlines()
    log = run.path / "vocab" / "stage.log"
    assert len(lines) == 1 and lines[0] == (f"draftsmith: error: vocab: ZeroDivisionError: a synthetic bug (a bug in "
                                            f"draftsmith, please report it; the traceback is in {log})"), p.stderr
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "in boom" in text and "FAILED: ZeroDivisionError" in text
    status = subprocess.run([sys.executable, "-m", "draftsmith", "status", str(run.path), "--json"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    row = {s["name"]: s for s in json.loads(status.stdout)["stages"]}["vocab"]
    assert row["state"] == "failed" and "a synthetic bug" in row["error"]
    # outside a stage (status itself): the traceback goes to a file of its own
    code = ("import draftsmith.cli as c\n"
            "def boom(*a, **k): raise ValueError('a bug in status')\n"
            "c.run_status = boom\n"
            f"c.main(['status', {str(run.path)!r}, '--json'])\n")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    path = p.stderr.strip().rsplit("the traceback is in ", 1)[1].rstrip(")")
    assert "ValueError: a bug in status" in open(path).read()


def test_answers_all_past_the_row_length_say_so_and_metrics_stay_json(tiny8, tmp_path, capsys):
    # prompts of 70-80 tokens, rows of 64: no answer token is ever inside a row
    samples = cycle_samples(target_info(str(tiny8)).vocab_size, 8, lengths=(90, 100), prompt=(70, 80))
    run = make_run(tmp_path / "run", tiny8, samples)
    m = run_train(run, cfg_for(tiny8, max_steps=3, loss_on="assistant"))
    rows = metrics(run)  # json.loads of every line: a bare NaN would not parse
    assert rows and all(r["loss"][0] is None and r["acceptance_length"] is None for r in rows)
    assert m["counts"]["acceptance_length"] is None
    assert "had no trained token" in capsys.readouterr().out


def test_a_moved_run_names_itself(tiny_run, tmp_path):
    """`mv` of a finished run: its stages stay up to date, and what draftsmith prints or `status` names is in the
    new place (manifests and journals record paths relative to the run)."""
    import shutil

    from conftest import TINY_RUN_SETS, run_cli

    run, config, *_ = tiny_run
    first = tmp_path / "first"
    shutil.copytree(run.path, first, ignore=shutil.ignore_patterns(".locks"))
    sets = [x for kv in TINY_RUN_SETS for x in ("--set", kv)]
    bad = run_cli("export", "--run", str(first), "--config", str(config), *sets, "--set", "export.checkpoint=nowhere")
    assert bad.returncode == 2
    moved = tmp_path / "moved"
    first.rename(moved)
    p = run_cli("train", "--run", str(moved), "--config", str(config), *sets, env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and "up to date" in p.stdout and f"-> {moved / 'train' / 'final'}" in p.stdout, p.stdout
    assert str(first) not in p.stdout + p.stderr
    p = run_cli("status", str(moved), "--json")
    row = {s["name"]: s for s in json.loads(p.stdout)["stages"]}["export"]
    assert row["state"] == "failed" and row["log"] == str(moved / "export" / "stage.log")
    text = run_cli("status", str(moved)).stdout
    assert str(first) not in text and str(moved / "export" / "stage.log") in text
    # the export is still up to date: its recorded checkpoint is the run's own, wherever the run is
    p = run_cli("export", "--run", str(moved), "--config", str(config), *sets)
    assert p.returncode == 0 and "up to date" in p.stdout + p.stderr, p.stdout + p.stderr
    for manifest in moved.glob("*/manifest.json"):
        assert str(run.path) not in manifest.read_text(), manifest


def test_artifacts_are_checked_by_what_they_are(tiny_run, tmp_path):
    """Up to date means the files check, not only the manifest: an export edited after the fact is refused by eval
    in one line naming it (and redone by export), an emptied weights file in train/final is trained... written again;
    a drafter folder from elsewhere with an impossible size is refused before anything is allocated."""
    import shutil

    from conftest import TINY_RUN_SETS, run_cli

    run, config, *_ = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run.path, copy, ignore=shutil.ignore_patterns(".locks"))
    sets = [x for kv in TINY_RUN_SETS for x in ("--set", kv)]
    cfg_path = copy / "export" / "config.json"
    cj = json.loads(cfg_path.read_text())
    cj["transformer_layer_config"]["num_hidden_layers"] = 1000000000
    cfg_path.write_text(json.dumps(cj))
    p = run_cli("eval", "--run", str(copy), "--config", str(config), *sets)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"{cfg_path}:" in p.stderr and "rerun `draftsmith export" in p.stderr
    # the same folder evaluated as a drafter from elsewhere: its sizes are refused, nothing is allocated
    foreign = tmp_path / "foreign"
    shutil.copytree(copy / "export", foreign)
    p = run_cli("eval", "--run", str(tmp_path / "other"), "--config", str(config), *sets, "--drafter", str(foreign))
    assert p.returncode == 2 and "'num_hidden_layers' is 1000000000, more than any drafter has" in p.stderr, p.stderr
    # export redoes what was edited
    p = run_cli("export", "--run", str(copy), "--config", str(config), *sets)
    assert p.returncode == 0 and "done again" in p.stdout, p.stdout + p.stderr
    assert json.loads(cfg_path.read_text())["transformer_layer_config"]["num_hidden_layers"] == 1
    # an emptied final weights file: train writes final/ again from its last checkpoint instead of "up to date"
    weights = copy / "train" / "final" / "model.safetensors"
    weights.write_bytes(b"")
    p = run_cli("train", "--run", str(copy), "--config", str(config), *sets, env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and "done again" in p.stdout and weights.stat().st_size > 0, p.stdout + p.stderr


def test_a_file_is_checked_before_it_is_trusted(tiny_run, tmp_path):
    """Hostile or damaged files are refused in one line before any work, by the check of their class: a checkpoint
    train recorded is held to the train manifest's hashes; any other checkpoint's sizes are bounded before anything
    is allocated from them (1e9 layers hung export, memory growing); a FIFO where a file belongs is refused, not
    read (it hung eval's hashing); a manifest that is JSON but no object is a damaged manifest, named."""
    import shutil

    from conftest import TINY_RUN_SETS, run_cli

    run, config, *_ = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run.path, copy, ignore=shutil.ignore_patterns(".locks"))
    sets = [x for kv in TINY_RUN_SETS for x in ("--set", kv)]
    meta = copy / "train" / "final" / "drafter.json"
    edited = json.loads(meta.read_text())
    edited["config"]["num_hidden_layers"] = 1000000000
    meta.write_text(json.dumps(edited))
    p = run_cli("export", "--run", str(copy), "--config", str(config), *sets, timeout=120)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert f"{meta}:" in p.stderr and "changed since train finished" in p.stderr
    # the same folder named by export.checkpoint, which no manifest recorded: bounded before it is sized
    ck = tmp_path / "checkpoint"
    shutil.copytree(copy / "train" / "final", ck)
    p = run_cli("export", "--run", str(copy), "--config", str(config), *sets, "--set", f"export.checkpoint={ck}",
                timeout=120)
    assert p.returncode == 2 and "'num_hidden_layers' is 1000000000, more than any drafter has" in p.stderr, p.stderr
    # a FIFO as a drafter folder's weights
    foreign = tmp_path / "foreign"
    shutil.copytree(run.path / "export", foreign)
    (foreign / "model.safetensors").unlink()
    os.mkfifo(foreign / "model.safetensors")
    p = run_cli("eval", "--run", str(tmp_path / "other"), "--config", str(config), *sets, "--drafter", str(foreign),
                timeout=120)
    assert p.returncode == 2 and f"{foreign / 'model.safetensors'}: a FIFO, not a regular file" in p.stderr, p.stderr
    # a manifest that is valid JSON but no manifest
    (copy / "generate" / "manifest.json").write_text("[1]")
    p = run_cli("run", str(config), "--run", str(copy), *sets, timeout=120)
    assert p.returncode == 2 and "generate/manifest.json: not a valid manifest (a JSON list" in p.stderr, p.stderr
    assert "a bug in draftsmith" not in p.stdout + p.stderr


def test_export_into_a_linked_folder_keeps_the_link_and_stale_parked_folders_go(tiny_run, tmp_path):
    import shutil

    from conftest import TINY_RUN_SETS, run_cli

    run, config, *_ = tiny_run
    copy = tmp_path / "run"
    shutil.copytree(run.path, copy, ignore=shutil.ignore_patterns(".locks", "export"))
    other = tmp_path / "other-disk" / "drafter"
    other.mkdir(parents=True)
    (other / "old.txt").write_text("what was there")
    (copy / "export").symlink_to(other)
    sets = [x for kv in TINY_RUN_SETS for x in ("--set", kv)]
    p = run_cli("export", "--run", str(copy), "--config", str(config), *sets)
    assert p.returncode == 0, p.stderr
    assert (copy / "export").is_symlink() and (copy / "export").resolve() == other.resolve()
    assert (other / "model.safetensors").is_file() and (other / "manifest.json").is_file()
    assert not list(copy.glob(".export*")) and not list(other.parent.glob(".drafter*"))
    # a parked folder a crash left between the two renames is removed by the next export
    (copy / "export").unlink()
    shutil.copytree(other, copy / "export")
    (copy / ".export.old-12345").mkdir()
    (copy / "export" / "manifest.json").unlink()  # not done: exported again
    p = run_cli("export", "--run", str(copy), "--config", str(config), *sets)
    assert p.returncode == 0 and not list(copy.glob(".export*")), p.stderr
