"""Observability with real processes: done, failed, stalled (SIGSTOP), dead (SIGKILL), on_disk vs
journal, logs that arrive in a redirected file while the stage runs, and an instant status."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.progress import Progress
from draftsmith.rundir import RunDir
from draftsmith.journal import read_journal
from draftsmith.status import render_table, run_status

SIM = str(Path(__file__).with_name("sim_stage.py"))


def start(run, stage, total, per_item, mode="ok", stall=300.0, log=None, busy_s=None):
    out = open(log, "w") if log else subprocess.DEVNULL
    extra = [] if busy_s is None else [str(busy_s)]
    return subprocess.Popen([sys.executable, SIM, str(run), stage, str(total), str(per_item), mode, str(stall), *extra],
                            stdout=out, stderr=subprocess.STDOUT)


def stage_row(run, name):
    return next(s for s in run_status(run)["stages"] if s["name"] == name)


def wait_for(pred, timeout=30.0, every=0.05):
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            v = pred()
        except Exception:  # the stage may not have created its files yet
            v = None
        if v:
            return v
        time.sleep(every)
    raise AssertionError("condition not reached in time")


def test_done(tmp_path):
    p = start(tmp_path, "extract", 20, 0.01)
    assert p.wait(60) == 0
    row = stage_row(tmp_path, "extract")
    assert row["state"] == "done" and row["done"] == 20 and row["total"] == 20 and row["unit"] == "samples"
    assert row["on_disk"] == 20 and row["bytes_on_disk"] == 2000
    assert row["error"] is None


def test_failed_records_its_message(tmp_path):
    p = start(tmp_path, "extract", 10, 0.01, mode="raise")
    assert p.wait(60) != 0
    row = stage_row(tmp_path, "extract")
    assert row["state"] == "failed"
    assert row["error"] == "sample 5: simulated failure"
    assert row["done"] == 5
    assert row["log"].endswith("extract/stage.log")
    assert "FAILED: sample 5: simulated failure" in Path(row["log"]).read_text()
    assert "sample 5: simulated failure" in render_table(run_status(tmp_path))


def test_running_then_stalled_under_sigstop_then_dead_under_sigkill(tmp_path):
    p = start(tmp_path, "extract", 10_000, 0.02, stall=1.5)
    try:
        row = wait_for(lambda: (r := stage_row(tmp_path, "extract"))["done"] and r["done"] > 20 and r)
        assert row["state"] == "running" and row["pid"] == p.pid
        time.sleep(2.5)  # let the rate window fill
        row = stage_row(tmp_path, "extract")
        assert row["rate_per_s"] and 5 < row["rate_per_s"] < 60  # ~45/s at 20 ms an item, minus overheads
        assert row["eta_s"] and row["eta_s"] > 100
        assert row["heartbeat_age_s"] < 1.5
        os.kill(p.pid, signal.SIGSTOP)
        row = wait_for(lambda: (r := stage_row(tmp_path, "extract"))["state"] == "stalled" and r, timeout=10)
        assert row["heartbeat_age_s"] >= 1.5
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        row = stage_row(tmp_path, "extract")
        assert row["state"] == "dead"
    finally:
        if p.poll() is None:
            p.kill()


def test_busy_step_with_heartbeats_is_running_not_stalled(tmp_path):
    p = start(tmp_path, "train", 3, 3.0, mode="busy", stall=1.0)
    try:
        time.sleep(2.0)  # inside the 3 s "loading target" step: no progress, but heartbeats
        row = stage_row(tmp_path, "train")
        assert row["state"] == "running", row
        assert row["phase"] == "loading target"
        assert row["heartbeat_age_s"] < 1.0
    finally:
        p.kill()
        p.wait()


def test_on_disk_is_counted_from_files_and_disagreement_is_shown(tmp_path):
    assert start(tmp_path, "extract", 12, 0.0).wait(60) == 0
    shard = tmp_path / "extract" / "rows_0-12"
    (shard / "3.safetensors").unlink()
    (shard / ".7.safetensors.abc.tmp").write_bytes(b"partial")  # a temp file is never counted
    row = stage_row(tmp_path, "extract")
    assert row["done"] == 12 and row["on_disk"] == 11
    assert "the journal says 12 samples done, the files on disk hold 11" in render_table(run_status(tmp_path))


def test_logs_reach_a_redirected_file_while_running(tmp_path):
    """`nohup draftsmith ... > log 2>&1 &`: progress lines are in the file before the stage ends."""
    log = tmp_path / "nohup.out"
    p = start(tmp_path / "run", "extract", 400, 0.01, log=log)
    try:
        text = wait_for(lambda: (t := log.read_text()).count("[extract]") >= 2 and t, timeout=30)
        assert p.poll() is None, "the stage should still be running"
        line = [l for l in text.splitlines() if "[extract]" in l][-1]
        assert "/400 samples" in line and "samples/s" in line and "ETA" in line
    finally:
        p.wait(60)
    assert "finished" in log.read_text()


def test_journal_cut_mid_line_is_tolerated(tmp_path):
    run = RunDir(tmp_path).ensure()
    with Progress(run, "generate", total=10, unit="samples", console=False) as prog:
        prog.advance(4)
        prog._write(prog._event("p"))
        j = prog.journal_path
        prog._close(prog._event("p"))  # close without an end event, like a crash
    with open(j, "ab") as f:
        f.write(b'{"ev":"p","t":12')  # the crash cut this line
    start_ev, events = read_journal(j)
    assert start_ev["pid"] == os.getpid() and events[-1]["done"] == 4
    row = stage_row(tmp_path, "generate")
    assert row["done"] == 4 and row["state"] in ("running", "stalled")  # its pid (us) is alive


def test_other_host_is_judged_by_heartbeats_alone(tmp_path):
    run = RunDir(tmp_path).ensure()
    d = run.stage_dir("extract")
    now = time.time()
    host = socket.gethostname() + "-elsewhere"

    def journal(age):
        lines = [{"ev": "start", "t": now - 100, "pid": 1, "host": host, "total": 100, "unit": "samples",
                  "done": 0, "stall_after_s": 10},
                 {"ev": "p", "t": now - age, "done": 50, "pt": now - age, "total": 100}]
        (d / "progress.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    journal(1)  # pid 1 is alive here, but it is not that host's pid: heartbeats decide
    assert stage_row(tmp_path, "extract")["state"] == "running"
    journal(15)
    assert stage_row(tmp_path, "extract")["state"] == "stalled"
    journal(100)
    assert stage_row(tmp_path, "extract")["state"] == "dead"


def test_status_cli_json_and_exit_codes(tmp_path, cli):
    assert start(tmp_path, "generate", 3, 0.0).wait(60) == 0
    p = cli("status", str(tmp_path), "--json")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["run"] == str(tmp_path)
    assert [s["name"] for s in st["stages"]] == ["generate", "prepare", "vocab", "extract", "train", "export", "eval"]
    keys = {"name", "state", "done", "total", "unit", "rate_per_s", "eta_s", "heartbeat_age_s", "pid", "on_disk", "bytes_on_disk", "error"}
    assert keys <= set(st["stages"][0])
    assert st["stages"][0]["state"] == "done" and st["stages"][1]["state"] == "pending"
    table = cli("status", str(tmp_path))
    assert table.returncode == 0 and "generate  done" in table.stdout
    bad = cli("status", str(tmp_path / "nope"), "--json")
    assert bad.returncode != 0 and "not a draftsmith run directory" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_watch_snapshots_when_piped_and_stops_when_done(tmp_path, cli):
    assert start(tmp_path, "generate", 3, 0.0).wait(60) == 0
    p = cli("watch", str(tmp_path), "--interval", "0.1", timeout=30)
    assert p.returncode == 0
    assert p.stdout.startswith("--- ") and "generate  done" in p.stdout


def test_errors_outside_progress_are_journaled(tmp_path):
    """`@journal_failures`: an error before the stage's Progress opened, or after it closed, shows
    as `failed` with its message; a journal another live process is writing is left alone; a
    run folder that does not exist is not created."""
    from draftsmith import DraftsmithError
    from draftsmith.progress import journal_failures

    run = RunDir(tmp_path / "run").ensure()

    @journal_failures("vocab")
    def before_start(r):
        raise DraftsmithError("vocab.draft_vocab_size: 99999 is larger than the vocabulary")

    @journal_failures("vocab")
    def after_end(r):
        with Progress(r, "vocab", total=3, unit="samples", console=False) as prog:
            prog.advance(3)
        raise OSError(28, "No space left on device")  # e.g. the manifest write, after the journal closed

    with pytest.raises(OSError):
        after_end(run)
    row = stage_row(run.path, "vocab")
    assert row["state"] == "failed" and row["error"] == "OSError: [Errno 28] No space left on device"
    assert row["done"] == 3  # the work done before the error still counts

    with pytest.raises(DraftsmithError):
        before_start(run)
    row = stage_row(run.path, "vocab")
    assert row["state"] == "failed" and row["error"] == "vocab.draft_vocab_size: 99999 is larger than the vocabulary"
    assert row["done"] is None and row["pid"] == os.getpid()  # no counted work in this attempt
    assert (run.path / "vocab" / "progress.prev.jsonl").is_file()  # the earlier attempt's journal is kept
    assert "FAILED before the stage started: vocab.draft_vocab_size" in (run.path / "vocab" / "stage.log").read_text()
    assert "vocab: vocab.draft_vocab_size: 99999" in render_table(run_status(run.path))

    @journal_failures("extract")
    def refused(r):
        raise DraftsmithError("another process is running this stage")

    # A second process refused while the stage runs (e.g. by generate's lock) must not mark it failed.
    p = start(run.path, "extract", 200, 0.05)
    try:
        wait_for(lambda: stage_row(run.path, "extract")["done"])
        with pytest.raises(DraftsmithError):
            refused(run)
        assert stage_row(run.path, "extract")["state"] == "running"
    finally:
        p.kill()
        p.wait()

    missing = tmp_path / "typo"
    with pytest.raises(DraftsmithError):
        before_start(missing)
    assert not missing.exists()


@pytest.mark.parametrize("shared", [False, True])
def test_ranks_add_up_unless_they_count_the_same_steps(tmp_path, shared):
    """Extract's ranks split the samples (their counts add up); train's ranks all count the global
    optimizer steps, so the stage is as far as its slowest rank, not twice as far."""
    run = RunDir(tmp_path)
    stage = "train" if shared else "extract"
    unit = "steps" if shared else "samples"
    progs = [Progress(run, stage, total=10 if shared else 5, unit=unit, rank=r, world_size=2, console=False, shared=shared)
             for r in (0, 1)]
    for p in progs:
        p.__enter__()
    try:
        progs[0].advance(4)
        progs[1].advance(3)
        row = stage_row(tmp_path, stage)
        assert row["state"] == "running" and len(row["ranks"]) == 2
        assert (row["done"], row["total"]) == ((3, 10) if shared else (7, 10))
        assert [r["done"] for r in row["ranks"]] == [4, 3]
        assert f"{row['done']}/10 {unit}" in render_table(run_status(tmp_path))
    finally:
        for p in progs:
            p.__exit__(None, None, None)


def test_train_journals_from_before_the_shared_flag_count_once(tmp_path):
    """A multi-rank train journal written before `shared` existed still shows one count."""
    d = tmp_path / "train"
    d.mkdir()
    now = time.time()
    for r, done in ((0, 6), (1, 5)):
        (d / f"progress.rank{r}.jsonl").write_text(
            json.dumps({"ev": "start", "t": now, "pid": os.getpid(), "host": socket.gethostname(), "stage": "train", "rank": r,
                        "world_size": 2, "total": 9, "unit": "steps", "done": 0, "stall_after_s": 300.0}) + "\n"
            + json.dumps({"ev": "p", "t": now, "done": done, "pt": now, "total": 9}) + "\n")
    row = stage_row(tmp_path, "train")
    assert (row["done"], row["total"]) == (5, 9)


def test_journals_of_an_earlier_attempt_with_other_ranks_are_left_out(tmp_path):
    """A two-rank train run, then a one-process rerun: the rank journals of the first are not the
    second's ranks (status once showed the old run's 104 steps as the live run's progress)."""
    run = RunDir(tmp_path)
    old = [Progress(run, "train", total=104, unit="steps", rank=r, world_size=2, console=False, shared=True) for r in (0, 1)]
    for p in old:
        p.__enter__()
        p.advance(104)
        p.__exit__(None, None, None)
    time.sleep(0.01)
    with Progress(run, "train", total=500, unit="steps", console=False, shared=True) as live:
        live.advance(321)
        row = stage_row(tmp_path, "train")
        assert (row["state"], row["done"], row["total"]) == ("running", 321, 500) and "ranks" not in row


