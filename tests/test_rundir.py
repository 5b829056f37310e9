import json
import os

import pytest

from draftsmith import DraftsmithError
from draftsmith.rundir import RunDir, atomic_path, atomic_write_json, fingerprint, stage_fingerprint


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "x.json"
    atomic_write_json(target, {"a": 1})
    atomic_write_json(target, {"a": 2})
    assert json.loads(target.read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_atomic_write_survives_sigkill_of_writer(tmp_path):
    # A writer killed between writing and renaming leaves only a dot-temp file, never `final`.
    import subprocess
    import sys

    code = (
        "import os, signal, sys\n"
        "from draftsmith.rundir import atomic_path\n"
        "with atomic_path(sys.argv[1]) as tmp:\n"
        "    tmp.write_bytes(b'x' * 1000)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    p = subprocess.run([sys.executable, "-c", code, str(tmp_path / "final")])
    assert p.returncode == -9
    assert not (tmp_path / "final").exists()
    assert all(n.startswith(".") and n.endswith(".tmp") for n in os.listdir(tmp_path))


def test_manifest_round_trip_and_missing_upstream(tmp_path):
    run = RunDir(tmp_path / "r").ensure()
    assert run.is_run()
    with pytest.raises(DraftsmithError, match="stage 'generate' has not completed.*draftsmith generate"):
        run.require_manifest("generate", by="prepare")
    (run.stage_dir("generate") / "samples.jsonl").write_text("{}\n")
    m = run.write_manifest("generate", fingerprint="abc", inputs={"prompts": "x"}, settings={"limit": 1},
                           counts={"done": 1, "total": 1, "unit": "samples"}, started=0.0)
    assert m["outputs"] == ["samples.jsonl"]
    assert run.require_manifest("generate", by="prepare")["fingerprint"] == "abc"
    run.invalidate("generate")
    assert run.read_manifest("generate") is None


def test_corrupt_manifest_is_a_clear_error(tmp_path):
    run = RunDir(tmp_path).ensure()
    run.stage_dir("vocab")
    run.manifest_path("vocab").write_text("{not json")
    with pytest.raises(DraftsmithError, match=r"vocab/manifest\.json: not a valid manifest"):
        run.read_manifest("vocab")


def test_fingerprints_are_canonical():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    up = {"generate": {"fingerprint": "f1"}}
    assert stage_fingerprint({"x": 1}, up) != stage_fingerprint({"x": 1}, {"generate": {"fingerprint": "f2"}})


def test_run_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(DraftsmithError, match="not a folder"):
        RunDir(f).ensure()


def test_replace_dir_swaps_whole_folders(tmp_path):
    from draftsmith.rundir import replace_dir

    dest = tmp_path / "final"
    for version in ("old", "new"):
        built = tmp_path / f".final.tmp-{version}"
        built.mkdir()
        (built / "model.safetensors").write_text(version)
        if version == "old":
            (built / "stale.json").write_text("only in the old folder")
        replace_dir(built, dest)
    assert sorted(p.name for p in dest.iterdir()) == ["model.safetensors"]  # nothing of the old mixed in
    assert (dest / "model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_fingerprinted_drops_ignored_keys_and_later_knobs_at_their_defaults():
    from draftsmith.rundir import fingerprinted

    section = {"lr": 1e-3, "log_every_s": 10, "offset": 0, "freeze": False}
    later = {"offset": 0, "freeze": False}
    assert fingerprinted(section, ("log_every_s",), later) == {"lr": 1e-3}
    # a later knob away from its default counts, so the fingerprint changes with it
    assert fingerprinted({**section, "offset": 5}, ("log_every_s",), later) == {"lr": 1e-3, "offset": 5}
    assert fingerprinted(section) == section
