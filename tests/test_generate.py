"""Stage generate: the openai backend against a fake server (and a fault-injecting proxy), the
local backend on the tiny target, resume after SIGKILL (the API key: tests/test_security.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.generate.reasoning import split_reasoning
from draftsmith.generate.samples import read_records
from draftsmith.generate.stage import run_generate
from draftsmith.http import backoff_delay, normalize_server
from draftsmith.rundir import RunDir

sys.path.insert(0, str(Path(__file__).parent))
from openai_fakes import FAULTS, FakeOpenAIServer, FaultProxy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def write_prompts(path: Path, n: int, multi_every: int = 3, extra: dict[int, str] | None = None) -> Path:
    """n conversations in OpenAI `messages` JSONL; every `multi_every`-th has two user turns."""
    extra = extra or {}
    with open(path, "w") as f:
        for i in range(n):
            msgs = [{"role": "user", "content": f"question {i} {extra.get(i, '')}".strip()}]
            if multi_every and i % multi_every == 0:
                msgs += [{"role": "assistant", "content": "an old answer, to be regenerated"},
                         {"role": "user", "content": f"follow-up {i} {extra.get(i, '')}".strip()}]
            f.write(json.dumps({"id": f"p{i}", "messages": msgs}) + "\n")
    return path


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cfg_for(target, prompts, *sets):
    return load_config(None, [f"target={target}", f"generate.prompts={prompts}", *sets])


def openai_sets(*urls, **kw):
    base = {"generate.backend": "openai", "generate.servers": json.dumps(list(urls)), "generate.idle_timeout_s": 2,
            "generate.backoff_s": 0.01}
    base.update({f"generate.{k}": v for k, v in kw.items()})
    return [f"{k}={v}" for k, v in base.items()]


def lines_of(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.exists() else []


def check_accounting(d: Path, all_ids: set[str]) -> tuple[set[str], set[str]]:
    """Every sample is finished or failed, none twice, none in both files, none lost."""
    samples, failures = lines_of(d / "samples.jsonl"), lines_of(d / "failures.jsonl")
    s_ids, f_ids = [r["id"] for r in samples], [r["id"] for r in failures]
    assert len(s_ids) == len(set(s_ids)), "a sample was written twice"
    assert len(f_ids) == len(set(f_ids)), "a failure was recorded twice"
    assert not set(s_ids) & set(f_ids), "a sample is in both files"
    assert set(s_ids) | set(f_ids) == all_ids, "a sample was lost"
    return set(s_ids), set(f_ids)


# -------------------------------------------------------------------------------------------------
# Pieces


def test_split_reasoning():
    assert split_reasoning("plain answer") == ("plain answer", None)
    assert split_reasoning("<think>step 1\nstep 2</think>\n\nThe answer.") == ("The answer.", "step 1\nstep 2")
    assert split_reasoning("hidden start</think>answer") == ("answer", "hidden start")  # <think> was in the prompt
    assert split_reasoning("Answer so far<think>cut in the mid") == ("Answer so far", "cut in the mid")  # truncated
    assert split_reasoning("answer", "from the field") == ("answer", "from the field")
    assert split_reasoning("<think>b</think>answer", "a") == ("answer", "a\n\nb")
    assert split_reasoning("<think>a</think>x<think>b</think>y") == ("xy", "a\n\nb")


def test_read_records_repairs_a_torn_tail(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_bytes(b'{"id": "a"}\n{"id": "b"}\n{"id": "c", "mes')  # cut by a crash mid-line
    logs = []
    assert [r["id"] for r in read_records(p, logs.append)] == ["a", "b"]
    assert p.read_bytes() == b'{"id": "a"}\n{"id": "b"}\n' and logs
    p.write_bytes(b'{"id": "a"}\n{"id": "b"}')  # whole JSON but its newline never written: not done
    assert [r["id"] for r in read_records(p)] == ["a"]
    assert p.read_bytes() == b'{"id": "a"}\n'
    p.write_bytes(b'{"id": "a"}\nnot json\n{"id": "b"}\n')  # damage in the middle: refuse, naming the line
    with pytest.raises(DraftsmithError, match=r"s.jsonl:2"):
        read_records(p)


def test_backoff_and_urls():
    for attempt in range(1, 12):
        d = backoff_delay(attempt, 0.5)
        assert 0.5 * min(30.0, 0.5 * 2 ** (attempt - 1)) <= d <= 1.5 * min(30.0, 0.5 * 2 ** (attempt - 1))
    assert 0.5 <= backoff_delay(2, 0.5) <= 1.5
    assert backoff_delay(1, 0.5, retry_after="3") == 3.0
    assert normalize_server("http://h:8000", "generate.servers") == "http://h:8000/v1"
    assert normalize_server("http://h:8000/v1/", "generate.servers") == "http://h:8000/v1"
    assert normalize_server("https://h/api/v1", "generate.servers") == "https://h/api/v1"
    with pytest.raises(DraftsmithError, match="generate.servers"):
        normalize_server("h:8000", "generate.servers")


# -------------------------------------------------------------------------------------------------
# Backend openai against the fake server


def test_openai_records_multiturn_reasoning(tmp_path, tiny_target):
    extra = {1: "[reason-field]", 2: "[reasoning]", 3: "[think]", 4: "[open-think]", 5: "[long]"}
    prompts = write_prompts(tmp_path / "p.jsonl", 9, extra=extra)
    run = RunDir(tmp_path / "run")
    with FakeOpenAIServer() as srv:
        m = run_generate(run, cfg_for(tiny_target, prompts, *openai_sets(srv.base_url, max_tokens=7, temperature=0.5)))
        reqs = srv.chat_requests()
    recs = {r["id"]: r for r in lines_of(run.path / "generate" / "samples.jsonl")}
    assert set(recs) == {f"p{i}" for i in range(9)}
    assert m["counts"]["done"] == 9 and m["counts"]["total"] == 9 and m["counts"]["failed"] == 0
    # Sampling settings reach the server.
    assert all(r["body"]["max_tokens"] == 7 and r["body"]["temperature"] == 0.5 and r["body"]["model"] == "fake-model" for r in reqs)
    # Multi-turn: the second request carries the model's own first answer, not the source's.
    second = [r["body"]["messages"] for r in reqs if r["body"]["messages"][-1]["content"].startswith("follow-up 0")]
    assert len(second) == 1
    assert second[0][1] == {"role": "assistant", "content": "answer 1 to: question 0"}
    r0 = recs["p0"]
    assert [x["role"] for x in r0["messages"]] == ["user", "assistant", "user", "assistant"]
    assert r0["messages"][3]["content"] == "answer 2 to: follow-up 0"
    assert r0["finish_reasons"] == ["stop", "stop"] and r0["truncated"] is False and r0["reasoning"] is False
    assert r0["backend"] == "openai" and r0["model"] == "fake-model"
    assert r0["completion_tokens"] == 5 + 5 and r0["prompt_tokens"] > 0
    # Reasoning from both field names and from <think> blocks, moved out of the content.
    assert recs["p1"]["messages"][1]["reasoning"] == "thinking about 1" and recs["p1"]["reasoning"]
    assert recs["p2"]["messages"][1]["reasoning"] == "pondering 1"
    assert recs["p3"]["messages"][1] == {"role": "assistant", "content": "answer 1 to: question 3 [think]", "reasoning": "inner 1"}
    assert recs["p3"]["messages"][3]["reasoning"] == "inner 2"
    assert recs["p4"]["messages"][1]["reasoning"] == "cut off 1" and "<think>" not in recs["p4"]["messages"][1]["content"]
    assert recs["p4"]["truncated"] and recs["p5"]["finish_reasons"] == ["length"] and recs["p5"]["truncated"]
    assert "reasoning" not in recs["p7"]["messages"][1] and recs["p7"]["reasoning"] is False
    assert m["counts"]["reasoning"] == 4 and m["counts"]["truncated"] == 2
    log = (run.path / "generate" / "stage.log").read_text()
    assert "ok 9, failed 0, skipped 0" in log and "reasoning captured for 4/9" in log and "tokens/s" in log
    # A rerun with the same settings is up to date: it sends nothing and keeps the manifest.
    with FakeOpenAIServer() as srv:
        m2 = run_generate(run, cfg_for(tiny_target, prompts, *openai_sets(srv.base_url, max_tokens=7, temperature=0.5)))
        assert srv.chat_requests() == []
    assert m2 == m


def test_requests_spread_over_servers(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 24, multi_every=0)
    with FakeOpenAIServer(delay_s=0.02) as a, FakeOpenAIServer(delay_s=0.02) as b:
        m = run_generate(RunDir(tmp_path / "run"), cfg_for(tiny_target, prompts, *openai_sets(a.base_url, b.base_url, concurrency=4)))
        na, nb = len(a.chat_requests()), len(b.chat_requests())
    assert m["counts"]["done"] == 24 and na + nb == 24
    assert na >= 6 and nb >= 6, (na, nb)


def test_concurrency_auto_is_32_against_servers_of_others(tmp_path, tiny_target):
    """Backend openai cannot see another's KV cache: `auto` keeps 32 requests in flight; a number is kept."""
    prompts = write_prompts(tmp_path / "p.jsonl", 40, multi_every=0)
    with FakeOpenAIServer(delay_s=0.05) as srv:
        m = run_generate(RunDir(tmp_path / "run"), cfg_for(tiny_target, prompts, *openai_sets(srv.base_url)))
        m5 = run_generate(RunDir(tmp_path / "run5"), cfg_for(tiny_target, prompts, *openai_sets(srv.base_url,
                                                                                                concurrency=5)))
    assert m["summary"]["in_flight"] == 32 and m5["summary"]["in_flight"] == 5
    assert m["summary"]["preemptions"] is None  # a server of our own reports them (backend vllm)