def test_a_restarted_rank_that_has_not_started_yet_is_not_read_from_the_crashed_attempt(tmp_path):
    """Two ranks crash; on restart rank 0 journals first: status shows the new attempt's rank 0, not the
    old attempt's dead rank 1 (journals name their launch: torchrun's run id, or the pid)."""
    run = RunDir(tmp_path)
    old = Progress(run, "train", total=50, unit="steps", rank=1, world_size=2, console=False, shared=True, attempt="launch-1")
    old.__enter__()
    old.advance(7)
    old.__exit__(RuntimeError, RuntimeError("rank 1 crashed"), None)
    time.sleep(0.01)
    with Progress(run, "train", total=50, unit="steps", rank=0, world_size=2, console=False, shared=True,
                  attempt="launch-2") as live:
        live.advance(3)
        row = stage_row(tmp_path, "train")
        assert (row["state"], row["done"], row["error"]) == ("running", 3, None)
    start = json.loads((tmp_path / "train" / "progress.rank0.jsonl").read_text().splitlines()[0])
    assert start["attempt"] == "launch-2"


def test_attempt_ids_come_from_torchrun_or_the_process(monkeypatch):
    from draftsmith.journal import attempt_id

    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "RANK"):
        monkeypatch.delenv(k, raising=False)
    assert attempt_id() == f"{socket.gethostname()}:{os.getpid()}"
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert attempt_id() is None  # torchrun without --standalone: not unique, status falls back to the layout
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "aba3bf35")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert attempt_id() == "aba3bf35.2"


