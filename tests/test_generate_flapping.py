"""Servers that go away mid-run and come back (beside test_generate.py's fault tests, where a
server answers badly but stays up): connections refused and open ones dropped for a while.

- Back within the retries: every sample finishes, none twice, nothing recorded as failed.
- Away for longer than the retries allow: the samples that ran out of retries are recorded in
  failures.jsonl, the others finish; each sample is in exactly one of the two files, none twice;
  the stage exits with its one-line error and no manifest; `--retry-failed` completes them.
- One of two servers away for good: retries go to the other one, so every sample finishes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest

from draftsmith.config import load_config
from draftsmith.generate.stage import GenerateFailed, run_generate
from draftsmith.http import Balancer
from draftsmith.rundir import RunDir
from openai_fakes import FakeOpenAIServer, FaultProxy
from test_generate import check_accounting, lines_of, write_prompts


class FlappingProxy(FaultProxy):
    """A FaultProxy (no faults by default) that can go away: `down()` closes its listening socket
    (new connections are refused) and aborts the open ones; `up()` listens on the same port again."""

    def __init__(self, upstream_port: int, **kw):
        super().__init__(upstream_port, rate=kw.pop("rate", 0.0), **kw)
        self.conns: set = set()
        self.is_up = True

    async def _client(self, reader, writer) -> None:
        self.conns.add(writer)
        try:
            await super()._client(reader, writer)
        finally:
            self.conns.discard(writer)

    async def _down(self) -> None:
        self.server.close()
        for w in list(self.conns):
            w.transport.abort()

    async def _up(self) -> None:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", self.port)

    def down(self) -> None:
        asyncio.run_coroutine_threadsafe(self._down(), self.loop).result(timeout=10)
        self.is_up = False

    def up(self) -> None:
        asyncio.run_coroutine_threadsafe(self._up(), self.loop).result(timeout=10)
        self.is_up = True


def refused(url: str) -> bool:
    import httpx

    try:
        httpx.get(url + "/models", timeout=2)
    except httpx.ConnectError:
        return True
    return False


def cfg_for(target, prompts: Path, *urls: str, **gen):
    sets = {"generate.backend": "openai", "generate.servers": json.dumps(list(urls)), "generate.concurrency": 4,
            "generate.idle_timeout_s": 10, **{f"generate.{k}": v for k, v in gen.items()}}
    return load_config(None, [f"target={target}", f"generate.prompts={prompts}", *(f"{k}={v}" for k, v in sets.items())])


def outage(proxy: FlappingProxy, samples: Path, after_lines: int, seconds: float | None) -> threading.Thread:
    """In the background: once samples.jsonl has `after_lines` lines, take the proxy down for
    `seconds` (None: for good). The stage runs in the foreground."""
    def go():
        deadline = time.time() + 60
        while time.time() < deadline and (not samples.exists() or samples.read_bytes().count(b"\n") < after_lines):
            time.sleep(0.005)
        proxy.down()
        if seconds is not None:
            time.sleep(seconds)
            proxy.up()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def test_balancer_sends_around_a_server_that_just_failed(monkeypatch):
    import draftsmith.http as h

    clock = [100.0]
    monkeypatch.setattr(h.time, "monotonic", lambda: clock[0])
    b = Balancer(["a", "b", "c"])
    first = [b.acquire() for _ in range(3)]
    assert sorted(first) == ["a", "b", "c"]  # fewest in flight, round-robin on ties
    for s in first:
        b.release(s, failed=s == "b")
    assert "b" not in [b.acquire() for _ in range(6)]  # failing: last, even with the fewest in flight
    assert b.acquire(avoid="a") != "a"  # a retry goes elsewhere
    clock[0] += Balancer.FAILING_S + 0.1
    assert b.acquire() == "b"  # probed again once the failure is old
    one = Balancer(["only"])
    one.release(one.acquire(), failed=True)
    assert one.acquire(avoid="only") == "only"  # a single server is still used


def test_server_away_and_back_within_the_retries(tmp_path, tiny_target):
    n = 60
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    run = RunDir(tmp_path / "run")
    samples = run.path / "generate" / "samples.jsonl"
    with FakeOpenAIServer(delay_s=0.02) as srv, FlappingProxy(srv.port) as px:
        t = outage(px, samples, after_lines=10, seconds=1.5)
        # backoff 0.2 s doubling: 8 retries wait about 50 s in all, far longer than the outage
        m = run_generate(run, cfg_for(tiny_target, prompts, px.base_url, retries=8, backoff_s=0.2))
        t.join(5)
        assert px.is_up and not refused(px.base_url)
    done, failed = check_accounting(run.path / "generate", {f"p{i}" for i in range(n)})
    assert len(done) == n and not failed
    assert m["counts"]["done"] == n and m["summary"]["failed"] == 0
    assert m["summary"]["ok"] == n  # nothing was skipped: the outage came mid-run
    log = (run.path / "generate" / "stage.log").read_text()
    assert "requests retried" in log  # requests did hit the closed port


def test_server_away_longer_than_the_retries_then_retry_failed(tmp_path, tiny_target, cli):
    n = 60
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    run = RunDir(tmp_path / "run")
    d = run.path / "generate"
    ids = {f"p{i}" for i in range(n)}
    with FakeOpenAIServer(delay_s=0.02) as srv, FlappingProxy(srv.port) as px:
        t = outage(px, d / "samples.jsonl", after_lines=10, seconds=1.0)
        # 2 retries 0.05 s apart: a request gives up within a fraction of a second of the outage
        with pytest.raises(GenerateFailed) as e:
            run_generate(run, cfg_for(tiny_target, prompts, px.base_url, retries=2, backoff_s=0.05))
        t.join(5)
        assert px.is_up
        done, failed = check_accounting(d, ids)
        assert failed and len(done) > 10, (len(done), len(failed))  # some finished after the server came back
        assert e.value.failed == len(failed) and not (d / "manifest.json").exists()
        fails = lines_of(d / "failures.jsonl")
        # refused, or dropped mid-request: transport errors naming the server, after 1 + 2 retries
        assert all(f["attempts"] == 3 and f["error"].startswith(("ConnectError", "RemoteProtocolError", "ReadError", "WriteError"))
                   and px.base_url in f["error"] for f in fails), fails[:3]
        st = json.loads(cli("status", str(run.path), "--json").stdout)
        g = next(s for s in st["stages"] if s["name"] == "generate")
        assert g["state"] == "failed" and f"{len(failed)} samples failed" in g["error"]

        sent_before = len(srv.chat_requests())
        m = run_generate(run, cfg_for(tiny_target, prompts, px.base_url, retries=2, backoff_s=0.05), retry_failed=True)
        resent = len(srv.chat_requests()) - sent_before
    done2, failed2 = check_accounting(d, ids)
    assert done2 == ids and not failed2 and not (d / "failures.jsonl").exists()
    assert m["summary"]["ok"] == len(failed) and m["summary"]["skipped"] == len(done)
    # Only the failed samples were asked again (one request per user turn: every third has two).
    assert resent == sum(2 if int(i[1:]) % 3 == 0 else 1 for i in failed)


def test_one_of_two_servers_away_for_good(tmp_path, tiny_target):
    n = 60
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    run = RunDir(tmp_path / "run")
    samples = run.path / "generate" / "samples.jsonl"
    with FakeOpenAIServer(delay_s=0.02) as a, FakeOpenAIServer(delay_s=0.02) as b, FlappingProxy(a.port) as px:
        t = outage(px, samples, after_lines=10, seconds=None)
        m = run_generate(run, cfg_for(tiny_target, prompts, px.base_url, b.base_url, retries=3, backoff_s=0.05))
        t.join(5)
        assert not px.is_up
        after = len(b.chat_requests())
    done, failed = check_accounting(run.path / "generate", {f"p{i}" for i in range(n)})
    assert len(done) == n and not failed and m["summary"]["failed"] == 0
    assert after > n // 2  # the live server took over
