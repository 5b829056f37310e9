"""Progress reporting that every long stage uses: a journal on disk, heartbeats, and log lines.

A stage wraps its work in `Progress(...)`:

    with Progress(run, "extract", total=n, unit="samples", done=already_done) as prog:
        with prog.busy("loading target"):    # heartbeats keep flowing while this blocks
            model = load(...)
        for batch in batches:
            ...
            prog.advance(len(batch))

The journal `RUN/<stage>/progress.jsonl` (one per rank: `progress.rank{r}.jsonl` when
distributed) gets one JSON line per event: a `start` line (pid, host, start time, total, unit,
stall threshold, log path), then `p` lines with the count done, written at most once a second
by the stage and every few seconds by a background heartbeat thread, then `end` or `error`.
`draftsmith status` reads only the first line and the tail, so it stays instant on long runs, and
it tolerates a last line cut by a crash.

Log lines reach the console at once (the CLI makes stdout line-buffered) and are appended to
`RUN/<stage>/stage.log`. On a terminal a progress bar is drawn; otherwise one plain line per
interval (default 10 s, and at least every 10 % of the work) with done/total, rate and ETA. A burst
of completions (a batch finishing) is one line, written once the burst is over. The log is never
silent longer than the interval while the stage lives: inside a named phase (`busy`), and before
the first unit, a line says what it is doing and for how long (`loading target ... 3m00s, 0/400
samples done`). `busy(phase, work=True)` marks a phase whose time is the units' own (decoding a
batch): the rate is measured from its start, not from when its units land.

Errors raised outside the `with Progress` block (a bad upstream file found before the work
starts, a manifest that cannot be written after it) are journaled too: each `run_<stage>`
function carries `@journal_failures(STAGE)`, so `status` shows such a stage `failed` with the
error rather than `pending` or `done`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

from draftsmith import DraftsmithError, Terminated, one_line, scrub
from draftsmith.bounds import env_number
from draftsmith.journal import (RATE_MAX_WINDOW_S, append_event, attempt_id, env_rank, fmt_duration, fmt_rate,
                               journal_name, journal_state, rate_and_eta, read_journal)
from draftsmith.rundir import DiskFull, RunDir, append_bytes, is_disk_full


SETTLE_S = 0.25  # a burst of completions is over once no unit has completed for this long
TICK_S = 0.25  # how often the heartbeat thread looks at the log lines due

_current_log: list[Path] = []  # stage.log of the innermost active Progress
_log_lock = threading.Lock()  # the heartbeat thread prints too: one whole line at a time


def console_line(line: str) -> None:
    """Print a line, flushed. A terminal or pipe that went away (a launcher killed, `| head` done) must not kill the
    process mid-work (a rank about to write the checkpoint it announced): stdout then goes to /dev/null, and the
    stage log, written beside it, keeps every line."""
    try:
        print(line, flush=True)
    except (BrokenPipeError, ValueError, OSError):
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def log(msg: str, *, stage: str | None = None, console: bool = True) -> None:
    """One log line, flushed at once, mirrored into the active stage's stage.log. On the console rank 0's only; in
    the file every rank's, another rank's tagged with its number (ranks share the file: an untagged line said twice
    reads as one event twice, and a rank's own trouble would look like rank 0's)."""
    rank, _ = env_rank()
    head = f"{time.strftime('%H:%M:%S')} " + (f"[{stage}] " if stage else "")
    line = head + scrub(msg)
    with _log_lock:
        if console and rank == 0:
            console_line(line)
        if _current_log:
            with contextlib.suppress(OSError), open(_current_log[-1], "a", encoding="utf-8") as f:
                f.write((line if rank == 0 else f"{head}rank {rank}: {scrub(msg)}") + "\n")


class Progress:
    """Journal + heartbeat + console progress for one stage (on one rank)."""

    def __init__(
        self,
        run: RunDir,
        stage: str,
        *,
        total: int | None,
        unit: str,
        done: int = 0,
        stall_after_s: float = 300.0,
        interval_s: float | None = None,
        heartbeat_s: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        console: bool = True,
        shared: bool = False,
        attempt: str | None = None,
    ):
        env_r, env_w = env_rank()
        self.run, self.stage, self.unit = run, stage, unit
        self.total = total
        self.done = self.start_done = done
        self.stall_after_s = stall_after_s
        # Seconds between plain progress lines; DRAFTSMITH_LOG_INTERVAL_S overrides the default.
        # (at least 0.05 s: 0 would spin the heartbeat thread and print a line on every pass)
        self.interval_s = max(0.05, interval_s if interval_s is not None
                              else env_number("DRAFTSMITH_LOG_INTERVAL_S", 10.0, 0.05, 86400.0))
        # Heartbeat often enough that a healthy stage is never near its stall threshold.
        self.heartbeat_s = heartbeat_s or max(0.2, min(5.0, stall_after_s / 10))
        self.rank = env_r if rank is None else rank
        self.world_size = env_w if world_size is None else world_size
        self.console = console and self.rank == 0
        # shared: every rank counts the same work (train's global optimizer steps), so status shows
        # one count for the stage; otherwise ranks split the work and their counts add up
        self.shared = shared
        # which launch this journal belongs to, so status does not read an earlier launch's ranks as this one's
        self.attempt = attempt or attempt_id()
        d = run.stage_dir(stage)
        self.journal_path = d / journal_name(self.rank, self.world_size)
        self.log_path = d / "stage.log"
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._line_lock = threading.Lock()
        self._ended = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._phase: str | None = None
        self._phase_t0 = 0.0
        self._work = False  # inside a busy(work=True) phase: its journal points are the units' own time
        self._last_progress_t = time.time()
        self._last_journal_t = 0.0
        self._t0 = time.time()
        self._last_line_t = 0.0  # the last progress (status) line
        self._last_any_line_t = self._t0  # the newest line of this stage's log, whatever it said
        self._last_line_done = done
        self._pending_since = self._t0
        # (t, done, in a work phase) of journal lines
        self._points: collections.deque[tuple[float, float, bool]] = collections.deque()
        self._bar = None
        self._bar_task = None
        self.closed = False

    # -- journal ---------------------------------------------------------------------------------
    def _write(self, ev: dict[str, Any]) -> None:
        # One os.write per line on an O_APPEND descriptor: lines from the stage and from the
        # heartbeat thread never interleave, and a crash can only cut the very last line.
        # A full disk raises DiskFull naming the journal (no torn line is left behind).
        data = (json.dumps(ev, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                append_bytes(self._fd, data, self.journal_path)
                if ev.get("done") is not None:
                    # the points `status` reads back from this journal, for the log's rate
                    self._points.append((ev["t"], ev["done"], bool(ev.get("w"))))
                    while self._points and self._points[0][0] < ev["t"] - 2 * RATE_MAX_WINDOW_S:
                        self._points.popleft()

    def _event(self, kind: str, **extra: Any) -> dict[str, Any]:
        ev = {"ev": kind, "t": round(time.time(), 3), "done": self.done, "pt": round(self._last_progress_t, 3)}
        if self.total is not None:
            ev["total"] = self.total
        if self._phase:
            ev["phase"] = self._phase
        if self._work:
            ev["w"] = 1
        ev.update(extra)
        return ev

    def __enter__(self) -> "Progress":
        # A fresh journal per attempt: the previous attempt's is kept as progress.prev.jsonl.
        if self.journal_path.exists():
            os.replace(self.journal_path, self.journal_path.with_suffix(".prev.jsonl"))
        self._fd = os.open(self.journal_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._write({
            "ev": "start", "t": round(self._t0, 3), "pid": os.getpid(), "host": socket.gethostname(),
            "stage": self.stage, "rank": self.rank, "world_size": self.world_size,
            "total": self.total, "unit": self.unit, "done": self.done,
            "stall_after_s": self.stall_after_s, "heartbeat_s": self.heartbeat_s,
            # the log by its name in the stage's folder: a moved run still names its own (status resolves it)
            "log": self.log_path.name, "argv": sys.argv[1:3], **({"shared": True} if self.shared else {}),
            **({"attempt": self.attempt} if self.attempt else {}),
        })
        _current_log.append(self.log_path)
        self._thread = threading.Thread(target=self._heartbeat, name=f"{self.stage}-heartbeat", daemon=True)
        self._thread.start()
        if self.console and sys.stdout.isatty():
            self._start_bar()
        return self

    def _heartbeat(self) -> None:
        next_beat = time.time() + self.heartbeat_s
        while not self._stop.wait(min(TICK_S, self.heartbeat_s, self.interval_s / 2)):
            now = time.time()
            if now >= next_beat:
                next_beat = now + self.heartbeat_s
                with contextlib.suppress(OSError, DiskFull):  # the stage reports a full disk itself
                    self._write(self._event("p"))
            if not self._stop.is_set():
                # a log line that cannot be written (a closed pipe) must not end the journal's heartbeats
                with contextlib.suppress(Exception):
                    self._lines_due(now)

    def _lines_due(self, now: float) -> None:
        """The log lines the clock asks for: a burst's line once it settled, a progress line per interval once
        units complete, and a line saying what the stage does whenever its log fell silent for an interval
        (a named phase, the wait for the first unit). Called from the heartbeat thread."""
        if not self.console or self._bar is not None:
            return
        pending = self.done - self._last_line_done
        settled = now - self._last_progress_t >= SETTLE_S
        since = now - (self._last_line_t or self._t0)
        if pending >= max(1, (self.total or 0) // 10) and (settled or now - self._pending_since >= 1.0):
            self._print_line(now)  # a burst once settled; a steady stream's tenth within a second
        elif since >= self.interval_s and (pending > 0 or (self._phase is None and self.done > self.start_done)) \
                and (settled or since >= self.interval_s + 1.0):  # a burst lasting over a second gets a line too
            self._print_line(now)
        elif now - self._last_any_line_t >= self.interval_s:
            self._print_alive(now)

    def _print_alive(self, now: float) -> None:
        if self._phase is None:
            self._print_line(now)  # no unit yet: the progress line, 0 done and the time elapsed
            return
        of = f"/{self.total}" if self.total is not None else ""
        log(f"{self._phase} ... {fmt_duration(now - self._phase_t0)}, {self.done}{of} {self.unit} done",
            stage=self.stage)
        self._last_any_line_t = now

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            self.end()
        else:
            self.fail(error_line(exc), interrupted=isinstance(exc, KeyboardInterrupt))

    def _close(self, ev: dict[str, Any]) -> None:
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        # Best effort when failing: on a full disk the error line may not fit, and the error
        # being reported must not be replaced by that one.
        with contextlib.suppress(OSError, DiskFull) if ev.get("ev") == "error" else contextlib.nullcontext():
            self._write(ev)
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if _current_log and _current_log[-1] == self.log_path:
            _current_log.pop()

    # -- the API stages use ------------------------------------------------------------------------
    def set_total(self, total: int | None) -> None:
        self.total = total
        if self._bar is not None and total is not None:
            self._bar.update(self._bar_task, total=total)

    def advance(self, n: int = 1) -> None:
        now = time.time()
        if self.done == self._last_line_done:
            self._pending_since = now  # the first unit no line has shown yet
        self.done += n
        self._last_progress_t = now
        if now - self._last_journal_t >= 1.0 or (self.total is not None and self.done >= self.total):
            self._last_journal_t = now
            self._write(self._event("p"))
        self._maybe_print(now)

    @contextlib.contextmanager
    def busy(self, phase: str, work: bool = False) -> Iterator[None]:
        """Mark a long single step; heartbeats carry its name and status counts it as alive, and the log
        says every interval how long it has taken so far. `work`: the step computes the units that
        complete after it (a batch decoded at once), so the rate counts its time as theirs."""
        prev = (self._phase, self._phase_t0, self._work)
        self._phase_t0, self._work = time.time(), work
        self._phase = phase  # last: the heartbeat thread reads the phase, then its start
        self.log(f"{phase} ...")
        self._write(self._event("p"))
        try:
            yield
        finally:
            self._phase, self._phase_t0, self._work = prev
            self._last_progress_t = time.time()
            self._write(self._event("p", **({"w": 1} if work else {})))

    def log(self, msg: str) -> None:
        self._last_any_line_t = time.time()
        if self._bar is not None:
            self._bar.console.print(f"{time.strftime('%H:%M:%S')} [{self.stage}] {scrub(msg)}")
            log(msg, stage=self.stage, console=False)
        else:
            log(msg, stage=self.stage, console=self.console)

    def fail(self, msg: str, interrupted: bool = False) -> None:
        """Close the journal with an error line; `interrupted` marks a stop asked for by the user
        or the system (Ctrl-C, SIGTERM), which `status` shows as `interrupted`, not `failed`."""
        first_line = _first_line(msg)
        log(f"{'INTERRUPTED' if interrupted else 'FAILED'}: {first_line}", stage=self.stage, console=False)
        self._close(self._event("error", error=first_line, **({"interrupted": True} if interrupted else {})))

    def end(self, **summary: Any) -> None:
        if self.closed:
            return
        self._ended = True
        self._print_line(time.time(), final=True)
        self._close(self._event("end", **summary))

    # -- console -----------------------------------------------------------------------------------
    def _rate(self) -> tuple[float | None, bool, float | None]:
        """(rate, warming up, ETA) by journal.rate_and_eta, as `status` reads them from the journal."""
        now = time.time()
        with self._lock:
            points = list(self._points) + [(now, self.done, self._work)]
        return rate_and_eta(points, self.start_done, self.total, now)

    def status_line(self) -> str:
        r, warming, eta = self._rate()
        speed = f"{fmt_rate(r)} {self.unit}/s" + (" (warming up)" if warming and r else "")
        elapsed = f"elapsed {fmt_duration(time.time() - self._t0)}"
        if self.total:
            pct = 100.0 * self.done / self.total
            return f"{self.done}/{self.total} {self.unit} ({pct:.1f}%) | {speed} | ETA {fmt_duration(eta)} | {elapsed}"
        return f"{self.done} {self.unit} | {speed} | {elapsed}"

    def _maybe_print(self, now: float) -> None:
        if self._bar is not None:
            self._bar.update(self._bar_task, completed=self.done)
            return
        # the lines themselves come from the heartbeat thread (_lines_due), which waits for a burst to be over:
        # a batch of 64 answers landing in one second is one line, not seven

    def _print_line(self, now: float, final: bool = False) -> None:
        if not self.console or self._bar is not None:
            return
        with self._line_lock:  # the heartbeat thread and the stage's own end() both print
            if final and self.done == self._last_line_done and self._last_line_t:
                return
            if self._ended and not final:
                return  # the final line is (being) written: no heartbeat line after it
            self._last_line_t, self._last_line_done = now, self.done
            self._last_any_line_t = now
            log(self.status_line(), stage=self.stage)

    def _start_bar(self) -> None:
        # rich only when a bar is drawn (a terminal): journals and plain log lines do without it
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._bar = Bar(
            TextColumn(f"[bold]{self.stage}[/bold]"), BarColumn(), MofNCompleteColumn(),
            TextColumn(self.unit), TimeElapsedColumn(), TimeRemainingColumn(),
            transient=False,
        )
        self._bar.start()
        self._bar_task = self._bar.add_task(self.stage, total=self.total, completed=self.done)


# -------------------------------------------------------------------------------------------------
# Failures outside a Progress block


def _first_line(msg: str) -> str:
    return scrub(msg.strip().splitlines()[0]) if msg.strip() else "error"


def error_line(exc: BaseException) -> str:
    """The one line a journal records for an exception (a user error's own message)."""
    if isinstance(exc, Terminated):
        return "interrupted (SIGTERM)"
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted (Ctrl-C)"
    if isinstance(exc, DraftsmithError):
        return one_line(exc) or "error"  # the line the CLI prints
    return _first_line(f"{type(exc).__name__}: {exc}")


def record_failure(run: RunDir, stage: str, exc: BaseException, *, since: float,
                   rank: int | None = None, world_size: int | None = None) -> None:
    """Journal an error that escaped `run_<stage>` outside its Progress block.

    - The journal was opened by this very call (its start line has this pid and a time after
      `since`): the error came after Progress closed it (e.g. writing the manifest), so an
      `error` line is appended unless Progress already wrote one.
    - Another live process is writing the journal (a second `generate` refused by the stage
      lock): it is left alone.
    - Otherwise the stage failed before it started: a fresh journal (the previous one kept as
      progress.prev.jsonl, as Progress does) holds a start line and the error; `done` is null
      because the attempt did no counted work.
    A run folder that does not exist is not created (a mistyped --run has no stage to mark)."""
    if not run.is_run():
        return
    if rank is None or world_size is None or not 0 <= rank < world_size:
        rank, world_size = env_rank()
    path = run.path / stage / journal_name(rank, world_size)
    msg = error_line(exc)
    interrupted = {"interrupted": True} if isinstance(exc, KeyboardInterrupt) else {}
    now = time.time()
    start, events = read_journal(path)
    # (journals store times rounded to the millisecond; rounding keeps the order)
    if start is not None and start.get("pid") == os.getpid() and float(start.get("t", 0)) >= round(since, 3):
        last = events[-1] if events else start
        if last.get("ev") != "error":
            append_event(path, {"ev": "error", "t": round(now, 3), "done": last.get("done"),
                                "pt": last.get("pt", round(now, 3)), "error": msg, **interrupted})
            _log_line(path.parent / "stage.log", stage, f"{'INTERRUPTED' if interrupted else 'FAILED'}: {msg}")
        return
    if start is not None:
        row = journal_state(path, now, socket.gethostname())
        if row is not None and row["state"] in ("running", "stalled"):
            return
    run.stage_dir(stage)
    if path.exists():
        os.replace(path, path.with_suffix(".prev.jsonl"))
    log_path = path.parent / "stage.log"
    t = round(now, 3)
    append_event(path, {"ev": "start", "t": round(since, 3), "pid": os.getpid(), "host": socket.gethostname(),
                        "stage": stage, "rank": rank, "world_size": world_size, "total": None, "unit": None,
                        "done": None, "log": log_path.name, "argv": sys.argv[1:3]})
    append_event(path, {"ev": "error", "t": t, "done": None, "pt": t, "error": msg, **interrupted})
    _log_line(log_path, stage, f"{'INTERRUPTED' if interrupted else 'FAILED'} before the stage started: {msg}")


def _log_line(path: Path, stage: str, msg: str) -> None:
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as f:
        f.write(f"{time.strftime('%H:%M:%S')} [{stage}] {msg}\n")


def is_known_failure(exc: BaseException) -> bool:
    """An error that says itself in one line (a user error, a stop, a full disk, a path the system refuses):
    anything else is a bug in draftsmith, whose traceback goes to a log (write_traceback)."""
    return isinstance(exc, (DraftsmithError, KeyboardInterrupt, Terminated)) or is_disk_full(exc) or (
        isinstance(exc, OSError) and getattr(exc, "filename", None) is not None)


def write_traceback(exc: BaseException, log_path: Path | None, stage: str | None = None) -> Path:
    """The full traceback of `exc`, appended to `log_path` (a stage's stage.log; a file of its own in the
    temporary folder when None or unwritable), remembered on the exception (`traceback_log`) so that the one line
    the CLI prints names where it went. Returns the file."""
    if getattr(exc, "traceback_log", None):
        return exc.traceback_log
    text = scrub("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    head = f"{time.strftime('%H:%M:%S')} [{stage or 'draftsmith'}] the traceback of {type(exc).__name__}:\n"
    for path in ([log_path] if log_path is not None else []) + [
            Path(tempfile.gettempdir()) / f"draftsmith-error-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"]:
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(head + text)
        except OSError:
            continue
        with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attributes
            exc.traceback_log, exc.traceback_stage = path, stage
        return path
    return Path("(nowhere: no log could be written)")


def journal_failures(stage: str):
    """Decorator for `run_<stage>(run, cfg, ...)`: an exception it raises is recorded in the
    stage's journal (see record_failure) and re-raised unchanged; one that is not a known failure
    (is_known_failure: a bug) has its traceback written to the stage's stage.log first."""

    def wrap(fn):
        @functools.wraps(fn)
        def inner(run, *args, **kwargs):
            since = time.time()
            try:
                return fn(run, *args, **kwargs)
            except (Exception, KeyboardInterrupt) as e:
                with contextlib.suppress(Exception):  # journaling must never hide the error itself
                    rd = run if isinstance(run, RunDir) else RunDir(run)
                    # a stage run into another folder (eval's `folder=`) journals there
                    folder = kwargs.get("folder", stage)
                    if not is_known_failure(e) and rd.is_run():
                        write_traceback(e, rd.path / folder / "stage.log", folder)
                    record_failure(rd, folder, e, since=since, rank=kwargs.get("rank"),
                                   world_size=kwargs.get("world_size"))
                raise

        return inner

    return wrap