def test_log_and_status_use_the_same_rate_after_a_long_start_up(tmp_path):
    """A stage that spends 6 s loading before its first unit: the log's rate and ETA must not count
    the start-up (it printed "ETA 12h" against status's 2h41m), and both say so while warming up."""
    p = start(tmp_path, "generate", 400, 0.02, mode="busy", busy_s=6.0)
    try:
        row = wait_for(lambda: (r := stage_row(tmp_path, "generate"))["done"] and r["done"] >= 150 and r, timeout=60)
        log_lines = [ln for ln in (tmp_path / "generate" / "stage.log").read_text().splitlines() if "/s" in ln and "ETA" in ln]
    finally:
        p.kill()
        p.wait()
    last = log_lines[-1]
    # "... | 45.2 samples/s (warming up) | ETA 8s | elapsed 10s"
    log_rate = float(last.split(" | ")[1].split()[0].replace(",", ""))
    assert "(warming up)" in last and row["warming_up"]
    assert row["rate_per_s"] == pytest.approx(log_rate, rel=0.2), (row, last)
    # the work itself goes at ~50/s on an idle machine; a rate over the whole attempt, start-up
    # included, would be about half of the work's own (compared with that, not with 50/s: on busy
    # cores the work itself goes slower)
    done = int(last.split("] ")[1].split("/")[0])
    elapsed = row["elapsed_s"]
    assert log_rate > 1.3 * done / elapsed, (last, elapsed)