def test_auto_in_flight_fills_the_kv_cache_without_preemption(tmp_path):
    """As many requests as the cache holds at their mean need, 1 at least, AUTO_MAX_IN_FLIGHT at most; the
    cache's size is read from the server's last start-up line."""
    from draftsmith.generate.vllm import auto_in_flight
    from draftsmith.vllm_server import VLLMServer

    assert auto_in_flight(46_592, 347) == 134  # SmolLM2 in float32 in 2 GiB, a 91-token prompt + 256
    assert auto_in_flight(46_592, 100_000) == 1
    assert auto_in_flight(10**7, 300) == auto_in_flight(None, 300) == 256
    log = tmp_path / "vllm.log"
    log.write_text("INFO [kv_cache_utils.py:2327] CPU KV cache size: 46,592 tokens, Maximum concurrency ...\n"
                   "$ a second start in the same log\nINFO GPU KV cache size: 1,234,567 tokens, Maximum ...\n")
    srv = VLLMServer(tmp_path, log_path=log)
    assert srv.kv_cache_tokens() == 1_234_567
    log.write_text("no such line\n")
    assert srv.kv_cache_tokens() is None


def test_unreachable_server_and_wrong_model(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    with pytest.raises(DraftsmithError, match=r"127.0.0.1:9/v1 does not answer /models"):
        run_generate(RunDir(tmp_path / "r1"), cfg_for(tiny_target, prompts, *openai_sets("http://127.0.0.1:9", retries=0)))
    with FakeOpenAIServer() as srv, pytest.raises(DraftsmithError, match=r"generate.model: .* does not serve 'other'"):
        run_generate(RunDir(tmp_path / "r2"), cfg_for(tiny_target, prompts, *openai_sets(srv.base_url, model="other")))
    with pytest.raises(DraftsmithError, match="generate.servers"):
        run_generate(RunDir(tmp_path / "r3"), cfg_for(tiny_target, prompts, "generate.backend=openai"))


def test_each_fault_is_retried(tmp_path, tiny_target):
    """One of each fault, in a row, on one connection at a time: all retried, nothing lost."""
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    script = ["500", "429", "hang", "drop", "cut_json", "cut_body"]
    with FakeOpenAIServer() as srv, FaultProxy(srv.port, rate=0.0, script=script, hang_s=1.5) as px:
        m = run_generate(RunDir(tmp_path / "run"), cfg_for(tiny_target, prompts, *openai_sets(
            px.base_url, concurrency=1, retries=6, idle_timeout_s=1)))
    assert all(px.counts[f] == 1 for f in script), px.counts
    assert m["counts"]["done"] == 6 and m["summary"]["failed"] == 0
    check_accounting(tmp_path / "run" / "generate", {f"p{i}" for i in range(6)})


def test_faults_failures_then_retry_failed(tmp_path, tiny_target, cli):
    """Random faults with one retry: some samples fail. The stage exits non-zero with a one-line
    message and no manifest; each sample is in exactly one file; --retry-failed finishes them."""
    n = 40
    prompts = write_prompts(tmp_path / "p.jsonl", n)
    run = tmp_path / "run"
    d = run / "generate"
    ids = {f"p{i}" for i in range(n)}
    # no hang: a sample whose last attempt hangs is cut for time, not failed (test_generate_progress.py)
    hard = tuple(f for f in FAULTS if f != "hang")
    with FakeOpenAIServer() as srv, FaultProxy(srv.port, rate=0.5, seed=1, faults=hard) as px:
        args = ["generate", "--run", str(run), "--set", f"target={tiny_target}", "--prompts", str(prompts),
                "--backend", "openai", "--server", px.base_url, "--concurrency", "8",
                "--set", "generate.retries=1", "--set", "generate.idle_timeout_s=1", "--set", "generate.backoff_s=0.01"]
        p = cli(*args)
        done, failed = check_accounting(d, ids)
        assert failed and done, (px.counts, p.stdout[-2000:])
        assert p.returncode != 0
        err = p.stderr.strip().splitlines()
        assert err[-1] == f"draftsmith: error: {len(failed)} samples failed, see {d.resolve() / 'failures.jsonl'}; rerun with --retry-failed"
        assert not (d / "manifest.json").exists()
        fails = lines_of(d / "failures.jsonl")
        assert all(f["error"] and f["attempts"] == 2 and f["time"] > 0 for f in fails)
        assert sum(px.counts[k] for k in px.counts if k != "ok") > 0

        # A plain rerun does not retry them and still refuses to complete.
        p2 = cli(*args)
        assert p2.returncode != 0 and "skipped" in p2.stdout and not (d / "manifest.json").exists()
        assert check_accounting(d, ids) == (done, failed)

        px.rate = 0.0
        # (generous timeout and retries: on a loaded machine a clean request may take over a second)
        p3 = cli(*args, "--retry-failed", "--set", "generate.idle_timeout_s=30", "--set", "generate.retries=3")
        assert p3.returncode == 0, p3.stderr
    done3, failed3 = check_accounting(d, ids)
    assert done3 == ids and not failed3 and not (d / "failures.jsonl").exists()
    m = json.loads((d / "manifest.json").read_text())
    assert m["counts"]["done"] == n and m["summary"]["ok"] == len(failed) and m["summary"]["skipped"] == len(done)


def test_sigkill_mid_run_then_resume(tmp_path, tiny_target):
    """SIGKILL half-way (plus a torn line, as a crash mid-write leaves): the rerun repairs the file,
    skips what was finished, and ends with every sample exactly once."""
    n = 200
    prompts = write_prompts(tmp_path / "p.jsonl", n, multi_every=0)
    run = tmp_path / "run"
    samples = run / "generate" / "samples.jsonl"
    with FakeOpenAIServer(delay_s=0.1) as srv:
        args = [sys.executable, "-m", "draftsmith", "generate", "--run", str(run), "--set", f"target={tiny_target}",
                "--prompts", str(prompts), "--backend", "openai", "--server", srv.base_url, "--concurrency", "4"]
        with open(tmp_path / "first.log", "w") as log:
            proc = subprocess.Popen(args, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and (not samples.exists() or samples.read_bytes().count(b"\n") < 20):
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "first.log").read_text()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        before = samples.read_bytes().count(b"\n")
        assert 20 <= before < n
        with open(samples, "ab") as f:
            f.write(b'{"id": "p199", "messages": [{"role": "user", "cont')
        p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        sent = len(srv.chat_requests())
    recs = lines_of(samples)
    assert sorted(r["id"] for r in recs) == sorted(f"p{i}" for i in range(n))
    assert "removing a line cut by an earlier crash" in p.stdout
    assert f"{before} already done" in p.stdout
    # Nothing finished before the kill was asked again (at most the requests in flight were).
    assert sent <= n + 4


def test_fingerprint_stale_samples_and_selection(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 8, multi_every=0)
    run = RunDir(tmp_path / "run")
    d = run.path / "generate"
    with FakeOpenAIServer() as srv:
        def go(*sets):
            n0 = len(srv.chat_requests())
            m = run_generate(run, cfg_for(tiny_target, prompts, *openai_sets(srv.base_url, *()), *sets))
            return m, len(srv.chat_requests()) - n0

        m1, sent = go("generate.max_tokens=16")
        assert sent == 8
        # Operational settings change nothing.
        m2, sent = go("generate.max_tokens=16", "generate.concurrency=2", "generate.idle_timeout_s=5", "generate.retries=1",
                      "generate.planned_answer_tokens=50")  # (an estimate's knob, added later: no run made before it
        # may go out of date, nor its store be extracted again)
        assert sent == 0 and m2["fingerprint"] == m1["fingerprint"]
        # A smaller selection: samples.jsonl holds exactly it; the rest is kept aside and reused.
        m3, sent = go("generate.max_tokens=16", "generate.limit=3")
        assert sent == 0 and m3["fingerprint"] != m1["fingerprint"]
        assert [r["id"] for r in lines_of(d / "samples.jsonl")] and {r["id"] for r in lines_of(d / "samples.jsonl")} == {"p0", "p1", "p2"}
        assert len(lines_of(d / "unselected.jsonl")) == 5
        m4, sent = go("generate.max_tokens=16")
        assert sent == 0 and m4["fingerprint"] == m1["fingerprint"] and len(lines_of(d / "samples.jsonl")) == 8
        assert not (d / "unselected.jsonl").exists()
        # A setting that changes the answers: old samples moved aside, all regenerated.
        m5, sent = go("generate.max_tokens=32")
        assert sent == 8 and m5["fingerprint"] != m1["fingerprint"]
        stale = list(d.glob("stale-*/samples.jsonl"))
        assert len(stale) == 1 and len(lines_of(stale[0])) == 8
        assert all(r["body"]["max_tokens"] == 32 for r in srv.chat_requests()[-8:])


def test_answers_per_prompt_resamples_with_own_seeds(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 4, multi_every=2)  # p0 and p2 have two turns
    run = RunDir(tmp_path / "run")
    d = run.path / "generate"
    with FakeOpenAIServer() as srv:
        def go(*sets):
            n0 = len(srv.chat_requests())
            m = run_generate(run, cfg_for(tiny_target, prompts, *openai_sets(srv.base_url), *sets))
            return m, srv.chat_requests()[n0:]

        m1, reqs = go("generate.max_tokens=16")
        assert len(reqs) == 6 and m1["counts"]["done"] == 4
        # Three answers each: the first greedy under the prompt's own id, two sampled at 0.9.
        m2, reqs = go("generate.max_tokens=16", "generate.answers_per_prompt=3", "generate.resample_temperature=0.9")
        assert m2["counts"]["done"] == 12 and m2["counts"]["total"] == 12 and len(reqs) == 2 * 6  # the first answers are reused
        recs = {r["id"]: r for r in lines_of(d / "samples.jsonl")}
        assert set(recs) == {f"p{i}" for i in range(4)} | {f"p{i}#{k}@T0.9" for i in range(4) for k in (2, 3)}
        assert all(r["body"]["temperature"] == 0.9 for r in reqs)
        seeds = {r["body"]["messages"][0]["content"]: set() for r in reqs}
        for r in reqs:
            seeds[r["body"]["messages"][0]["content"]].add(r["body"]["seed"])
        # A conversation's turns share its seed; each resampled conversation has its own.
        assert all(len(v) == 2 for v in seeds.values())
        assert len(set().union(*seeds.values())) == 8
        assert recs["p0#2@T0.9"]["sampling"]["temperature"] == 0.9 and "sampling" not in recs["p0"]
        assert recs["p0#2@T0.9"]["messages"][0] == recs["p0"]["messages"][0]  # the same prompt
        assert [m["role"] for m in recs["p0#3@T0.9"]["messages"]] == ["user", "assistant", "user", "assistant"]
        # Up to date; fewer answers select fewer samples (the others kept aside, sent nothing).
        _, reqs = go("generate.max_tokens=16", "generate.answers_per_prompt=3", "generate.resample_temperature=0.9")
        assert reqs == []
        m3, reqs = go("generate.max_tokens=16", "generate.answers_per_prompt=2", "generate.resample_temperature=0.9")
        assert reqs == [] and m3["counts"]["done"] == 8 and len(lines_of(d / "unselected.jsonl")) == 4
        # Another temperature: only the resampled answers are asked again (other ids, so other seeds).
        _, reqs = go("generate.max_tokens=16", "generate.answers_per_prompt=2", "generate.resample_temperature=0.5")
        assert len(reqs) == 6 and all(r["body"]["temperature"] == 0.5 for r in reqs)
        # Back to one answer: the run made before the knob existed is current again.
        m4, reqs = go("generate.max_tokens=16")
        assert reqs == [] and m4["fingerprint"] == m1["fingerprint"]


def test_source_ids_shaped_like_draftsmiths_own_never_collide(tmp_path, tiny_target):
    """A source id holding `#` (`a#2@T0.7`, like prompt a's resampled answer; `b#2`, like b's renamed duplicate) is
    escaped at load: every prompt keeps an answer of its own, a rerun counts only what is on disk, prepare takes
    them all, and a held-out group is never two source records' that only looked alike."""
    from draftsmith.heldout import group_of
    from draftsmith.prepare import run_prepare

    conv = lambda t: [{"role": "user", "content": t}]  # noqa: E731
    rows = [("a", "first"), ("a#2@T0.7", "second"), ("b", "third"), ("b", "fourth"), ("b#2", "fifth")]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "messages": conv(t)}) + "\n" for i, t in rows))
    run = RunDir(tmp_path / "run")
    with FakeOpenAIServer() as srv:
        sets = (*openai_sets(srv.base_url), "generate.max_tokens=16", "generate.answers_per_prompt=2",
                "generate.resample_temperature=0.7")
        m = run_generate(run, cfg_for(tiny_target, prompts, *sets))
        recs = lines_of(run.path / "generate" / "samples.jsonl")
        ids = [r["id"] for r in recs]
        assert m["counts"]["done"] == 10 and len(set(ids)) == 10
        assert {"a", "a#2@T0.7", "a%232@T0.7", "a%232@T0.7#2@T0.7", "b", "b#2", "b%232"} <= set(ids)
        # the five prompts' texts each answered twice, under ids that name them apart
        assert sorted(r["messages"][0]["content"] for r in recs) == sorted(t for _, t in rows for _ in range(2))
        # held out together: a prompt with its resampled answers, a duplicate with the record it repeats
        assert {group_of(i) for i in ids} == {"a", "a%232@T0.7", "b", "b%232"}
        # a rerun after a lost sample counts what is on disk, and asks for the lost one only
        lost = next(r for r in recs if r["id"] == "a#2@T0.7")
        (run.path / "generate" / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs
                                                                    if r is not lost))
        n0 = len(srv.chat_requests())
        m = run_generate(run, cfg_for(tiny_target, prompts, *sets))
        assert m["counts"]["done"] == 10 and len(srv.chat_requests()) - n0 == 1
    assert run_prepare(run, cfg_for(tiny_target, prompts, *sets))["counts"]["samples"] == 10


