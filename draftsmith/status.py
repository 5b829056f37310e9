"""`draftsmith status` and `draftsmith watch`: the state of every stage of a run, checked on disk.

Reads only each journal's first line and tail, and counts output files with `os.scandir`, so it
answers in well under a second for a run with 10,000 sample files. Never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from draftsmith import DraftsmithError, stages
from draftsmith.acceptance import fmt as fmt_tau
from draftsmith.bounds import env_number
from draftsmith.estimate import read_run_estimate
from draftsmith.journal import fmt_duration, fmt_rate, journal_state, pid_alive
from draftsmith.rundir import MANIFEST, RunDir, is_temp_name


# -------------------------------------------------------------------------------------------------
# Journals


# -------------------------------------------------------------------------------------------------
# Files on disk, counted per stage from the files themselves


def _lines(path: Path) -> tuple[int, int]:
    """(complete lines, bytes) of a JSONL file; a last line without its newline is not counted."""
    try:
        with open(path, "rb") as f:
            n = 0
            size = 0
            while block := f.read(1 << 20):
                n += block.count(b"\n")
                size += len(block)
        return n, size
    except OSError:
        return 0, 0


def _files(d: Path, suffix: str = "") -> tuple[int, int]:
    n = size = 0
    try:
        with os.scandir(d) as it:
            for e in it:
                if e.is_file() and not is_temp_name(e.name) and e.name.endswith(suffix):
                    n += 1
                    size += e.stat().st_size
    except OSError:
        pass
    return n, size


def generate_cut(d: Path) -> int:
    """Answers of generate cut for time and counted as lost (generate/stage.py): the ids whose latest line in
    failures.jsonl says `"cut": true` (the last line of an id is its state; a torn last line is skipped)."""
    latest: dict[str, bool] = {}
    try:
        with open(d / "failures.jsonl", "rb") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    latest[str(rec["id"])] = rec.get("cut") is True
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue
    except OSError:
        return 0
    return sum(latest.values())


def _shard_files(d: Path, suffix: str) -> tuple[int, int]:
    """Files ending in `suffix` in the `rows_*` shard folders of `d` (the extract store)."""
    n = size = 0
    try:
        with os.scandir(d) as it:
            shards = [e.path for e in it if e.is_dir() and e.name.startswith("rows_")]
    except OSError:
        return 0, 0
    for s in shards:
        a, b = _files(Path(s), suffix)
        n += a
        size += b
    return n, size


def extract_bytes_per_token(d: Path, size: int) -> float | None:
    """Bytes on disk per token of the extract store's finished files (`size` bytes): their tokens
    from meta.json's `lengths`; None before meta.json or a file exists."""
    try:
        lengths = json.loads((d / "meta.json").read_text())["lengths"]
        tokens = 0
        for shard in d.glob("rows_*"):
            with os.scandir(shard) as it:
                for e in it:
                    if e.name.endswith(".safetensors") and not is_temp_name(e.name):
                        tokens += int(lengths[int(e.name.split(".")[0])])
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    return size / tokens if tokens else None


def _checkpoint_step(d: Path, folder: str) -> tuple[int, int]:
    """The step of the newest complete checkpoint in d/folder (a checkpoint folder holds `state.json`), and the
    bytes of every complete one."""
    best = 0
    ck = d / folder
    size = 0
    try:
        with os.scandir(ck) as it:
            for e in it:
                if e.is_dir() and e.name.startswith("step_") and (Path(e.path) / "state.json").is_file():
                    with __import__("contextlib").suppress(ValueError):
                        best = max(best, int(e.name[5:]))
                    size += _files(Path(e.path))[1]
    except OSError:
        pass
    return best, size


def last_validation(metrics: Path, tail_bytes: int = 1 << 18) -> dict | None:
    """The last validation pass of train/metrics.jsonl ({step, acceptance_length, acceptance_per_position,
    samples}), read from the file's tail; None when there is none there."""
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - tail_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if b'"validation"' not in line:
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("split") == "validation":
            return {k: rec.get(k) for k in ("step", "acceptance_length", "acceptance_length_se",
                                            "acceptance_per_position", "samples")}
    return None