def test_finished_stage_shows_how_long_it_took_and_how_fast(tmp_path):
    p = start(tmp_path, "extract", 40, 0.02)
    assert p.wait(60) == 0
    row = stage_row(tmp_path, "extract")
    assert row["state"] == "done" and row["elapsed_s"] > 0.5
    assert row["rate_per_s"] == pytest.approx(40 / row["elapsed_s"], rel=0.05)
    table = render_table(run_status(tmp_path))
    header = next(line for line in table.splitlines() if line.startswith("stage"))
    assert "elapsed" in header


BAD_LINES = [b'{"ev":"p","t":"x"}', b'{"ev":"p","t":null}', b'{"ev":"p","t":1e308,"done":"x"}',
             b'{"ev":"start","t":1,"stall_after_s":"x"}', b'{"ev":"p","t":1,"pid":"me"}', b'[1, 2]', b'"text"',
             b"\xff\xfe garbage", b'{"ev": 3, "t": 1}', b'{"ev":"p","t":NaN}']


@pytest.mark.parametrize("bad", BAD_LINES + [b'{"ev":"p","t":1,"x":"' + b"y" * (1 << 20) + b'"}'],
                         ids=[f"line{i}" for i in range(len(BAD_LINES))] + ["1MB-line"])
def test_status_survives_any_journal_line(tmp_path, cli, bad):
    """A line of any content appended to a finished and to a failed stage's journal (by hand, or by
    something that is not draftsmith) is skipped and counted: the state, counts and error come from
    the good lines, and status, status --json and watch answer."""
    assert start(tmp_path, "generate", 3, 0.0).wait(60) == 0
    assert start(tmp_path, "extract", 10, 0.01, mode="raise").wait(60) != 0
    for stage in ("generate", "extract"):
        with open(tmp_path / stage / "progress.jsonl", "ab") as f:
            f.write(bad + b"\n")
    gen, ext = stage_row(tmp_path, "generate"), stage_row(tmp_path, "extract")
    assert (gen["state"], gen["done"], gen["total"]) == ("done", 3, 3)
    assert ext["state"] == "failed" and ext["error"] == "sample 5: simulated failure"
    assert gen["bad_journal_lines"] == ext["bad_journal_lines"] == 1
    for args in (("status", str(tmp_path)), ("status", str(tmp_path), "--json"),
                 ("watch", str(tmp_path), "--interval", "0.1")):
        p = cli(*args, timeout=30)
        assert p.returncode == 0 and "Traceback" not in p.stderr, (args, p.stderr[-500:])
    assert "not valid events and were skipped" in cli("status", str(tmp_path)).stdout