def test_resampled_answers_unseeded_for_vllm_cpu(tmp_path, tiny_target):
    """vLLM-CPU's engine dies on a per-request seed: backend vllm's own server on the CPU gets none."""
    import asyncio

    from draftsmith.generate.stage import expand_answers
    from draftsmith.generate.openai import ask_servers
    from draftsmith.generate.vllm import own_server_seeds
    from draftsmith.progress import Progress
    from draftsmith.prompts import load_prompts

    cfg = cfg_for(tiny_target, write_prompts(tmp_path / "p.jsonl", 2, multi_every=0), "generate.answers_per_prompt=2", "device=cpu")
    assert own_server_seeds(cfg) is False
    pending = expand_answers(load_prompts(cfg.generate.prompts), cfg.generate, seeded=own_server_seeds(cfg))
    recs = []
    with FakeOpenAIServer() as srv, Progress(RunDir(tmp_path / "run"), "generate", total=4, unit="samples") as prog:
        asyncio.run(ask_servers(pending, cfg.generate, [srv.base_url], None, prog, recs.append, None, in_flight=4))
        bodies = [r["body"] for r in srv.chat_requests()]
    assert len(bodies) == 4 and not any("seed" in b for b in bodies)
    assert sorted(b["temperature"] for b in bodies) == [0.0, 0.0, 0.7, 0.7]
    assert {r["id"]: r.get("sampling") for r in recs} == {"p0": None, "p1": None, "p0#2@T0.7": {"temperature": 0.7, "seed": None},
                                                         "p1#2@T0.7": {"temperature": 0.7, "seed": None}}


