"""The device check's parts that stress what issue 55 found (bench/device_check.py runs them, one process each):

    soak     the Kimi-K2.5 MLA drafter and the Llama-8B drafter at their real widths trained through the real data
             path (a synthetic fp8 store, train/data.py's packing and packed batches) with varying row lengths, two
             epochs and a one-row tail: flex compiles a bounded number of graphs, never runs unfused, peak memory
             within 15 % of estimate.train_memory, tokens/s beside the estimate's rate;
    ranks    `draftsmith train` on 2 ranks (NCCL on CUDA, gloo on the CPU; launched here with LOCAL_RANK 0 each, so
             that both share the one GPU if NCCL allows it, else 1 rank, said so), DDP and FSDP2, a run cut at its
             checkpoint and resumed ends with the uninterrupted run's losses and weights;
    extract  extraction's host side (extract.backend=vllm: fetch, check, norm, fp8 quantisation, the store's writers)
             against a synthetic vLLM that answers with connector files in /dev/shm: samples/s.

Without CUDA each part runs at toy widths (the CPU rehearsal): what that proves is that the code and its imports work.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# recipe -> its target's config (configs/targets): the GPU recipes, whose drafters the check trains
RECIPES = {"kimi-k2.5-8xh200.yaml": "kimi-k2.5.json", "kimi-k2-8xh200.yaml": "kimi-k2-instruct.json",
           "llama-8b-1xh100.yaml": "llama-3.1-8b-instruct.json"}
# the soak's drafters: (name, recipe, on the GPU (seq_len, batch_tokens) when the recipe's is more than a short soak
# can pass through: Kimi's 8,192-token rows are cut to 4,096, the same kernels at half the store)
SOAK = (("kimi-k2.5 mla", "kimi-k2.5-8xh200.yaml", (4096, 8192)), ("llama-8b", "llama-8b-1xh100.yaml", (4096, 8192)))
MEMORY_TOLERANCE = 0.15  # peak within 15 % of estimate.train_memory
RATE_FLOOR = 0.05  # tokens/s at least 5 % of the estimate's compute rate: a broken kernel, not a slow one
# the UserWarning torch raises when flex attention runs its unfused reference path (every score materialised)
UNFUSED = r"(?s).*flex_attention called without torch\.compile"


def gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def target_dict(recipe: str) -> dict:
    """The recipe's target config (a multimodal wrapper: its language model's)."""
    hf = json.loads((REPO / "configs" / "targets" / RECIPES[recipe]).read_text())
    return hf.get("text_config") or hf


def recipe_drafter(recipe: str, cfg, num_layers: int | None = None):
    """The DrafterConfig training builds for the recipe's target (train/drafter.py's drafter_config: the kind's
    options included), from the committed config.json instead of a model folder."""
    from draftsmith import kinds
    from draftsmith.model.config import DrafterConfig

    hf = types.SimpleNamespace(**target_dict(recipe))
    tc = cfg.train
    attention, options = kinds.get(tc.method).config_options(tc, hf, tc.drafter_attention)
    return DrafterConfig.from_target_config(hf, draft_vocab_size=cfg.vocab.draft_vocab_size,
                                            num_hidden_layers=num_layers or tc.num_layers, attention=attention,
                                            **options)


def toy(dcfg):
    """A CPU-sized drafter of the same kind and attention (an MLA drafter's latent widths shrunk too)."""
    mla = {"q_lora_rank": dcfg.q_lora_rank and 64, "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16,
           "v_head_dim": 32} if dcfg.attention == "mla" else {}
    return replace(dcfg, hidden_size=128, intermediate_size=256, vocab_size=512, draft_vocab_size=128,
                   num_attention_heads=4, num_key_value_heads=min(4, dcfg.num_key_value_heads), head_dim=32, **mla)


def toy_target(recipe: str) -> dict:
    """The recipe's target config at toy's widths, for the estimate of the rehearsal's drafter."""
    hf = dict(target_dict(recipe))
    hf.update(hidden_size=128, intermediate_size=256, vocab_size=512, num_attention_heads=4,
              num_key_value_heads=min(4, hf.get("num_key_value_heads", 4)), head_dim=32)
    mla = {"q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 32}
    hf.update({k: v for k, v in mla.items() if hf.get(k)})
    return hf


# -------------------------------------------------------------------------------------------------
# soak


def synthetic_store(folder: Path, lengths: list[int], hidden: int, vocab: int, layers: list[int]):
    """An fp8 store as extract writes it (shards, meta.json), random states at `hidden`, one sample per length."""
    import torch

    from draftsmith.extract import store
    from draftsmith.rundir import atomic_write_json
    from draftsmith.store_format import FORMATS

    g = torch.Generator().manual_seed(0)
    w = store.ShardWriter(folder, layers, threads=4, fmt=FORMATS["fp8"])
    shard_size = 16
    for s in store.shard_ranges(len(lengths), shard_size):
        for i in range(*s):
            n = lengths[i]
            aux = torch.randn(1, n, len(layers), hidden, generator=g).to(torch.bfloat16)
            last = torch.randn(1, n, hidden, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            mask = [int(j >= n // 4) for j in range(n)]  # a prompt, then the answer the loss is on
            w.write_batch(s, [i], [{"id": f"s{i}", "input_ids": ids, "loss_mask": mask}], aux, last)
        w.finish_shard(s)
    w.close()
    atomic_write_json(folder / "meta.json", {"lengths": lengths, "layers": layers, "hidden_size": hidden,
                                            "shard_size": shard_size, "store_format": "fp8"})
    return store.ExtractStore(folder)


def soak_lengths(row_len: int, rows_per_batch: int, pack_seed: int, seed: int) -> list[int]:
    """Sample lengths that pack (train.seed `pack_seed`'s plans of epochs 0 and 1) into micro-batches of at least 4 shapes
    (each micro-batch's T is its longest row) and an odd number of rows: each epoch's last micro-batch holds one
    row, like an epoch's tail."""
    import random

    from draftsmith.train.data import pack_epoch

    rng = random.Random(seed)
    for _ in range(100):
        lengths = [rng.randrange(row_len // 16, row_len + 1) for _ in range(5 * rows_per_batch)]
        plans = [pack_epoch(lengths, row_len, rows_per_batch, pack_seed, e) for e in range(2)]
        shapes = {(len(rows), max(sum(lengths[i] for i in row) for row in rows)) for p in plans for rows in p}
        if all(len(p[-1]) == 1 for p in plans) and len(shapes) >= 4:  # pack_rows pads to the longest row
            return lengths
    raise RuntimeError("no length set packs into a one-row tail")


@contextlib.contextmanager
def unfused_flex_is_an_error():
    """Inside: torch's warning that flex attention runs unfused (uncompiled, or Dynamo past its recompile limit
    falling back to eager) raises instead of passing as one line in a log."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=UNFUSED, category=UserWarning)
        yield


def dynamo_graphs() -> int:
    """Graphs Dynamo compiled in this process so far (torch._dynamo's own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def soak(out: Path, work: Path, checks, drafters: tuple[str, ...] = tuple(n for n, _, _ in SOAK)) -> dict:
    """`drafters`: SOAK's names to run (the suite's rehearsal runs the MLA one alone)."""
    import torch
    import torch._dynamo

    sys.path.insert(0, str(REPO / "bench"))
    import bench_train_memory as bm
    from draftsmith.config import load_config
    from draftsmith.estimate import HARDWARE, estimate, train_memory
    from draftsmith.estimate import target_shape as shape_of
    from draftsmith.model.ttt import FLEX_GRAPHS
    from draftsmith.train.data import OfflineSource, Packing
    from draftsmith.train.objective import flex_shape

    on_gpu = gpu()
    dev = torch.device("cuda" if on_gpu else "cpu")
    precision = "bf16" if on_gpu else "fp32"
    act = torch.bfloat16 if on_gpu else torch.float32
    figures = {"drafters": []}
    for name, recipe, (seq_len, batch_tokens) in (s for s in SOAK if s[0] in drafters):
        if not on_gpu:
            seq_len, batch_tokens = 128, 256
        # offline: the soak reads a store (the Llama recipe trains online, whose estimate would add the target's
        # weights, which the soak does not load); generate.limit: the estimate wants one
        sets = [f"train.seq_len={seq_len}", f"train.batch_tokens={batch_tokens}", f"train.precision={precision}",
                "train.mode=offline", "train.max_steps=1000", "generate.limit=1000"]
        cfg = load_config(REPO / "configs" / recipe, sets)
        tc = cfg.train
        dcfg = recipe_drafter(recipe, cfg)
        hf = target_dict(recipe) if on_gpu else toy_target(recipe)
        if not on_gpu:
            dcfg = toy(dcfg)
        tfile = work / f"{recipe}.target.json"
        tfile.parent.mkdir(parents=True, exist_ok=True)
        tfile.write_text(json.dumps(hf))
        hw = HARDWARE["h200" if on_gpu else "cpu"]
        shape = shape_of(tfile, name, tc.drafter_attention)
        est_mem = train_memory(tc, shape, hw, 1, dcfg.draft_vocab_size, dcfg.num_aux_layers)["total"]
        est_rate = estimate(cfg, shape, hw, 1, 300, 1800)["tokens_per_s"]["train_compute"]

        packing = Packing([], min(seq_len, batch_tokens), max(1, batch_tokens // seq_len), tc.seed)
        lengths = soak_lengths(packing.row_len, packing.rows_per_batch, tc.seed, len(figures["drafters"]))
        folder = work / f"soak-{len(figures['drafters'])}"
        shutil.rmtree(folder, ignore_errors=True)
        t0 = time.time()
        source = OfflineSource(synthetic_store(folder, lengths, dcfg.hidden_size, dcfg.vocab_size,
                                               list(range(dcfg.num_aux_layers))))
        write_s = time.time() - t0
        packing.lengths = source.lengths
        variant = {"attention": "flex" if on_gpu else "sdpa", "chunk_tokens": None}
        torch._dynamo.reset()
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        mode = torch.device("cuda") if on_gpu else contextlib.nullcontext()
        objective, optimizer, params, batch, _ = bm.build(dcfg, tc, variant, 1, 128, None, mode, precision,
                                                          device=dev.type)
        objective.to(dev)
        # the run's shapes, as the train stage gives them: every flex call padded to its rows and length buckets
        shape = flex_shape(tc)
        objective.flex_shape = shape if variant["attention"] == "flex" else None
        del batch, _
        graphs0, flex0 = dynamo_graphs(), len(FLEX_GRAPHS)
        shapes, tokens, timed_tokens, timed_s, tail = set(), 0, 0, 0.0, False
        with unfused_flex_is_an_error():
            step = 0
            for epoch in range(2):
                for rows in packing.plan(epoch):
                    b = source.batch(rows, packing.row_len).to(dev, act)
                    shapes.add(tuple(b.input_ids.shape))
                    tail |= len(rows) == 1
                    if on_gpu:
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    bm.train_step(objective, optimizer, params, b, tc, precision)
                    if on_gpu:
                        torch.cuda.synchronize()
                    if step >= 2:  # after the first compiles
                        timed_s += time.perf_counter() - t
                        timed_tokens += b.tokens
                    tokens += b.tokens
                    step += 1
        graphs, flex_graphs = dynamo_graphs() - graphs0, len(FLEX_GRAPHS) - flex0
        limit = shape.graph_bound  # Dynamo's recompile limit while flex runs (model/ttt.py run_flex)
        row = {"drafter": name, "attention": dcfg.attention, "hidden": dcfg.hidden_size, "steps": step,
               "shapes": len(shapes), "graphs": graphs, "flex_graphs": flex_graphs, "flex_bound": limit,
               "store_write_s": round(write_s, 1)}
        what = f"{name} drafter ({dcfg.attention}, hidden {dcfg.hidden_size})"
        checks.add(f"soak {what}: varying rows and a one-row tail", tail and len(shapes) >= 4,
                   f"{step} micro-batches of {len(shapes)} shapes ({min(s[1] for s in shapes)}-"
                   f"{max(s[1] for s in shapes)} tokens a row), a one-row micro-batch: {tail}; "
                   f"no unfused flex warning")
        checks.add(f"soak {what}: bounded compiles", flex_graphs <= limit,
                   f"{flex_graphs} flex graph(s) ({graphs} by Dynamo in all) for {len(shapes)} shapes x "
                   f"{tc.ttt_steps} TTT steps (the run's bound {limit}, draftsmith.model.ttt.FlexShape)"
                   + ("" if on_gpu else "; cpu: sdpa, flex has no backward here"))
        if on_gpu:
            real = torch.cuda.max_memory_allocated()
            row.update(peak=real, estimate=est_mem, ratio=real / est_mem)
            checks.add(f"soak {what}: peak memory", abs(real / est_mem - 1) <= MEMORY_TOLERANCE,
                       f"max_memory_allocated {real / 1e9:.2f} GB, estimate.train_memory {est_mem / 1e9:.2f} GB "
                       f"(ratio {real / est_mem:.3f}, tolerance {MEMORY_TOLERANCE:.0%})")
        else:
            row.update(estimate=est_mem)
            checks.add(f"soak {what}: peak memory (cpu: no device counter)", est_mem > 0,
                       f"estimate.train_memory {est_mem / 1e6:.1f} MB at toy widths; nothing to hold it against here")
        rate = timed_tokens / timed_s if timed_s else 0.0
        row.update(tokens_per_s=rate, estimate_tokens_per_s=est_rate, rate_ratio=rate / est_rate)
        floor = RATE_FLOOR if on_gpu else 0.0
        checks.add(f"soak {what}: tokens/s", rate > 0 and rate / est_rate >= floor,
                   f"{rate:,.0f} tokens/s after the first 2 steps, estimate {est_rate:,.0f} "
                   f"(ratio {rate / est_rate:.2f}; floor {floor:g})")
        figures["drafters"].append(row)
        del objective, optimizer, params, b  # before the next drafter's peak is measured
        gc.collect()
        shutil.rmtree(folder, ignore_errors=True)
    return figures


# -------------------------------------------------------------------------------------------------
# ranks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_ranks(run: Path, world: int, sets: list[str], log: Path) -> int:
    """`python -m draftsmith train --run RUN` as `world` ranks of one group, each with LOCAL_RANK 0 (so on a GPU
    node every rank takes GPU 0, where NCCL allows two ranks on one GPU); the exit status of the worst."""
    port = free_port()
    procs = []
    with open(log, "a") as f:
        for r in range(world):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "draftsmith", "train", "--run", str(run), "--config",
                   str(REPO / "configs" / "demo.yaml"), *(a for s in sets for a in ("--set", s))]
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=300) for p in procs]
    return max(codes, key=abs)


def losses(run: Path) -> list[float]:
    """The loss of each logged window (train/metrics.jsonl)."""
    f = run / "train" / "metrics.jsonl"
    return [json.loads(x)["loss"] for x in f.read_text().splitlines() if '"loss"' in x] if f.is_file() else []


def weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "train" / "final" / "model.safetensors"))


def nccl_two_on_one_gpu(work: Path) -> str | None:
    """None when NCCL runs an all-reduce between 2 ranks on GPU 0, else why not (one line)."""
    code = ("import os, torch, torch.distributed as d; torch.cuda.set_device(0); "
            "d.init_process_group('nccl', device_id=torch.device('cuda', 0)); t = torch.ones(1, device='cuda'); "
            "d.all_reduce(t); assert t.item() == 2; d.destroy_process_group()")
    port, procs = free_port(), []
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=25)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return "2 NCCL ranks on GPU 0 hung for 25 s"
    if all(p.returncode == 0 for p in procs):
        return None
    last = [ln for o in outs for ln in o.splitlines() if "Error" in ln or "error" in ln]
    return (last[-1] if last else "exit " + ",".join(str(p.returncode) for p in procs))[:300]


def ranks(out: Path, work: Path, checks) -> dict:
    """DDP and FSDP2 through a real process group on the pipeline part's run (its prepare, vocab and extract):
    an uninterrupted run of 4 steps against one cut after step 2's checkpoint and resumed."""
    base = work / "run"
    if not (base / "extract" / "meta.json").is_file():
        checks.add("ranks", False, f"no extracted run at {base}: the pipeline part must run first")
        return {}
    pipeline_sets = json.loads((work / "pipeline-sets.json").read_text())
    world = 2
    if gpu():
        why = nccl_two_on_one_gpu(work)
        checks.add("NCCL: 2 ranks on one GPU", True, "allowed" if why is None else
                   f"refused ({why}); the stage runs as 1 rank on NCCL here, 2 ranks run in the CPU rehearsal")
        world = 2 if why is None else 1
    figures = {"world": world, "runs": {}}
    for fsdp in (False, True):
        name = "fsdp" if fsdp else "ddp"
        sets = pipeline_sets + [f"train.fsdp={str(fsdp).lower()}", "train.max_steps=4", "train.checkpoint_every=2",
                "train.log_every_s=0.001", "train.processes=1", "train.max_minutes=null", "train.epochs=1",
                                # SDPA: what is checked is the group, the wrap and the resume; six flex compiles
                                # (~30 s each) would not fit the part's minute (the soak compiles flex)
                                "train.attention=sdpa"]
        full, cut = work / f"{name}-full", work / f"{name}-cut"
        for d in (full, cut):
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(base, d, ignore=shutil.ignore_patterns("train", "export", "eval"))
        log = out / f"ranks-{name}.log"
        log.write_text("")
        rc = train_ranks(full, world, sets, log)
        ckpt = cut / "train" / "checkpoints" / "step_2"
        rc_cut = train_ranks(cut, world, sets + ["train.max_steps=2"], log) if rc == 0 else None
        if rc_cut == 0:  # as if killed after step 2's checkpoint: the finished run's traces removed
            shutil.rmtree(cut / "train" / "final", ignore_errors=True)
            (cut / "train" / "manifest.json").unlink(missing_ok=True)
        rc_resume = train_ranks(cut, world, sets, log) if rc_cut == 0 else None
        text = log.read_text(errors="replace")
        resumed = f"resumed from {ckpt}" in text
        a, b = losses(full), losses(cut)
        same_loss = bool(a) and a[-1] == b[-1] if b else False
        same_w = False
        if rc_resume == 0:
            wa, wb = weights(full), weights(cut)
            same_w = wa.keys() == wb.keys() and all(bool((wa[k] == wb[k]).all()) for k in wa)
        figures["runs"][name] = {"exit": [rc, rc_cut, rc_resume], "losses": a, "resumed_losses": b}
        tail = "" if rc == 0 and rc_cut == 0 and rc_resume == 0 else f"; last line: {text.strip().splitlines()[-1:]}"
        how = (f"{name.upper()} on {world} ranks, {'nccl' if gpu() else 'gloo'}" if world > 1
               else f"train.fsdp={str(fsdp).lower()} on 1 rank (no process group, nothing wrapped)")
        checks.add(f"{how}: save and resume",
                   rc_resume == 0 and resumed and same_loss and same_w,
                   f"exits {rc}, {rc_cut}, {rc_resume}; resumed from step 2: {resumed}; last loss "
                   f"{a[-1] if a else None} uninterrupted, {b[-1] if b else None} resumed; final weights equal: "
                   f"{same_w}" + tail[:300])
    return figures


# -------------------------------------------------------------------------------------------------
# extract


class SyntheticExtractServer:
    """Answers like `vllm serve` with the extract_hidden_states method and a hidden-states connector: /v1/models, and
    per completion a connector file (hidden_states [L, A+1, H] bf16, token_ids [L]) in `staging` (/dev/shm), named in
    kv_transfer_params.hidden_states_path. The files are hard links of one written per distinct prompt beforehand,
    so what is timed is the client's side, not this server's writing."""

    def __init__(self, staging: Path, prompts: dict[tuple, Path]):
        self.staging, self.prompts, self.n = staging, prompts, 0
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _send(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send({"object": "list", "data": [{"id": "synthetic", "max_model_len": 1 << 20}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer._lock:
                    outer.n += 1
                    path = outer.staging / f"req-{outer.n}.safetensors"
                os.link(outer.prompts[tuple(body["prompt"][:8])], path)
                self._send({"id": f"cmpl-{outer.n}", "object": "text_completion", "model": body["model"],
                            "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                            "kv_transfer_params": {"hidden_states_path": str(path)}})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def extract_target(folder: Path, hidden: int, layers: int) -> Path:
    """A Llama config at `hidden` with the final norm's weight and stand-ins for the names that mark a language model:
    what the vLLM backend's host side reads of the target (its config and FinalNorm)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    hf = dict(target_dict("llama-8b-1xh100.yaml"))
    hf.update(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 128,
              num_key_value_heads=8, head_dim=128)
    (folder / "config.json").write_text(json.dumps(hf))
    # the names by which draftsmith finds the language model (target.language_model_names); only the norm is read
    save_file({"model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
               "model.embed_tokens.weight": torch.zeros(1, dtype=torch.bfloat16),
               "model.layers.0.input_layernorm.weight": torch.zeros(1, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(1, dtype=torch.bfloat16)},
              str(folder / "model.safetensors"))
    return folder


def extract(out: Path, work: Path, checks) -> dict:
    """run_extract with extract.backend=vllm against SyntheticExtractServer: samples/s of the host side."""
    import torch
    from safetensors.torch import save_file

    from draftsmith.config import load_config
    from draftsmith.extract.stage import run_extract
    from draftsmith.extract.store import ExtractStore
    from draftsmith.extract.vllm_backend import server_layer_ids
    from draftsmith.rundir import RunDir
    from draftsmith.target import target_info

    sys.path.insert(0, str(REPO / "tests"))
    from test_extract import write_prepare

    on_gpu = gpu()
    # Kimi-K2.5's width (7,168: its recipe extracts with vLLM), 61 layers; the CPU: a toy width
    hidden, n_layers, samples, distinct, length = (7168, 61, 64, 6, 1024) if on_gpu else (256, 8, 24, 4, 128)
    target = extract_target(work / "extract-target", hidden, n_layers)
    info = target_info(str(target))
    layers = info.default_aux_layers()
    ids_of = server_layer_ids(layers, n_layers)
    need = 2 * distinct * length * (len(layers) + 1) * hidden * 2  # the templates' bytes, twice over
    shm = Path("/dev/shm")
    if not shm.is_dir() or shutil.disk_usage(shm).free < need:  # a container's /dev/shm can be 64 MB
        shm = Path(tempfile.gettempdir())
        print(f"extract: /dev/shm lacks {need / 1e9:.1f} GB; the connector files go to {shm}", flush=True)
    staging = Path(tempfile.mkdtemp(prefix="draftsmith-device-check-", dir=shm))
    g = torch.Generator().manual_seed(0)
    prompts, recs = {}, []
    try:
        for k in range(distinct):  # lengths from a quarter to 1.75x `length`
            n = length // 4 + (k * 3 * length // 2) // max(1, distinct - 1)
            ids = [1000 + k] + torch.randint(3, 32000, (n - 1,), generator=g).tolist()
            hs = torch.randn(n, len(layers) + 1, hidden, generator=g).to(torch.bfloat16)
            f = staging / f"template-{k}.safetensors"
            save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(f),
                      metadata={"layers": json.dumps(ids_of)})
            prompts[tuple(ids[:8])] = f
            recs.append(ids)
        sample_list = [{"id": f"s{i}", "input_ids": recs[i % distinct], "loss_mask": [1] * len(recs[i % distinct]),
                        "truncated": False} for i in range(samples)]
        run = RunDir(work / "extract-run")
        shutil.rmtree(run.path, ignore_errors=True)
        write_prepare(run, str(target), sample_list)
        server = SyntheticExtractServer(staging, prompts)
        try:
            cfg = load_config(None, [f"target={target}", "dtype=bfloat16", "extract.backend=vllm",
                                     f"extract.servers={json.dumps([server.url])}", "extract.store_format=fp8",
                                     "extract.shard_size=64", "extract.backoff_s=0"])
            t0 = time.time()
            m = run_extract(run, cfg)
            seconds = time.time() - t0
        finally:
            server.close()
        store = ExtractStore(run)
        tokens = sum(len(s["input_ids"]) for s in sample_list)
        # the threads the stage sized for this node (host.extract_threads), as its log says them
        sized = next((line[line.index("extraction host threads"):] for line in
                      (run.path / "extract" / "stage.log").read_text().splitlines()
                      if "extraction host threads" in line), "extraction host threads: not logged")
        ok = m is not None and m["counts"]["done"] == samples and len(store) == samples
        ok = ok and not any(p.name.startswith("req-") for p in staging.iterdir())
        rate = samples / seconds
        b = (len(layers) + 1) * hidden * 2 * tokens / seconds
        checks.add("extraction's host side (vllm backend, fp8 store)", ok,
                   f"{samples} samples ({tokens:,} tokens, hidden {hidden}, connector files in {shm}): {rate:.1f} "
                   f"samples/s, {tokens / seconds:,.0f} tokens/s, {b / 1e9:.2f} GB/s of connector files; "
                   f"{sized}", samples_per_s=rate, tokens_per_s=tokens / seconds)
        return {"samples_per_s": rate, "tokens_per_s": tokens / seconds, "hidden": hidden}
    finally:
        shutil.rmtree(staging, ignore_errors=True)