def eval_figures(d: Path) -> dict | None:
    """An eval folder's figures from its report.json: engine, prompts, tau with its standard error, speedup."""
    try:
        rep = json.loads((d / "report.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rep, dict):
        return None
    return {k: rep.get(k) for k in ("engine", "prompts", "num_speculative_tokens", "acceptance_length",
                                    "acceptance_length_se", "speedup")}


# how each kind of stages.Count is counted: (count, bytes) of the stage folder d, given the record's path
COUNTERS: dict[str, Callable[[Path, str], tuple[int, int]]] = {
    "lines": lambda d, path: _lines(d / path),
    "files": _files,
    "shard_files": _shard_files,
    "checkpoint_step": _checkpoint_step,
}


def on_disk(stage: str, d: Path) -> tuple[int, int]:
    """(count, bytes) of what `stage` (a stage folder's name: eval-vllm counts like eval) has in its folder d, as
    its record says to count it."""
    count = stages.get(stage).count
    return COUNTERS[count.kind](d, count.path)


# -------------------------------------------------------------------------------------------------
# Status of a run


_STATE_ORDER = ["failed", "dead", "interrupted", "stalled", "running", "pending", "done"]


def stage_status(run: RunDir, stage: str, now: float, host: str) -> dict[str, Any]:
    d = run.path / stage
    row: dict[str, Any] = {
        "name": stage, "state": "pending", "done": None, "total": None, "unit": None,
        "rate_per_s": None, "eta_s": None, "elapsed_s": None, "warming_up": False, "heartbeat_age_s": None, "pid": None,
        "on_disk": 0, "bytes_on_disk": 0, "error": None, "log": None,
    }
    if not d.is_dir():
        return row
    journals = sorted(p for p in d.glob("progress*.jsonl") if ".prev." not in p.name)
    ranks = [r for r in (journal_state(p, now, host) for p in journals) if r is not None]
    if ranks:
        # only the latest attempt's journals: an attempt with another number of ranks (a two-rank train rerun
        # in one process, say) leaves journals under other names, and a restart of as many ranks leaves a
        # crashed rank's journal in place until that rank starts again
        latest = max(ranks, key=lambda r: r["started"] or 0.0)
        w = latest["world_size"] or 1
        ranks = [r for r in ranks if (r["world_size"] or 1) == w and r["rank"] < w
                 and (latest["attempt"] is None or r["attempt"] == latest["attempt"])]
    manifest_done = (d / MANIFEST).is_file()
    if ranks:
        ranks.sort(key=lambda r: r["rank"])
        worst = min(ranks, key=lambda r: _STATE_ORDER.index(r["state"]))
        row["state"] = worst["state"]
        if manifest_done and all(r["state"] in ("done", "dead", "interrupted") for r in ranks):
            row["state"] = "done"  # crashed after writing its manifest: the work is complete
        totals = [r["total"] for r in ranks]
        # done is null in a journal of an attempt that failed before it started (no counted work)
        dones = [r["done"] for r in ranks if r["done"] is not None]
        rates = [r["rate_per_s"] for r in ranks if r["rate_per_s"]]
        # ranks that split the work add up; ranks that all count the same steps are as far as the slowest
        shared = all(r["shared"] for r in ranks)
        add = min if shared else sum
        row["done"] = add(dones) if dones else None
        row["total"] = (max if shared else sum)(totals) if all(t is not None for t in totals) else None
        row["unit"] = ranks[0]["unit"]
        row["rate_per_s"] = round(add(rates), 4) if rates else None
        etas = [r["eta_s"] for r in ranks if r["eta_s"] is not None]
        row["eta_s"] = max(etas) if etas else None
        row["elapsed_s"] = max(r["elapsed_s"] for r in ranks)
        row["warming_up"] = any(r["warming_up"] for r in ranks)
        row["heartbeat_age_s"] = min(r["heartbeat_age_s"] for r in ranks)
        row["pid"] = ranks[0]["pid"]
        row["error"] = next((r["error"] for r in ranks if r["error"]), None)
        row["log"] = stage_log(d, ranks[0]["log"])
        row["phase"] = worst.get("phase")
        row["bad_journal_lines"] = sum(r["bad_journal_lines"] for r in ranks)
        if len(ranks) > 1:
            row["ranks"] = ranks
    elif manifest_done:
        row["state"] = "done"
    if manifest_done and row["done"] is None:
        try:
            manifest = json.loads((d / MANIFEST).read_text())
            counts = manifest.get("counts", {})
            row["done"] = counts.get("done")
            row["total"] = counts.get("total")
            row["unit"] = counts.get("unit")
            row["elapsed_s"] = manifest.get("seconds")
            if row["done"] and row["elapsed_s"]:
                row["rate_per_s"] = round(row["done"] / row["elapsed_s"], 4)
        except (OSError, json.JSONDecodeError, AttributeError, TypeError):
            pass
    row["on_disk"], row["bytes_on_disk"] = on_disk(stage, d)
    if stage == "extract" and row["bytes_on_disk"]:
        row["bytes_per_token"] = extract_bytes_per_token(d, row["bytes_on_disk"])
    if stage == "train":
        row["validation"] = last_validation(d / "metrics.jsonl")
    if stage.split("-")[0] == "eval" and row["state"] == "done":  # eval/ and the run's eval-<engine>/ folders
        row["report"] = eval_figures(d)
    if stage == "generate":
        row["cut"] = generate_cut(d)
    return row


def stage_log(stage_dir: Path, recorded: str | None) -> str | None:
    """The stage's log as a journal records it: a name in the stage's folder (or, in journals written before, an
    absolute path: a moved run names the log in its own folder then)."""
    if not recorded:
        return None
    p = Path(recorded)
    return str(p if p.is_absolute() and p.exists() else stage_dir / p.name)


def extra_evals(run: RunDir) -> list[str]:
    """Evaluation folders beside eval/ (the demo's eval-vllm/), shown after the seven stages."""
    return sorted(p.name for p in run.path.glob("eval-*") if p.is_dir())


def run_status(path: str | os.PathLike) -> dict[str, Any]:
    run = RunDir(path)
    if not run.path.is_dir() or not run.is_run():
        raise DraftsmithError(f"{run.path}: not a draftsmith run directory (no run.json or stage folders)")
    now = time.time()
    host = socket.gethostname()
    out: dict[str, Any] = {"run": str(run.path), "time": round(now, 3),
                           "stages": [stage_status(run, s, now, host) for s in [*stages.names(), *extra_evals(run)]]}
    expected = read_run_estimate(run)
    if expected is not None:  # what `run` expected of each stage, beside what it took (pipeline.save_expectation)
        out["estimate"] = expected["command"]
        for row in out["stages"]:
            row["estimate_s"] = expected["stages"].get(row["name"])
    pipe = pipeline_status(run, host)
    if pipe is not None:
        out["pipeline"] = pipe
    return out


def pipeline_status(run: RunDir, host: str) -> dict[str, Any] | None:
    """The `draftsmith run` driving this run, if any (RUN/pipeline.json): alive, which stage."""
    try:
        p = json.loads((run.path / "pipeline.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    alive = pid_alive(int(p["pid"])) if p.get("host") == host and p.get("pid") else None
    state = ("done" if p.get("finished") else "interrupted" if p.get("interrupted") else "failed" if p.get("error")
             else "running" if alive else "dead" if alive is False else "unknown")
    return {"state": state, "pid": p.get("pid"), "current": p.get("current"), "stages": p.get("stages"),
            "error": p.get("error")}


# -------------------------------------------------------------------------------------------------
# Human-readable table


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _row_cells(r: dict[str, Any], name: str) -> list[str]:
    done = "" if r["done"] is None else str(r["done"])
    if r["total"] is not None:
        done += f"/{r['total']}"
    if r.get("unit") and done:
        done += f" {r['unit']}"
    state = r["state"] + (f" ({r['phase']})" if r.get("phase") and r["state"] in ("running", "stalled") else "")
    return [
        name, state, done or "-",
        f"{fmt_rate(r['rate_per_s'])}/s" + (" (warming up)" if r.get("warming_up") else "") if r["rate_per_s"] else "-",
        fmt_duration(r["eta_s"]) if r["eta_s"] is not None else "-",
        (fmt_duration(r["elapsed_s"]) if r.get("elapsed_s") is not None else "-")
        + (f" (est. {fmt_duration(r['estimate_s'])})" if r.get("estimate_s") is not None else ""),
        (f"{r['heartbeat_age_s']:.0f}s" if r["heartbeat_age_s"] is not None and r["state"] not in ("done", "pending")
         else "-"),
        str(r["pid"] or "-"),
        (f"{r['on_disk']} ({_bytes(r['bytes_on_disk'])}"
         + (f", {r['bytes_per_token']:,.0f} B/token" if r.get("bytes_per_token") else "") + ")"
         if r["bytes_on_disk"] else str(r["on_disk"] or "-")),
    ]


def render_table(status: dict[str, Any]) -> str:
    headers = ["stage", "state", "done", "rate", "ETA", "elapsed", "heartbeat", "pid", "on disk"]
    rows = []
    notes = []
    for r in status["stages"]:
        rows.append(_row_cells(r, r["name"]))
        for rr in r.get("ranks", []):
            rows.append(_row_cells({**rr, "on_disk": 0, "bytes_on_disk": 0}, f"  rank {rr['rank']}"))
        if r["error"]:
            notes.append(f"{r['name']}: {r['error']}" + (f"  (log: {r['log']})" if r.get("log") else ""))
        val = r.get("validation") or {}
        if isinstance(val.get("acceptance_length"), (int, float)):
            per_pos = " ".join(f"{a:.2f}" for a in val.get("acceptance_per_position") or []
                               if isinstance(a, (int, float)))
            tau = fmt_tau(val["acceptance_length"], val.get("acceptance_length_se"))
            notes.append(f"{r['name']}: validation tau {tau}"
                         f" at step {val.get('step')} (per position {per_pos}; {val.get('samples')} held-out samples; "
                         "± one standard error)")
        rep = r.get("report") or {}
        if isinstance(rep.get("acceptance_length"), (int, float)):
            speed = f", {rep['speedup']:.2f}x plain decoding" if isinstance(rep.get("speedup"), (int, float)) else ""
            notes.append(f"{r['name']}: {rep.get('engine')} engine tau "
                         f"{fmt_tau(rep['acceptance_length'], rep.get('acceptance_length_se'))} at K = "
                         f"{rep.get('num_speculative_tokens')} over {rep.get('prompts')} prompts{speed}")
        if r.get("cut"):
            notes.append(f"{r['name']}: {r['cut']} answers cut for time (no data for generate.idle_timeout_s), counted "
                         "as lost: not in samples.jsonl nor the training data; `generate --retry-failed` asks again")
        if r.get("bad_journal_lines"):
            notes.append(f"{r['name']}: {r['bad_journal_lines']} line(s) of its progress journal are not valid events "
                         "and were skipped")
        if (r["state"] != "pending" and r["done"] is not None
                and r["name"] in stages.REGISTRY and stages.get(r["name"]).count.same_unit):
            if r["on_disk"] != r["done"]:
                notes.append(f"{r['name']}: the journal says {r['done']} {r['unit'] or ''} done, "
                             f"the files on disk hold {r['on_disk']}")
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    head = f"run: {status['run']}"
    pipe = status.get("pipeline")
    if pipe:
        head += (f"  (draftsmith run: {pipe['state']}"
                 + (f", at {pipe['current']}" if pipe["current"] and pipe["state"] == "running" else "")
                 + (f", pid {pipe['pid']}" if pipe["state"] == "running" else "")
                 + (f": {pipe['error']}" if pipe.get("error") else "") + ")")
    lines = [head, "  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    if status.get("estimate"):
        notes.append(f"est.: what `draftsmith run` expected of each stage on this machine ({status['estimate']})")
    lines += notes
    return "\n".join(lines)


NOTIFY_STATES = ("running", "stalled", "dead", "failed", "interrupted", "done")
def notify_timeout_s() -> float:
    """The longest one --notify command may run (DRAFTSMITH_NOTIFY_TIMEOUT_S, 60 s): then its whole process group is
    killed and the warning says so."""
    return env_number("DRAFTSMITH_NOTIFY_TIMEOUT_S", 60.0, 0.1, 3600.0)


def notify_env(run: str, row: dict[str, Any], previous: str | None) -> dict[str, str]:
    """What a --notify command is told of a stage's change (environment variables, all strings)."""
    done = "" if row["done"] is None else str(row["done"])
    total = "" if row["total"] is None else str(row["total"])
    progress = f"{done}/{total} {row.get('unit') or ''}".strip() if done else ""
    eta = "" if row["eta_s"] is None else str(round(row["eta_s"]))
    message = (f"draftsmith {Path(run).name}: {row['name']} {previous or 'pending'} -> {row['state']}"
               + (f", {progress}" if progress else "") + (f", ETA {fmt_duration(row['eta_s'])}" if eta else "")
               + (f": {row['error']}" if row.get("error") else ""))
    return {"DRAFTSMITH_RUN": str(run), "DRAFTSMITH_STAGE": row["name"], "DRAFTSMITH_STATE": row["state"],
            "DRAFTSMITH_PREVIOUS_STATE": previous or "pending", "DRAFTSMITH_DONE": done, "DRAFTSMITH_TOTAL": total,
            "DRAFTSMITH_UNIT": row.get("unit") or "", "DRAFTSMITH_ETA_S": eta,
            "DRAFTSMITH_ERROR": row.get("error") or "",
            # the line as a JSON string, quotes included: `{"text": $DRAFTSMITH_MESSAGE_JSON}` is valid for any message
            "DRAFTSMITH_MESSAGE": message, "DRAFTSMITH_MESSAGE_JSON": json.dumps(message)}


def run_notify(command: str, env: dict[str, str]) -> str | None:
    """Run a --notify command (a shell line) with `env` added, in a session of its own; None when it worked, else
    why not (one line). Past notify_timeout_s() its whole process group is killed (a `curl` the shell started
    included), not the shell alone."""
    bound = notify_timeout_s()
    try:
        p = subprocess.Popen(command, shell=True, env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    except OSError as e:
        return f"{type(e).__name__}: {e}"
    try:
        out, err = p.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return f"no end in {bound:g} s (DRAFTSMITH_NOTIFY_TIMEOUT_S): it and every process it started were killed"
    if p.returncode != 0:
        return f"exit {p.returncode}: {' '.join((err or out).split())[:200]}"
    return None


class Notifier:
    """watch --notify's commands, run in order on a thread of their own, so that a slow or hung command never holds
    the table's refresh; each one's failure is a warning line on stderr."""

    def __init__(self, command: str):
        self.command = command
        self.calls: queue.Queue = queue.Queue()
        threading.Thread(target=self._serve, daemon=True, name="watch --notify").start()

    def send(self, env: dict[str, str], what: str) -> None:
        self.calls.put((env, what))

    def _serve(self) -> None:
        while True:
            env, what = self.calls.get()
            try:
                if (why := run_notify(self.command, env)) is not None:
                    sys.stderr.write(f"draftsmith watch: warning: --notify for {what} failed ({why})\n")
                    sys.stderr.flush()
            finally:
                self.calls.task_done()

    def drain(self) -> None:
        """Wait for the commands sent so far (each bounded by notify_timeout_s())."""
        self.calls.join()


def watch(path: str, interval_s: float = 2.0, max_iterations: int | None = None, notify: str | None = None) -> None:
    """Refresh the table on a terminal until every stage is done or failed; snapshots when piped (at most one per
    10 s, and one at each change of a stage's state).

    notify: a shell command run once per change of a stage's state to running, stalled, dead, failed, interrupted or
    done (not for what the stages were when watching began), with the run, stage, state, progress and ETA in its
    environment (notify_env: DRAFTSMITH_MESSAGE is a ready line for Slack or mail). With it, watching goes on through
    a stage that died or failed, until every stage is done (a restarted stage is seen again); Ctrl-C ends it."""
    tty = sys.stdout.isatty()
    i = 0
    seen: dict[str, str] | None = None
    notifier = Notifier(notify) if notify is not None else None
    last_print = 0.0
    while True:
        st = run_status(path)
        states = {s["name"]: s["state"] for s in st["stages"]}
        changed = seen is not None and any(states[n] != seen.get(n) for n in states)
        if notifier is not None and seen is not None:
            for row in st["stages"]:
                if row["state"] != seen.get(row["name"]) and row["state"] in NOTIFY_STATES:
                    notifier.send(notify_env(path, row, seen.get(row["name"])), f"{row['name']} {row['state']}")
        seen = states
        now = time.monotonic()
        if tty or changed or now - last_print >= 10.0 or i == 0:
            text = render_table(st)
            sys.stdout.write("\x1b[2J\x1b[H" + text + "\n" if tty else f"--- {time.strftime('%H:%M:%S')}\n{text}\n")
            sys.stdout.flush()
            last_print = now
        pipe = st.get("pipeline")
        active = any(s in ("running", "stalled") for s in states.values()) or (pipe is not None
                                                                                 and pipe["state"] == "running")
        if notify is None and not active and any(s != "pending" for s in states.values()):
            return
        if notifier is not None and all(s == "done" for s in states.values()):
            notifier.drain()  # the last change's command too
            return
        i += 1
        if max_iterations is not None and i >= max_iterations:
            if notifier is not None:
                notifier.drain()
            return
        time.sleep(interval_s if (tty or notify is not None) else max(interval_s, 10.0))