def test_own_server_gone_stops_the_stage_instead_of_failing_every_sample(tmp_path, tiny_target):
    """Backend vllm: once draftsmith's own server has exited, a failed request stops the stage with
    the server's exit reason; no sample is recorded as failed (they stay pending for the next run)."""
    import asyncio

    from draftsmith.generate.openai import ask_servers
    from draftsmith.progress import Progress
    from draftsmith.prompts import load_prompts

    cfg = cfg_for(tiny_target, write_prompts(tmp_path / "p.jsonl", 6, multi_every=0), "generate.retries=0")
    failed, done = [], []
    # Every chat request answers 500, as vLLM's API server does once its engine has died.
    with FakeOpenAIServer() as srv, FaultProxy(srv.port, rate=1.0, faults=("500",)) as px, \
            Progress(RunDir(tmp_path / "run"), "generate", total=6, unit="samples") as prog:
        with pytest.raises(DraftsmithError, match="^generate: vLLM server exited with code 1"):
            asyncio.run(ask_servers(load_prompts(cfg.generate.prompts), cfg.generate, [px.base_url], None, prog,
                                    done.append, lambda p, e: failed.append(p.id), in_flight=2,
                                    server_gone=lambda: "vLLM server exited with code 1; log x: boom"))
    assert failed == [] and done == []


