"""train.report_to: the figures of metrics.jsonl reach TensorBoard, W&B, MLflow and trackio, each in its offline or
local mode (no network), read back here from each one's own files; a restarted run goes on in the same tracker run;
a tracker that cannot start or fails mid-run is one warning line and training loses no step."""

import base64
import glob
import json
import secrets
import sqlite3
import struct
import sys

import pytest

from test_train import cfg_for, copy_run, metrics, synth_run  # noqa: F401
from draftsmith.train.stage import run_train

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """Every tracker writing under tmp_path, none reaching a network."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    (tmp_path / "wandb-dir").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    return tmp_path


def wandb_history(wandb_dir) -> dict[int, dict]:
    """{step: {key: value}} of every offline W&B run under wandb_dir, from its .wandb files (a leveldb-style log of
    protobuf records: 7-byte header, 32 KiB blocks, records of checksum, length, type)."""
    from wandb.proto import wandb_internal_pb2

    out: dict[int, dict] = {}
    for path in sorted(glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")):
        data, pos, buf = open(path, "rb").read(), 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:
                pos += 32768 - pos % 32768
                continue
            _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
            chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
            if kind in (1, 4):
                rec = wandb_internal_pb2.Record()
                rec.ParseFromString(buf + chunk)
                buf = b""
                if rec.WhichOneof("record_type") == "history":
                    row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                    step = rec.history.step.num if rec.history.HasField("step") else row.get("_step")
                    out.setdefault(int(step), {}).update(row)
            elif kind in (2, 3):
                buf += chunk
            else:
                break
    return out


def mlflow_history(uri: str, key: str) -> dict[int, float]:
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("draftsmith")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, runs  # a resumed run logs into the same MLflow run
    return {m.step: m.value for m in client.get_metric_history(runs[0].info.run_id, key)}


def trackio_history(trackio_dir, key: str) -> dict[int, float]:
    con = sqlite3.connect(glob.glob(f"{trackio_dir}/draftsmith.db")[0])
    rows = con.execute("select run_name, step, metrics from metrics").fetchall()
    assert len({r[0] for r in rows}) == 1
    return {s: json.loads(m)[key] for _, s, m in rows if key in json.loads(m)}


def tensorboard_history(folder, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars(key)}


def test_every_tracker_gets_the_figures_of_metrics_jsonl_and_a_restart_continues_it(synth_run, tiny8, offline,
                                                                                      monkeypatch):
    run = copy_run(synth_run, offline / "run")
    # secrets in the config and on the command line (W&B records it): in no tracker's files, in any encoding
    password, key = "pw-" + secrets.token_hex(10), "vk-" + secrets.token_hex(10)
    url = f"http://alice:{password}@gpu-node:8000/v1"
    monkeypatch.setattr(sys, "argv", [sys.argv[0], "train", "--set", f"generate.servers=[{url}]"])
    sets = {"max_steps": 12, "checkpoint_every": 6, "validation": 6, "validate_every": 6, "log_every_s": 0.001,
            "report_to": "[tensorboard, wandb, mlflow, trackio]", "generate.servers": f"[{url}]",
            "generate.vllm_args": f"[--api-key, {key}]"}
    run_train(run, cfg_for(tiny8, **sets))
    # lengthened: continues from step 12 in the same tracker runs
    run_train(run, cfg_for(tiny8, **{**sets, "max_steps": 18}))
    rows = metrics(run)
    train = {r["step"]: r for r in rows if r.get("split") is None}
    val = {r["step"]: r for r in rows if r.get("split") == "validation"}
    assert max(train) == 18 and set(val) == {6, 12, 18}
    state = json.loads((run.path / "train" / "trackers.json").read_text())
    assert set(state) == {"tensorboard", "wandb", "mlflow", "trackio"}

    wb = wandb_history(offline / "wandb-dir")
    tb = tensorboard_history(run.path / "train" / "tb", "loss/step0")
    ml = mlflow_history(f"file:{offline / 'mlruns'}", "loss/step0")
    tr = trackio_history(offline / "trackio", "loss/step0")
    for step, r in train.items():
        for got in (wb[step]["loss/step0"], tb[step], ml[step], tr[step]):
            assert got == pytest.approx(r["loss"][0], rel=1e-6), step
        assert wb[step]["acceptance_length"] == pytest.approx(r["acceptance_length"])
    for step, r in val.items():
        assert wb[step]["validation/acceptance_length"] == pytest.approx(r["acceptance_length"])
        assert mlflow_history(f"file:{offline / 'mlruns'}", "validation/acceptance_length")[step] == pytest.approx(
            r["acceptance_length"])
    # one W&B run id across the restart, the resolved config logged with it
    assert len({p.split("-")[-1] for p in glob.glob(f"{offline}/wandb-dir/wandb/offline-run-*")}) == 1
    def read(f):  # a tracker's transient files (sqlite's -wal) may go while they are read
        try:
            return f.read_bytes()
        except FileNotFoundError:
            return b""

    files = [f for f in offline.rglob("*") if f.is_file()]
    assert any(b"***@gpu-node" in read(f) for f in files if "wandb" in str(f))  # the URL was logged
    for f in files:
        data = read(f).lower()
        for s in (password, key):
            for form in (s, s.encode().hex(), s[::-1], base64.b64encode(s.encode()).decode()[2:-2].lower()):
                assert form.encode() not in data, f"{s} leaked into {f}"


def test_a_failing_tracker_is_one_warning_and_no_step_is_lost(synth_run, tiny8, offline, monkeypatch, capsys):
    import sys

    import mlflow

    run = copy_run(synth_run, offline / "run")
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed

    def down(*a, **k):
        raise ConnectionError("the tracking server went away")
    monkeypatch.setattr(mlflow, "log_metrics", down)  # fails mid-run
    m = run_train(run, cfg_for(tiny8, max_steps=8, log_every_s=0.001, report_to="[wandb, mlflow]"))
    assert m["counts"]["done"] == 8 and max(r["step"] for r in metrics(run)) == 8
    out = capsys.readouterr().out
    warned = [x for x in out.splitlines() if "warning: train.report_to" in x]
    assert len(warned) == 2, warned
    assert "wandb: cannot start (ModuleNotFoundError" in warned[0] and "mlflow: a call failed (ConnectionError" in warned[1]


def test_a_tracker_that_does_not_answer_or_cannot_write_is_dropped_within_its_bound(synth_run, tiny8, offline,
                                                                                  monkeypatch, capsys):
    """An MLflow server that accepts and never answers (mlflow's retries held training 4 minutes, with no line) and a
    trackio folder that cannot be written (it said "reporting" and lost every figure): each said in one line within
    DRAFTSMITH_TRACKER_WAIT_S, dropped, and training keeps every step in metrics.jsonl."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # accepts connections, answers none
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{silent.getsockname()[1]}")
    blocker = offline / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("TRACKIO_DIR", str(blocker / "trackio"))  # under a file: no folder can be made there
    monkeypatch.setenv("DRAFTSMITH_TRACKER_WAIT_S", "6")
    run = copy_run(synth_run, offline / "run")
    t0 = time.monotonic()
    m = run_train(run, cfg_for(tiny8, max_steps=8, log_every_s=0.001, report_to="[mlflow, trackio]"))
    took = time.monotonic() - t0
    silent.close()
    assert m["counts"]["done"] == 8 and max(r["step"] for r in metrics(run)) == 8
    lines = [x for x in capsys.readouterr().out.splitlines() if "train.report_to" in x]
    assert any("mlflow: waiting for it (at most 6 s" in x for x in lines), lines
    assert any("mlflow: cannot start (TimeoutError: no answer in 6 s)" in x for x in lines), lines
    assert any("trackio: cannot start" in x and "a-file" in x for x in lines), lines
    assert not any("reporting to" in x for x in lines) and took < 60, (took, lines)


def test_a_call_that_ends_after_its_bound_leaves_the_streams_it_finds(monkeypatch):
    """A tracker call given up on (Worker.call's bound) that ends later, once the streams were handed back and
    replaced (pytest closes each test's capture; CI once found sys.stdout closed a test later, when an unanswered
    mlflow start ended its retries), leaves the streams as it finds them instead of putting back the old ones."""
    import io
    import threading

    from draftsmith.train.trackers import Worker, _quiet

    monkeypatch.setenv("DRAFTSMITH_TRACKER_WAIT_S", "0.2")
    release = threading.Event()
    ended = threading.Event()

    def slow():
        with _quiet():
            release.wait(10)
        ended.set()
    before = io.StringIO()
    monkeypatch.setattr(sys, "stdout", before)
    with pytest.raises(TimeoutError):
        Worker("slow", say=lambda line: None).call(slow)
    assert sys.stdout is before  # handed back at the bound
    later = io.StringIO()
    monkeypatch.setattr(sys, "stdout", later)  # the next test's capture
    before.close()
    release.set()
    assert ended.wait(10)
    assert sys.stdout is later and not sys.stdout.closed
