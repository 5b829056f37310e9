"""The log's ETA and `status`'s agree on a running stage (issue 28: within 20 % on a running
generate, measured by bench/bench_eta.py). Two things made them drift apart on a real generate
through vLLM: a rate over a minute that held only a few samples jumped by a large share whenever
one left the window, and the log printed nothing while no sample completed, so its newest ETA grew
stale while `status` kept computing."""

import socket
import time

import pytest

from draftsmith.journal import RATE_MIN_UNITS, RATE_WINDOW_S, journal_state, recent_rate
from draftsmith.progress import Progress
from draftsmith.rundir import RunDir


def bursty_points(until: float, burst: int = 4, every: float = 40.0, heartbeat: float = 2.0) -> list[tuple[float, float]]:
    """A stage that completes `burst` units at once every `every` seconds (the answers of concurrent
    requests), with heartbeats in between: 0.1 units/s by default."""
    pts, t = [], 0.0
    while t <= until:
        pts.append((t, float(burst * int(t // every))))
        t += heartbeat
    return pts


def test_few_units_a_minute_stretch_the_window_so_the_rate_does_not_jump():
    # 4 units every 40 s: the last minute alone holds one burst or two, so its rate halved or doubled
    # between two completions, while the log's newest line still showed the other value
    pts = bursty_points(600)
    rates = {t: (recent_rate([p for p in pts if p[0] <= t], 0.0)[0], pts[int(t // 2)][1]) for t in range(300, 601, 2)}
    assert all(r == pytest.approx(0.1, rel=0.3) for r, _ in rates.values()), rates
    for t in range(300, 591, 2):  # a log line printed at t, `status` read 10 s later, no unit completed between
        (a, done_a), (b, done_b) = rates[t], rates[t + 10]
        if done_a == done_b:
            assert abs(b / a - 1) < 0.1, (t, a, b)


def test_fast_stages_keep_the_one_minute_window():
    pts = [(t / 10, t * 5.0) for t in range(0, 3001)]  # 50 units/s for 300 s, then 500 units/s for 10 s
    pts += [(300 + t / 10, 15000 + t * 50.0) for t in range(1, 101)]
    r, warming = recent_rate(pts, 0.0)
    assert not warming and r == pytest.approx((20000 - 12500) / RATE_WINDOW_S, rel=0.02)  # the last minute only
    assert RATE_MIN_UNITS < 50 * RATE_WINDOW_S


def test_the_window_never_reaches_into_the_start_up():
    # 100 s loading (heartbeats with nothing done), then a unit every 10 s
    pts = [(float(t), 0.0) for t in range(0, 101, 2)] + [(100 + t, float(t // 10)) for t in range(1, 61)]
    r, warming = recent_rate(pts, 0.0)
    assert warming and r == pytest.approx(6 / 60, rel=0.2)


def all_lines(run: RunDir, stage: str) -> list[str]:
    log = run.path / stage / "stage.log"
    return log.read_text().splitlines() if log.exists() else []


def log_lines(run: RunDir, stage: str) -> list[str]:
    log = run.path / stage / "stage.log"
    return [ln for ln in log.read_text().splitlines() if "ETA" in ln] if log.exists() else []


def test_the_log_is_never_silent_for_an_interval(tmp_path, capsys):
    """Inside a named phase, before the first unit and between units, the newest log line is never older
    than the interval: a phase says its name, its time so far and what is done (issue 41: the seed's log
    said nothing for half an hour while the target loaded)."""
    run = RunDir(tmp_path).ensure()
    with Progress(run, "generate", total=10, unit="samples", interval_s=0.3, heartbeat_s=0.1) as prog:
        with prog.busy("loading target"):
            time.sleep(1.6)  # a phase of over five intervals (three lines even with late ticks on a loaded machine)
        phase = [ln for ln in all_lines(run, "generate") if "loading target ... " in ln and "done" in ln]
        assert len(phase) >= 3 and phase[0].endswith("0/10 samples done"), phase
        time.sleep(1.0)  # no phase, no unit yet: the progress line with 0 done
        assert sum("0/10 samples" in ln for ln in log_lines(run, "generate")) >= 2
        prog.advance()
        n = len(log_lines(run, "generate"))
        time.sleep(1.5)  # one unit done, the next slow: the log keeps its rate and ETA current
        assert len(log_lines(run, "generate")) >= n + 3
        with prog.busy("a long single step"):
            time.sleep(1.0)
        assert sum("a long single step ... " in ln and "1/10 samples done" in ln for ln in all_lines(run, "generate")) >= 2
        prog.advance(9)
    lines = log_lines(run, "generate")
    assert lines[-1].split("] ")[1].startswith("10/10 samples")
    assert all(ln.count(" | ") == 3 for ln in lines)  # whole lines, never two interleaved
    assert capsys.readouterr().out.count("ETA") == len(lines)


def test_a_stage_whose_single_phase_outlasts_three_intervals_logs_a_line_for_each(tmp_path):
    """A stage process (tests/sim_stage.py, the real progress API) whose `loading target` takes five
    intervals of 0.2 s: its stage.log holds a line for each, not one line at the start and one at the end."""
    import subprocess
    import sys
    from pathlib import Path

    sim = Path(__file__).with_name("sim_stage.py")
    subprocess.run([sys.executable, str(sim), str(tmp_path), "extract", "3", "0.01", "busy", "300", "1.0"],
                   check=True, capture_output=True, timeout=60)
    phase = [ln for ln in all_lines(RunDir(tmp_path), "extract") if ln.split("] ", 1)[1].startswith("loading target ... ")]
    assert len(phase) >= 3 and all(ln.endswith("0/3 samples done") for ln in phase), phase


def test_a_burst_of_completions_is_one_line_with_the_batchs_own_rate(tmp_path):
    """A batch decoded at once (busy work=True) whose 64 answers land in the same instant: one log line, not
    one per tenth, and its rate is 64 over the batch's time (the seed's demo printed `1/103 ... ? samples/s`,
    `11/103 ...`, ... seven lines in one second)."""
    run = RunDir(tmp_path).ensure()
    with Progress(run, "generate", total=103, unit="samples", interval_s=60, heartbeat_s=0.1) as prog:
        with prog.busy("decoding batch 1/2 (64 conversations)", work=True):
            time.sleep(2.5)
        for _ in range(64):
            prog.advance()
        time.sleep(0.8)
        lines = log_lines(run, "generate")
        assert len(lines) == 1 and lines[0].split("] ")[1].startswith("64/103 samples"), lines
        rate = float(lines[0].split(" | ")[1].split()[0])
        # 64 over the batch's time (plus the tick that printed it), not `?` nor 64 over the last second
        assert rate == pytest.approx(64 / 2.5, rel=0.3), lines
        row = journal_state(prog.journal_path, time.time(), socket.gethostname())
        assert row["rate_per_s"] == pytest.approx(rate, rel=0.3)  # status says the same


def test_a_fast_stage_writes_a_line_per_burst_not_per_unit(tmp_path):
    """prepare and vocab finish 224 samples within a second: the file gets one line, not one per unit
    or per tenth."""
    run = RunDir(tmp_path).ensure()
    with Progress(run, "vocab", total=224, unit="samples", interval_s=60, heartbeat_s=5) as prog:
        for _ in range(224):
            prog.advance()
    lines = log_lines(run, "vocab")
    assert 1 <= len(lines) <= 2
    assert lines[-1].split("] ")[1].startswith("224/224 samples")


def test_the_log_line_and_status_give_the_same_eta(tmp_path):
    """Both come from journal.recent_rate over the same journal points: read at the same moment they
    agree to within the drift of the seconds between the last journal line and now."""
    run = RunDir(tmp_path).ensure()
    with Progress(run, "generate", total=400, unit="samples", interval_s=60, heartbeat_s=0.2) as prog:
        for i in range(30):
            time.sleep(0.05 if i % 4 else 0.3)  # in bursts, like answers of concurrent requests
            prog.advance()
        time.sleep(0.3)  # a heartbeat line after the last unit
        line = prog.status_line()
        row = journal_state(prog.journal_path, time.time(), socket.gethostname())
    log_rate = float(line.split(" | ")[1].split()[0])
    assert row["rate_per_s"] == pytest.approx(log_rate, rel=0.1), (row, line)


def test_the_eta_counts_down_between_bursts_and_holds_still_across_them():
    """Units landing 40 at a time every 16 s (2.5 units/s, the demo's extract): read every 2 s, the ETA
    falls by the seconds that passed, never climbs between bursts, and each burst's new estimate starts
    where the count-down was; a burst later than the pace said takes the rate up to now."""
    from draftsmith.journal import rate_and_eta

    total, points, etas = 480, [(0.0, 0.0, False)], []
    for k in range(1, 11):  # bursts at 16, 32, ..., 160 s; heartbeats every 2 s between them
        for t in range(16 * (k - 1) + 2, 16 * k, 2):
            points.append((float(t), 40.0 * (k - 1), False))
            etas.append((t, rate_and_eta(points, 0.0, total, float(t))))
        points.append((16.0 * k, 40.0 * k, False))
        etas.append((16 * k, rate_and_eta(points, 0.0, total, 16.0 * k)))
    steady = [(t, e) for t, (r, w, e) in etas if t >= 80]  # once the rate's window has left the start
    for (t0, e0), (t1, e1) in zip(steady, steady[1:]):
        assert e1 == pytest.approx(e0 - (t1 - t0), abs=0.5), (t0, e0, t1, e1)  # a count-down, bursts included
    assert len(steady) > 30 and steady[-1][1] == pytest.approx((total - 400) / 2.5, abs=0.5)
    # overdue: no unit for 100 s after the last burst; the count-down is spent, the rate sinks, the ETA grows
    late = points + [(260.0, 400.0, False)]
    r, _, e = rate_and_eta(late, 0.0, total, 260.0)
    assert r < 2.5 and e > (total - 400) / 2.5