def test_answers_per_prompt_not_with_backend_dataset(tmp_path, cli):
    r = cli("generate", "--run", str(tmp_path / "run"), "--set", "generate.backend=dataset",
            "--set", "generate.answers_per_prompt=2")
    assert r.returncode != 0 and "answers_per_prompt" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "generate").exists()


# -------------------------------------------------------------------------------------------------
# Backend local (tiny target)


def test_local_backend_batched_matches_unbatched_and_is_deterministic(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 5, extra={4: "a longer question with more words in it to pad"})
    out = {}
    for name, bs in (("b1", 1), ("b3", 3), ("b3again", 3)):
        m = run_generate(RunDir(tmp_path / name), cfg_for(tiny_target, prompts, "generate.max_tokens=6",
                                                          f"generate.batch_size={bs}", "dtype=float32"))
        assert m["counts"]["done"] == 5
        out[name] = (tmp_path / name / "generate" / "samples.jsonl").read_bytes()
    assert out["b3"] == out["b3again"]  # deterministic
    by_id = {k: {r["id"]: r for r in map(json.loads, v.splitlines())} for k, v in out.items()}
    # Left padding must not change what greedy decoding produces.
    assert all(by_id["b1"][i]["messages"] == by_id["b3"][i]["messages"] for i in by_id["b1"])
    r0 = by_id["b3"]["p0"]
    assert [m["role"] for m in r0["messages"]] == ["user", "assistant", "user", "assistant"]
    assert r0["backend"] == "local" and r0["model"] == Path(tiny_target).name
    assert len(r0["finish_reasons"]) == 2 and all(f in ("stop", "length") for f in r0["finish_reasons"])
    assert r0["truncated"] == ("length" in r0["finish_reasons"])
    assert 0 < r0["completion_tokens"] <= 12 and r0["prompt_tokens"] > 10
    # each batch decodes under a named phase: `status` says running, not stalled, while no answer lands
    phases = [e.get("phase") for e in map(json.loads, (tmp_path / "b3" / "generate" / "progress.jsonl").read_text().splitlines())]
    assert "decoding batch 1/2 (3 conversations, up to 6 tokens each)" in phases
    assert "decoding batch 2/2 (2 conversations, turn 2, up to 6 tokens each)" in phases