def test_watch_notify_runs_a_command_once_per_change_of_a_stage(tmp_path):
    """`watch --notify CMD` runs CMD once each time a stage changes state (running, dead, running again, done), with
    the run, stage, state, progress and ETA in its environment; it watches on through a stage that died."""
    run = tmp_path / "run"
    RunDir(run).ensure()
    notes = tmp_path / "notes.txt"
    cmd = (f'echo "$DRAFTSMITH_STAGE $DRAFTSMITH_PREVIOUS_STATE>$DRAFTSMITH_STATE $DRAFTSMITH_DONE/$DRAFTSMITH_TOTAL '
           f'eta=$DRAFTSMITH_ETA_S | $DRAFTSMITH_MESSAGE" >> {notes}')
    w = subprocess.Popen([sys.executable, "-m", "draftsmith", "watch", str(run), "--interval", "0.1", "--notify", cmd],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def noted(what: str) -> bool:
        return notes.exists() and what in notes.read_text()
    try:
        time.sleep(1.0)  # watching began with every stage pending: nothing to say yet
        assert not notes.exists()
        p = start(run, "extract", 400, 0.05)
        assert wait_for(lambda: noted("extract pending>running"))
        assert wait_for(lambda: stage_row(run, "extract")["done"] and stage_row(run, "extract")["done"] >= 3)
        p.kill()
        p.wait()
        assert wait_for(lambda: noted("extract running>dead"))
        p = start(run, "extract", 6, 0.01)
        assert wait_for(lambda: noted("extract dead>running") or noted("extract dead>done"))
        p.wait()
        assert wait_for(lambda: noted(">done"))
        time.sleep(0.5)
        assert w.poll() is None  # six stages still pending: it watches on
    finally:
        w.terminate()
        w.wait(timeout=30)
    lines = notes.read_text().splitlines()
    assert [x.split(" ")[1] for x in lines][:2] == ["pending>running", "running>dead"]
    assert lines[-1].startswith("extract ") and ">done 6/6 " in lines[-1] and "draftsmith run: extract" in lines[-1]
    assert len(lines) == len(set(lines))  # once per change
    assert "eta=" in lines[0] and "/400 " in lines[0]


def test_status_gives_each_tau_with_its_standard_error(tmp_path):
    """The validation pass's and each eval folder's acceptance length, each with its standard error, in `status`'s
    table notes and its JSON (draftsmith/acceptance.py)."""
    from draftsmith.status import eval_figures, render_table

    d = tmp_path / "eval-vllm"
    d.mkdir()
    (d / "report.json").write_text(json.dumps({"engine": "vllm", "prompts": 16, "num_speculative_tokens": 3,
                                               "acceptance_length": 1.367, "acceptance_length_se": 0.041,
                                               "speedup": 0.91}))
    figures = eval_figures(d)
    assert figures["acceptance_length_se"] == 0.041 and figures["engine"] == "vllm"
    assert eval_figures(tmp_path / "missing") is None
    row = {"name": "eval-vllm", "state": "done", "done": 16, "total": 16, "unit": "prompts", "rate_per_s": None,
           "eta_s": None, "heartbeat_age_s": None, "pid": None, "on_disk": 0, "bytes_on_disk": 0, "error": None,
           "report": figures}
    val = {"name": "train", "state": "done", "done": 10, "total": 10, "unit": "steps", "rate_per_s": None,
           "eta_s": None, "heartbeat_age_s": None, "pid": None, "on_disk": 0, "bytes_on_disk": 0, "error": None,
           "validation": {"step": 10, "acceptance_length": 1.404, "acceptance_length_se": 0.052,
                          "acceptance_per_position": [0.3, 0.08, 0.02], "samples": 12}}
    text = render_table({"run": str(tmp_path), "stages": [val, row]})
    assert "train: validation tau 1.40 ± 0.05 at step 10" in text
    assert "eval-vllm: vllm engine tau 1.37 ± 0.04 at K = 3 over 16 prompts, 0.91x plain decoding" in text


def _documented_notify_command() -> str:
    """The Slack --notify command of docs/monitoring.md, as the shell receives it (the single-quoted argument)."""
    text = (Path(__file__).parents[1] / "docs" / "monitoring.md").read_text()
    line = next(x for x in text.splitlines() if "$DRAFTSMITH_MESSAGE_JSON" in x and x.strip().startswith("'curl"))
    return line.strip().split("'")[1]


def test_the_documented_slack_alert_is_valid_json_for_any_message_and_a_400_is_a_failure(monkeypatch):
    """An error's `"`, `\\`, `$(...)` and backticks in DRAFTSMITH_MESSAGE reach the webhook as the text of valid JSON
    (the old example sent invalid JSON); a webhook's 400 makes the command fail, and the warning quotes it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from draftsmith.status import notify_env, run_notify

    got, code = [], [200]

    class Hook(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            got.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(code[0])
            self.end_headers()
            self.wfile.write(b"invalid_payload" if code[0] != 200 else b"ok")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("SLACK_WEBHOOK", f"http://127.0.0.1:{srv.server_address[1]}/hook")
    row = {"name": "extract", "state": "failed", "done": 3, "total": 10, "unit": "samples", "eta_s": None,
           "error": 'sample "a\\b": $(touch x) `id` failed'}
    try:
        env = notify_env("runs/kimi", row, "running")
        assert run_notify(_documented_notify_command(), env) is None
        assert json.loads(got[-1]) == {"text": env["DRAFTSMITH_MESSAGE"]} and '"a\\b"' in env["DRAFTSMITH_MESSAGE"]
        code[0] = 400
        why = run_notify(_documented_notify_command(), env)
        assert why is not None and why.startswith("exit 22") and "400" in why, why
    finally:
        srv.shutdown()


def test_a_notify_command_that_hangs_is_killed_with_what_it_started_and_never_holds_the_table(tmp_path, monkeypatch):
    from draftsmith.status import Notifier, run_notify

    monkeypatch.setenv("DRAFTSMITH_NOTIFY_TIMEOUT_S", "1.5")
    pids = tmp_path / "pids"
    hang = f"sleep 300 & echo $! >> {pids}; wait"
    t0 = time.monotonic()
    why = run_notify(hang, {})
    assert time.monotonic() - t0 < 10 and why is not None and "every process it started were killed" in why
    child = int(pids.read_text().split()[0])
    time.sleep(0.2)
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    # watch's side: sending returns at once; the command runs beside the table's refresh
    n = Notifier(hang)
    t0 = time.monotonic()
    n.send({}, "extract failed")
    assert time.monotonic() - t0 < 0.5
    n.drain()
    assert 1.4 < time.monotonic() - t0 < 10 and len(pids.read_text().split()) == 2
