"""Ctrl-C and SIGTERM: a stopped command exits non-zero with one line, `status` says `interrupted`
(not `failed`, not `dead`), and the same command resumes to the end."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from conftest import TINY_RUN_SETS, stop_signals_default  # noqa: E402
from openai_fakes import FakeOpenAIServer  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"
                            for i in range(n)))
    return path


def status_json(run: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "draftsmith", "status", str(run), "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return {s["name"]: s for s in json.loads(p.stdout)["stages"]}


@pytest.mark.parametrize("sig, code, word", [(signal.SIGINT, 130, "interrupted (Ctrl-C)"),
                                             (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_stopped_command_exits_nonzero_and_status_says_interrupted(tmp_path, tiny_target, sig, code, word):
    n = 60
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    run = tmp_path / "run"
    samples = run / "generate" / "samples.jsonl"
    with FakeOpenAIServer(delay_s=0.1) as srv:
        args = [sys.executable, "-m", "draftsmith", "generate", "--run", str(run), "--set", f"target={tiny_target}",
                "--prompts", str(prompts), "--backend", "openai", "--server", srv.base_url, "--concurrency", "2"]
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=stop_signals_default)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and (not samples.exists() or samples.read_bytes().count(b"\n") < 5):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(sig)  # (not os.kill: poll() may have reaped it)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == code, err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"draftsmith: {word}"), err
        row = status_json(run)["generate"]
        assert row["state"] == "interrupted", row
        assert "interrupted" in row["error"]
        # the same command resumes and finishes: nothing was lost, every sample once
        p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
    ids = [json.loads(line)["id"] for line in samples.read_text().splitlines()]
    assert sorted(ids) == sorted(f"p{i}" for i in range(n))
    assert status_json(run)["generate"]["state"] == "done"


@pytest.mark.parametrize("path", ["asyncio.timeout", pytest.param("wait_for", marks=pytest.mark.skipif(
    sys.version_info[:2] != (3, 11), reason="the race is 3.11's wait_for"))])
def test_a_cancel_landing_as_the_answer_completes_is_not_lost(path, monkeypatch):
    """The race behind a Ctrl-C that let generate finish every sample and exit 0 (Python 3.11's wait_for,
    CPython gh-86296), made deterministic: a fake server answers in the very step the main task is cancelled
    (asyncio.run cancels it on Ctrl-C). The client's request must end cancelled. Run through the old path
    (wait_for, taken where asyncio.timeout is missing), the same fake loses the cancel on 3.11: the test
    shows which path holds."""
    import asyncio

    import httpx

    from draftsmith.http import OpenAIClient

    if path == "wait_for":
        monkeypatch.delattr(asyncio, "timeout", raising=False)

    async def main() -> str:
        me = asyncio.current_task()

        async def answer(request: httpx.Request) -> httpx.Response:
            me.cancel()  # Ctrl-C lands ...
            return httpx.Response(200, json={"choices": []})  # ... as the answer completes

        client = OpenAIClient(["http://fake:1/v1"], timeout_s=30)
        client._async = httpx.AsyncClient(transport=httpx.MockTransport(answer))  # the fake server, in-process
        await client.arequest("POST", "/chat/completions", {})
        return "went on"

    if path == "asyncio.timeout":
        with pytest.raises(asyncio.CancelledError):
            asyncio.run(main())
    else:
        assert asyncio.run(main()) == "went on"  # the bug, as 3.11's wait_for has it: the fake reproduces it


STAGE_SIGNALS = [(stage, sig, code) for stage in ("prepare", "vocab", "extract", "export", "eval")
                 for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143))]


@pytest.fixture(scope="module")
def finished_run(tiny_run):
    """The session's whole tiny pipeline (conftest.tiny_run), run once: every stage's inputs, to stop each stage in a
    copy of."""
    return tiny_run[0].path, tiny_run[1]


@pytest.mark.parametrize("stage, sig, code", STAGE_SIGNALS,
                         ids=[f"{s}-{'SIGINT' if c == 130 else 'SIGTERM'}" for s, _, c in STAGE_SIGNALS])
def test_every_stage_stopped_by_a_signal_exits_130_or_143_and_resumes(finished_run, tmp_path, stage, sig, code):
    """prepare, vocab, extract, export and eval (generate above, train in test_train.py), each stopped by
    Ctrl-C (130) or SIGTERM (143) once its journal shows this attempt started: one stderr line, `status`
    says interrupted, and the same command then finishes. A stage can end before the signal lands (the tiny
    stages take a fraction of a second): that try is redone, until one lands inside the stage."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run[0], run)
    args = [sys.executable, "-m", "draftsmith", stage, "--run", str(run), "--config", str(finished_run[1]),
            *[x for kv in TINY_RUN_SETS for x in ("--set", kv)]]
    journal = run / stage / "progress.jsonl"
    for _ in range(8):
        shutil.rmtree(run / stage)  # the stage from scratch, so that it has work to be stopped in
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=stop_signals_default)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not _started_by(journal, proc.pid):
            time.sleep(0.002)
        proc.send_signal(sig)  # (not os.kill: poll() may have reaped it)
        out, err = proc.communicate(timeout=120)
        if proc.returncode == 0:
            continue  # it finished before the signal landed: again
        break
    else:
        pytest.fail(f"{stage} finished before every signal: nothing was stopped")
    assert proc.returncode == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("draftsmith: "), err
    assert "interrupted" in lines[0] or "terminated" in lines[0], err
    assert status_json(run)[stage]["state"] == "interrupted"
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert status_json(run)[stage]["state"] == "done"


def _started_by(journal: Path, pid: int) -> bool:
    try:
        with open(journal, "rb") as f:
            ev = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    return ev.get("ev") == "start" and ev.get("pid") == pid