def test_local_backend_resampled_answers_are_reproducible(tmp_path, tiny_target):
    prompts = write_prompts(tmp_path / "p.jsonl", 3, multi_every=0)
    out = []
    for name in ("a", "b"):
        m = run_generate(RunDir(tmp_path / name), cfg_for(tiny_target, prompts, "generate.max_tokens=8", "dtype=float32",
                                                          "generate.answers_per_prompt=3", "generate.resample_temperature=1.5"))
        assert m["counts"]["done"] == 9
        out.append({r["id"]: r for r in lines_of(tmp_path / name / "generate" / "samples.jsonl")})
    assert out[0] == out[1]
    recs = out[0]
    assert "sampling" not in recs["p1"] and recs["p1#3@T1.5"]["sampling"]["temperature"] == 1.5
    # A tiny random model at temperature 1.5 wanders: the sampled answers are not the greedy one.
    answers = {recs[i]["messages"][1]["content"] for i in ("p1", "p1#2@T1.5", "p1#3@T1.5")}
    assert len(answers) == 3


def test_a_huge_prompt_is_judged_from_a_prefix(tiny_target):
    """A prompt far longer than the context is refused from a prefix: the tokenizer never sees the
    whole text (50 MB took minutes and 8 GB to tokenise); a short one is left to the full count."""
    from transformers import AutoTokenizer

    from draftsmith.prompts import PREFIX_CHARS_PER_TOKEN, prefix_exceeds

    tok = AutoTokenizer.from_pretrained(tiny_target)
    seen = []

    def spy(text, **kw):
        seen.append(len(text))
        return tok(text, **kw)

    huge = "word " * 2_000_000  # 10 MB
    assert prefix_exceeds(spy, huge, 1000) and max(seen) <= 1000 * PREFIX_CHARS_PER_TOKEN < len(huge)
    assert not prefix_exceeds(spy, "word " * 100, 1000) and not prefix_exceeds(spy, huge, None)


