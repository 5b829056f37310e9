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
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and (not samples.exists() or samples.read_bytes().count(b"\n") < 5):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, sig)
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
