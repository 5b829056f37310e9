"""generate's requests are bounded by progress, not total time (issue 55, item 2): each answer is streamed, an
attempt is cut only when no data came for generate.idle_timeout_s, and an answer cut for time is counted as lost
(failures.jsonl `"cut": true`, the `done:` line, the manifest's counts.cut, `draftsmith status`), never dropped
without a word. Against the fake server of tests/openai_fakes.py; the real vLLM-CPU server's streamed answers are
compared with its non-streamed ones in tests/test_vllm_server.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from draftsmith import Terminated
from draftsmith.generate.openai import parse_stream, parse_turn
from draftsmith.generate.samples import read_records
from draftsmith.generate.stage import run_generate
from draftsmith.http import OpenAIClient
from draftsmith.rundir import RunDir
from draftsmith.status import render_table, run_status

sys.path.insert(0, str(Path(__file__).parent))
from openai_fakes import FakeOpenAIServer  # noqa: E402
from test_generate import cfg_for, lines_of, openai_sets, write_prompts  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def test_a_stream_equals_the_whole_reply_it_was_cut_from():
    """parse_stream of a reply's events gives what parse_turn gives for the reply itself: content, reasoning from
    either field or a `<think>` block split over several events, finish reason, token counts."""
    srv = FakeOpenAIServer()
    body = {"model": "m", "max_tokens": 64, "stream": True, "stream_options": {"include_usage": True}}
    for words in ("[reason-field]", "[reasoning]", "[think]", "[open-think]", "[long]", ""):
        body["messages"] = [{"role": "user", "content": f"question {words}"}]
        _, reply = srv.answer(body, {})
        events = [json.loads(e) for e in srv.stream_events(body, reply)[:-1]]
        assert len(events) > 4
        assert parse_stream("s", events) == parse_turn("s", reply), words


def test_a_slow_answer_that_keeps_coming_outlasts_the_idle_timeout(tmp_path, tiny_target):
    """Each answer streams for about 2.5 s, a piece every 0.25 s, under a 1 s idle timeout: the old whole-request
    timeout of 1 s cut every one of them; now each completes, with its reasoning, on its first attempt."""
    prompts = write_prompts(tmp_path / "p.jsonl", 3, multi_every=0, extra={0: "[reason-field]", 1: "[think]"})
    run = RunDir(tmp_path / "run")
    with FakeOpenAIServer(event_delay_s=0.25) as srv:
        t0 = time.monotonic()
        m = run_generate(run, cfg_for(tiny_target, prompts, *openai_sets(srv.base_url, idle_timeout_s=1, retries=0,
                                                                         concurrency=3)))
        took = time.monotonic() - t0
        chats = srv.chat_requests()
    assert len(chats) == 3 and all(r["body"]["stream"] is True for r in chats)  # one attempt each, streamed
    assert took > 2.0, took  # the answers did take longer than the idle timeout
    assert m["counts"]["done"] == 3 and m["counts"]["cut"] == 0
    recs = {r["id"]: r for r in read_records(run.path / "generate" / "samples.jsonl")}
    assert recs["p0"]["messages"][-1] == {"role": "assistant", "content": "answer 1 to: question 0 [reason-field]",
                                          "reasoning": "thinking about 1"}
    assert recs["p1"]["messages"][-1] == {"role": "assistant", "content": "answer 1 to: question 1 [think]",
                                          "reasoning": "inner 1"}
    assert recs["p2"]["messages"][-1] == {"role": "assistant", "content": "answer 1 to: question 2"}
    assert all(r["finish_reasons"] == ["stop"] and r["completion_tokens"] > 0 and r["prompt_tokens"] > 0
               for r in recs.values())


def test_a_stalled_answer_is_cut_after_the_idle_timeout_and_counted_as_lost(tmp_path, tiny_target, cli):
    """An answer that stops coming is cut after idle_timeout_s (not after the server's 30 s stall), retried, and when
    its last attempt is cut too, counted as lost: the stage completes, the sample is in failures.jsonl with
    `"cut": true` and not in samples.jsonl, and the count is in the log line, the manifest and `draftsmith status`."""
    prompts = write_prompts(tmp_path / "p.jsonl", 4, multi_every=0, extra={2: "[stall]"})
    run = RunDir(tmp_path / "run")
    d = run.path / "generate"
    with FakeOpenAIServer(stall_s=30.0) as srv:
        sets = openai_sets(srv.base_url, idle_timeout_s=1, retries=1)
        t0 = time.monotonic()
        m = run_generate(run, cfg_for(tiny_target, prompts, *sets))
        took = time.monotonic() - t0
        assert took < 15, took  # two attempts of about 1 s each (plus start-up), not 30 s each
        assert m["counts"]["done"] == 3 and m["counts"]["total"] == 4 and m["counts"]["cut"] == 1
        assert m["summary"]["cut"] == 1 and m["summary"]["failed"] == 0
        assert {r["id"] for r in lines_of(d / "samples.jsonl")} == {"p0", "p1", "p3"}
        (fail,) = lines_of(d / "failures.jsonl")
        assert fail["id"] == "p2" and fail["cut"] is True and fail["attempts"] == 2
        assert fail["error"].startswith("no data for 1s after 2 stream events (http://127.0.0.1:")
        log = (d / "stage.log").read_text()
        assert "sample p2 cut for time (lost) (turn 1, 2 attempts): no data for 1s" in log
        assert "done: ok 3, failed 0, skipped 0 (finished earlier), cut for time 1 (lost: no data for " in log

        assert run_status(run.path)["stages"][0]["cut"] == 1
        p = cli("status", str(run.path))
        assert p.returncode == 0, p.stderr
        assert ("generate: 1 answers cut for time (no data for generate.idle_timeout_s), counted as lost: not in "
                "samples.jsonl nor the training data; `generate --retry-failed` asks again") in p.stdout
        assert json.loads(cli("status", str(run.path), "--json").stdout)["stages"][0]["cut"] == 1

        # a plain rerun leaves it lost (up to date); --retry-failed asks again, and the server answers this time
        assert run_generate(run, cfg_for(tiny_target, prompts, *sets))["counts"]["cut"] == 1
        srv.stall_s = 0
        sent = len(srv.chat_requests())
        m2 = run_generate(run, cfg_for(tiny_target, prompts, *sets), retry_failed=True)
        assert len(srv.chat_requests()) == sent + 1
    assert m2["counts"]["done"] == 4 and m2["counts"]["cut"] == 0 and not (d / "failures.jsonl").exists()
    assert run_status(run.path)["stages"][0]["cut"] == 0
    assert "cut for time" not in render_table(run_status(run.path))


def test_an_interruption_raised_while_a_connection_opens_comes_out_as_itself():
    """anyio opens httpx's connections in a task group: a SIGTERM landing there came out as an exception group
    (a traceback, the stage `failed`); each streamed answer may open a connection, so it must come out as the
    interruption itself (draftsmith.Terminated: exit 143, the stage `interrupted`)."""
    async def go():
        client = OpenAIClient(["http://127.0.0.1:9/v1"], timeout_s=1)
        client._async = httpx.AsyncClient()

        async def send(*args, **kwargs):
            raise BaseExceptionGroup("connect", [OSError("refused"), BaseExceptionGroup("inner", [Terminated()])])

        client._async.send = send
        try:
            await client.arequest("POST", "/chat/completions", {}, parse=parse_stream, stream=True)
        finally:
            await client.aclose()

    with pytest.raises(Terminated):
        asyncio.run(go())


LEFT_A_COROUTINE = """
import sys
from draftsmith import Terminated, cli
async def attempt():
    pass
left = attempt()  # what anyio's connect leaves when the signal lands as it starts its attempts: never awaited
def app(**kwargs):
    raise Terminated()
cli.app = app
cli.main(["generate"])
"""


def test_a_stop_that_leaves_a_coroutine_never_awaited_is_still_one_line():
    """The CI caught it (a SIGTERM during a streamed connect): after the stop's one line, Python's RuntimeWarning
    "coroutine ... was never awaited" reached stderr at exit. A stop says one line and nothing more."""
    p = subprocess.run([sys.executable, "-c", LEFT_A_COROUTINE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert p.returncode == 143, p.stderr
    assert p.stderr.strip().splitlines() == ["draftsmith: terminated (SIGTERM); the same command resumes from the "
                                             "finished work"], p.stderr