def test_local_prompt_too_long_fails_cleanly(tmp_path, tiny_target, cli):
    # p1 is over the context by a little (counted whole), p3 by far (judged from a prefix)
    prompts = write_prompts(tmp_path / "p.jsonl", 4, multi_every=0, extra={1: "word " * 3000, 3: "word " * 2_000_000})
    run = tmp_path / "run"
    p = cli("generate", "--run", str(run), "--set", f"target={tiny_target}", "--prompts", str(prompts), "--max-tokens", "4")
    assert p.returncode == 2 and "2 samples failed" in p.stderr.strip().splitlines()[-1]
    fails = lines_of(run / "generate" / "failures.jsonl")
    assert [f["id"] for f in fails] == ["p1", "p3"] and all("exceeds the target's context" in f["error"] for f in fails)
    assert "more than" in fails[1]["error"] and "10000" in fails[1]["error"]  # its characters, not its tokens
    assert {r["id"] for r in lines_of(run / "generate" / "samples.jsonl")} == {"p0", "p2"}
    assert not (run / "generate" / "manifest.json").exists()
    st = json.loads(cli("status", str(run), "--json").stdout)
    g = next(s for s in st["stages"] if s["name"] == "generate")
    assert g["state"] == "failed" and "samples failed" in g["error"] and g["on_disk"] == 2


# -------------------------------------------------------------------------------------------------
# Backend dataset (the prompt file's own replies)


def test_dataset_backend_keeps_the_files_replies_cut_at_max_tokens(tmp_path, tiny_target, cli):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target)
    n_tok = lambda text: len(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    templated = lambda conv: n_tok(tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True))  # noqa: E731
    long_reply = "def add(a, b): return a + b " * 20
    cjk = "漢字" * 30  # 3 bytes, 3 tokens of this byte-level tokenizer, per character
    assert n_tok(long_reply) > 40 > n_tok("<think>easy</think>done") > 8 and n_tok("漢") == 3
    prompts = _write_jsonl(tmp_path / "p.jsonl", [
        {"id": "none", "messages": [{"role": "user", "content": "a question nobody answered"}]},
        {"id": "short", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "hello there"}]},
        {"id": "multi", "conversations": [{"from": "human", "value": "easy?"}, {"from": "gpt", "value": "<think>easy</think>done"},
                                          {"from": "human", "value": "code?"}, {"from": "gpt", "value": long_reply},
                                          {"from": "human", "value": "more"}, {"from": "gpt", "value": "answers text that is gone"}]},
        {"id": "cjk", "messages": [{"role": "user", "content": "write"}, {"role": "assistant", "content": cjk}]},
    ])
    run = tmp_path / "run"
    args = ("generate", "--run", str(run), "--set", f"target={tiny_target}", "--prompts", str(prompts), "--backend", "dataset")
    p = cli(*args, "--max-tokens", "40")
    assert p.returncode == 0, p.stderr
    assert "without a reply to their first turn 1" in p.stdout  # "none" is left out, and counted
    recs = {r["id"]: r for r in lines_of(run / "generate" / "samples.jsonl")}
    assert set(recs) == {"short", "multi", "cjk"}
    short, multi, cjk_rec = recs["short"], recs["multi"], recs["cjk"]
    assert short["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": "hello there"}]
    assert short["finish_reasons"] == ["stop"] and not short["truncated"]
    assert short["completion_tokens"] == n_tok("hello there") + 1  # + the stop token, as servers count it
    assert short["prompt_tokens"] == templated(short["messages"][:2])  # the system prompt included
    assert short["backend"] == "dataset" and short["model"] == f"dataset:{prompts}"
    # turn 1 keeps its reasoning apart as the other backends do; turn 2 is cut at 40 tokens of the
    # target's tokenizer (as a server cuts at max_tokens) and ends the conversation: turn 3's reply
    # answers text that is no longer there
    m = multi["messages"]
    assert m[:3] == [{"role": "user", "content": "easy?"}, {"role": "assistant", "content": "done", "reasoning": "easy"},
                     {"role": "user", "content": "code?"}] and len(m) == 4
    assert m[3]["content"] == tok.decode(tok(long_reply, add_special_tokens=False)["input_ids"][:40]) and long_reply.startswith(m[3]["content"])
    assert multi["finish_reasons"] == ["stop", "length"] and multi["truncated"]
    assert multi["completion_tokens"] == n_tok("<think>easy</think>done") + 1 + 40
    assert multi["prompt_tokens"] == templated(m[:1]) + templated(m[:3])  # each turn's prompt holds the history
    # 40 tokens end inside the 14th character: the partial character is dropped, not kept as U+FFFD
    assert cjk_rec["messages"][1]["content"] == cjk[:13]
    man = json.loads((run / "generate" / "manifest.json").read_text())
    assert man["counts"]["done"] == 3 and man["counts"]["truncated"] == 2
    # A source's replies do not depend on decoding settings: the stage stays up to date.
    before = (run / "generate" / "samples.jsonl").read_bytes()
    p = cli(*args, "--max-tokens", "40", "--temperature", "0.7", "--set", "generate.top_p=0.5", "--set", "generate.batch_size=3")
    assert p.returncode == 0 and "up to date" in p.stdout
    assert json.loads((run / "generate" / "manifest.json").read_text())["fingerprint"] == man["fingerprint"]
    assert (run / "generate" / "samples.jsonl").read_bytes() == before
    # ... while max_tokens changes them: moved aside, cut again
    p = cli(*args, "--max-tokens", "8")
    assert p.returncode == 0 and len(list((run / "generate").glob("stale-*"))) == 1
    recs = {r["id"]: r for r in lines_of(run / "generate" / "samples.jsonl")}
    assert recs["multi"]["finish_reasons"] == ["length"] and recs["multi"]["completion_tokens"] == 8
    # offset counts the selection after the filters: "none" (no reply) is not one of the prompts skipped
    p = cli("generate", "--run", str(tmp_path / "run2"), "--set", f"target={tiny_target}", "--prompts", str(prompts),
            "--backend", "dataset", "--set", "generate.offset=1", "--set", "generate.limit=1")
    assert p.returncode == 0, p.stderr
    assert [r["id"] for r in lines_of(tmp_path / "run2" / "generate" / "samples.jsonl")] == ["multi"]


def test_dataset_backend_needs_a_chat_template(tmp_path, cli):
    from conftest import build_tiny_target

    bare = build_tiny_target(tmp_path / "bare", chat_template=None, num_layers=2)
    prompts = _write_jsonl(tmp_path / "p.jsonl", [{"id": "a", "messages": [{"role": "user", "content": "Q"},
                                                                           {"role": "assistant", "content": "A"}]}])
    p = cli("generate", "--run", str(tmp_path / "run"), "--set", f"target={bare}", "--prompts", str(prompts), "--backend", "dataset")
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "has no chat template" in p.stderr
    assert not (tmp_path / "run" / "generate" / "samples.jsonl").exists()


def test_cli_help_has_examples(cli):
    p = cli("generate", "--help")
    assert p.returncode == 0
    for opt in ("--backend", "--server", "--prompts", "--limit", "--max-tokens", "--temperature", "--concurrency", "--retry-failed"):
        assert opt in p.stdout
    assert "Examples" in p.stdout and "draftsmith generate --run" in p.stdout


# -------------------------------------------------------------------------------------------------
# The real target


@pytest.mark.integration
def test_local_smollm2_deterministic(tmp_path, smol_target):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "What is the capital of France?"}]}) + "\n"
                       + json.dumps({"id": "b", "messages": [{"role": "user", "content": "Write a haiku about the sea."}]}) + "\n")
    outs = []
    for name in ("r1", "r2"):
        m = run_generate(RunDir(tmp_path / name), cfg_for(smol_target, prompts, "generate.max_tokens=16", "generate.batch_size=2"))
        assert m["counts"]["done"] == 2
        outs.append((tmp_path / name / "generate" / "samples.jsonl").read_bytes())
    assert outs[0] == outs[1]
    recs = {r["id"]: r for r in map(json.loads, outs[0].splitlines())}
    assert "Paris" in recs["a"]["messages"][-1]["content"]
    assert all(r["messages"][-1]["content"].strip() and 0 < r["completion_tokens"] <= 16 for r in recs.values())
    assert recs["b"]["model"] == "SmolLM2-135M-Instruct"
