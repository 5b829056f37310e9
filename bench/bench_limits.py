"""Each stage beside its own ceiling, in one run on one machine (issue 42).

    .venv/bin/python bench/bench_limits.py [--limit 400] [--repeats 3] [--parts generate,extract,train,store,status]
        [--set generate.concurrency=32 ...] [--out DIR]

Data: the prompts of configs/smollm2-cpu-e2e.yaml (the 400-prompt recipe: ShareGPT first turns of 8-2,000
characters), the first --limit of them, one greedy answer each (the recipe's second, sampled answer would double
every pass; the ceiling is the same engine on the same requests). --set adds config overrides to draftsmith's side
(e.g. the settings the generate gap was chased with).

generate, --repeats passes, the three sides in a rotating order so that a drift in the machine's load hits each
alike; tokens/s of output tokens over each side's request loop, server start-up and model load left out of all:
  draftsmith  `run_generate` with the recipe's backend vllm (its own server, its settings): the stage's generation
              seconds (wall less the server's start-up); its requests in flight and its server's preemptions.
  peer        speculators' `regenerate-responses` against its own server, as bench/peer/peer_pipeline.py runs it
              (32 in flight), over the request loop it times itself (needs bench/peer/setup_peer.sh); its server
              in draftsmith's dtype unless --peer-dtype (the peer's default is bfloat16, which a CPU without
              AVX512-BF16 or AMX decodes several times slower: the same dtype compares the clients and settings).
  vLLM        offline `LLM.chat` on the same prompts, dtype, context and KV cache as draftsmith's server
              (bench/limits_vllm_offline.py in the vLLM environment): the engine scheduling every request itself.
extract, on the answers of draftsmith's first generate pass (prepared by `run_prepare`), --repeats passes:
  vllm        `run_extract` (backend vllm, the recipe's settings: its own server with the hidden-states connector)
              over its extraction loop's seconds as the stage logs them (its server's start-up and the connector
              check apart), against a bare prefill of the same token ids in offline vLLM (same dtype and eager
              mode, one output token, prefix cache off; its load apart), and against the same through a plain
              server (the extract server's dtype and flags without the hidden-states method and connector, prefix
              cache off, extract.concurrency requests in flight, /v1/completions on the token ids, after one
              untimed pass).
  hf          `run_extract` (backend hf, the target loaded once outside both) over its extraction loop against
              the bare `model.model(...)` forward (no LM head, no hooks) over the batches extract plans, alternating.
train     one training step of the recipe's drafter (bench_train_flops.step_profile: one rank, one thread, a
          1,024-token row) against its matrix products' FLOPs at the best rate this machine's bare float32
          products reach (bench_train_flops.bare_matmul): the share of the step a perfect kernel would need.
store     the store's writer (bf16, at Llama-3.1-8B's width) against a raw sequential write of the same bytes with
          an fsync (bench_store.raw_write / writer_write), alternating.
status    `draftsmith status --json` on a run of 10,000 sample files (bench_status.build_run) against
          `ls rows_*/ | wc -l` over the same shards, each a fresh process; beside them the floor of any Python
          command, `python -c 'import draftsmith.status'`.

Printed: a line per measurement as it ends, then the table of ratios; OUT/limits.json keeps every figure.
"""

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE), str(HERE / "peer")]

from draftsmith.config import load_config  # noqa: E402
from draftsmith.extract.hf import make_batch, plan_batches  # noqa: E402
from draftsmith.extract.stage import run_extract  # noqa: E402
from draftsmith.extract.vllm_backend import server_dtype  # noqa: E402
from draftsmith.generate.vllm import served_dtype  # noqa: E402
from draftsmith.generate.stage import run_generate  # noqa: E402
from draftsmith.prepare import run_prepare  # noqa: E402
from draftsmith.prompts import context_tokens_needed, load_prompts  # noqa: E402
from draftsmith.rundir import RunDir  # noqa: E402
from draftsmith.target import load_target, load_tokenizer, target_info  # noqa: E402
from draftsmith.vllm_server import (VLLMServer, context_limit, cpu_kv_cache_bytes, max_model_len,  # noqa: E402
                                    server_env)
from draftsmith.vllm_server import vllm_python  # noqa: E402

RECIPE = ROOT / "configs" / "smollm2-cpu-e2e.yaml"
OFFLINE = HERE / "limits_vllm_offline.py"


def say(msg: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {msg}", flush=True)


def machine() -> str:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    fast = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f" {f}" in flags]
    return f"{model}, {os.cpu_count()} cores ({', '.join(fast)}), load average {os.getloadavg()[0]:.1f}"


def spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3g} (min {min(xs):.3g}, max {max(xs):.3g}, n {len(xs)})"


def offline(job: dict, work: Path) -> dict:
    """limits_vllm_offline.py's JSON for `job`, run in the vLLM environment with the servers' KV cache."""
    path = work / "offline-job.json"
    path.write_text(json.dumps(job))
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cpu_kv_cache_bytes() >> 30 or 1), **server_env()}  # the servers' size
    p = subprocess.run([str(vllm_python()), str(OFFLINE), str(path)], capture_output=True, text=True, env=env)
    (work / "offline.log").open("a").write(p.stdout + p.stderr)
    if p.returncode != 0:
        sys.exit(f"bench_limits: offline vLLM failed ({p.returncode}); see {work / 'offline.log'}")
    # vLLM prints to stdout too (at shutdown): the answer is the line limits_vllm_offline.py wrote
    return json.loads(next(ln for ln in reversed(p.stdout.splitlines()) if ln.startswith('{"requests"')))


# -------------------------------------------------------------------------------------------------
# generate


def generate_part(args, work: Path, res: dict) -> Path:
    cfg0 = load_config(str(RECIPE), [])
    g = cfg0.generate
    prompts = load_prompts(g.prompts, limit=args.limit, first_turn_only=g.first_turn_only, min_chars=g.min_chars,
                           max_chars=g.max_chars, skip_invalid=g.skip_invalid)
    pfile = work / "prompts.jsonl"
    pfile.write_text("".join(json.dumps({"id": p.id, "messages": p.first_turn_messages()}) + "\n" for p in prompts))
    cfg = load_config(str(RECIPE), [f"generate.prompts={pfile}", f"generate.limit={len(prompts)}",
                                    "generate.answers_per_prompt=1", "generate.first_turn_only=false", *args.set])
    info = target_info(cfg.target)
    needed = context_tokens_needed(prompts, load_tokenizer(info), cfg.generate.max_tokens, limit=context_limit(info.path))
    job = {"model": str(info.path), "dtype": served_dtype(cfg), "max_model_len": max_model_len(info.path, needed),
           "mode": "chat", "max_tokens": cfg.generate.max_tokens, "repeats": 1,
           "messages": [p.first_turn_messages() for p in prompts]}
    peer_python = ROOT / ".venv-peer" / "bin" / "python"
    say(f"generate: {len(prompts)} prompts, max_tokens {cfg.generate.max_tokens}, greedy; draftsmith: concurrency "
        f"{cfg.generate.concurrency}, {job['dtype']}, {' '.join(cfg.generate.vllm_args) or 'no extra server flags'}"
        f"{'; peer: not installed (bench/peer/setup_peer.sh), left out' if not peer_python.exists() else ''}")
    first_run = None
    rows: dict[str, list] = {}

    def ours(i: int) -> tuple[int, float, dict]:
        nonlocal first_run
        run = RunDir(work / f"generate-{i}")
        m = run_generate(run, cfg)
        first_run = first_run or run
        return m["counts"]["completion_tokens"], m["summary"]["seconds"], {
            k: m["summary"][k] for k in ("in_flight", "preemptions")}

    def peer(i: int) -> tuple[int, float, dict]:
        from peer_pipeline import Pipeline, parse_args, write_prompts  # only with the peer installed

        a = parse_args(["--prompts", str(pfile), "--out", str(work / f"peer-{i}"), "--train-minutes", "1",
                        "--max-tokens", str(cfg.generate.max_tokens), "--dtype", args.peer_dtype or job["dtype"]])
        a.out.mkdir(parents=True)
        p = Pipeline(a)
        p.report["prompts"] = write_prompts(a.prompts, a.out / "prompts.jsonl", None)
        p.regenerate()
        r = p.report["stages"]["regenerate"]
        return r["tokens"], r["generation_s"], {}

    def vllm_offline(i: int) -> tuple[int, float, dict]:
        out = offline(job, work)
        return out["output_tokens"], out["seconds"][0], {"load_s": out["load_s"]}

    sides = [("draftsmith", ours), ("vLLM offline", vllm_offline)] + ([("peer", peer)] if peer_python.exists() else [])
    for i in range(args.repeats):
        for name, fn in sides[i % len(sides):] + sides[:i % len(sides)]:
            tokens, secs, extra = fn(i)
            rows.setdefault(name, []).append({"tokens": tokens, "seconds": secs, **extra})
            say(f"generate pass {i + 1} {name:<12} {tokens:7,d} tokens {secs:7.1f} s {tokens / secs:7.1f} tokens/s "
                f"{json.dumps(extra) if extra else ''}")
    rate = {k: [r["tokens"] / r["seconds"] for r in v] for k, v in rows.items()}
    res["generate"] = {"prompts": len(prompts), "settings": args.set, "passes": rows}
    for other in ("vLLM offline", "peer"):
        if other in rate:
            paired = [a / b for a, b in zip(rate["draftsmith"], rate[other])]
            res["generate"][f"ratio to {other}"] = paired
            say(f"generate: draftsmith / {other} = {spread(paired)}")
    return first_run.path


# -------------------------------------------------------------------------------------------------
# extract


def server_prefill(cfg, token_ids: list[list[int]], work: Path) -> tuple[int, float]:
    """(prompt tokens, seconds): a plain vLLM server in the extract server's dtype and flags (no hidden-states
    method, no connector, prefix cache off) asked for one token after each prompt, extract.concurrency at a time:
    the same engine's bare prefill, served."""
    info = target_info(cfg.target)
    srv = VLLMServer(info.path, extra_args=["--dtype", server_dtype(cfg), *cfg.extract.vllm_args,
                                            "--no-enable-prefix-caching"],
                     max_model_len=max(map(len, token_ids)) + 1, log_path=work / "prefill-server.log", say=say)
    with srv:
        model = srv.models()[0]

        async def ask() -> int:
            sem = asyncio.Semaphore(cfg.extract.concurrency)
            async with httpx.AsyncClient(timeout=600) as client:
                async def one(ids: list[int]) -> int:
                    async with sem:
                        r = await client.post(srv.base_url + "/completions",
                                              json={"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0})
                        r.raise_for_status()
                        return r.json()["usage"]["prompt_tokens"]
                return sum(await asyncio.gather(*(one(ids) for ids in token_ids)))

        asyncio.run(ask())  # warm-up: the same requests once (no prefix cache, so the timed pass computes them all)
        t = time.perf_counter()
        tokens = asyncio.run(ask())
        return tokens, time.perf_counter() - t


def extract_part(args, work: Path, run_path: Path, res: dict) -> None:
    run = RunDir(run_path)
    cfg = load_config(str(RECIPE), [])
    run_prepare(run, cfg)
    samples = [json.loads(ln) for ln in (run.stage_dir("prepare") / "samples.jsonl").open()]
    lengths = [len(s["input_ids"]) for s in samples]
    tokens = sum(lengths)
    info = target_info(cfg.target)
    say(f"extract: {len(samples)} samples, {tokens:,} tokens (longest {max(lengths)})")
    job = {"model": str(info.path), "dtype": server_dtype(cfg), "max_model_len": max(lengths) + 1,
           "enforce_eager": "--enforce-eager" in cfg.extract.vllm_args, "mode": "prefill", "repeats": 1,
           "token_ids": [s["input_ids"] for s in samples]}
    out: dict[str, list] = {}
    fixed: list[float] = []

    def extract(overrides: list[str], target=None) -> tuple[float, float]:
        """(seconds of the stage's extraction loop, as its log states them, seconds of the whole stage)"""
        shutil.rmtree(run.stage_dir("extract"), ignore_errors=True)
        t = time.perf_counter()
        run_extract(run, load_config(str(RECIPE), overrides), target=target)
        whole = time.perf_counter() - t
        said = re.findall(r"extracted \d+ samples, [\d,]+ tokens in ([0-9.]+)s",
                          (run.stage_dir("extract") / "stage.log").read_text())
        return float(said[-1]), whole

    for i in range(args.repeats):
        secs, whole = extract(["extract.backend=vllm"])
        fixed.append(whole - secs)
        pre = offline(job, work)
        out.setdefault("vllm", []).append(tokens / secs)
        out.setdefault("vllm bare prefill", []).append(pre["prompt_tokens"] / pre["seconds"][0])
        n, secs_served = server_prefill(cfg, job["token_ids"], work)
        out.setdefault("vllm bare prefill, served", []).append(n / secs_served)
        say(f"extract pass {i + 1}: vllm backend {tokens / secs:,.0f} tokens/s over its extraction loop (the stage "
            f"{whole:.0f} s, {whole - secs:.0f} s of it the server's start-up and the connector check); bare prefill "
            f"in offline vLLM {out['vllm bare prefill'][-1]:,.0f} tokens/s (load {pre['load_s']:.0f} s), through a "
            f"plain server {out['vllm bare prefill, served'][-1]:,.0f} tokens/s")

    hf_cfg = load_config(str(RECIPE), ["extract.backend=hf"])
    target = load_target(cfg.target, dtype=hf_cfg.dtype, log=lambda m: None)
    batches = plan_batches(list(range(len(samples))), lengths, hf_cfg.extract.batch_tokens)
    with torch.inference_mode():  # warm-up: kernel selection, allocator
        ids, pos = make_batch([samples[j] for j in batches[-1]])
        target.model.model(input_ids=ids, position_ids=pos, use_cache=False)
    for i in range(args.repeats):
        t = time.perf_counter()
        with torch.inference_mode():
            for b in batches:
                ids, pos = make_batch([samples[j] for j in b])
                target.model.model(input_ids=ids, position_ids=pos, use_cache=False)
        bare = time.perf_counter() - t
        secs, _ = extract(["extract.backend=hf"], target=target)
        out.setdefault("hf", []).append(tokens / secs)
        out.setdefault("hf bare forward", []).append(tokens / bare)
        say(f"extract pass {i + 1}: hf backend {tokens / secs:,.0f} tokens/s; bare model.model forward "
            f"{tokens / bare:,.0f} tokens/s")
    res["extract"] = {"samples": len(samples), "tokens": tokens, "tokens_per_s": out, "vllm_fixed_s": fixed,
                      "ratio vllm": [a / b for a, b in zip(out["vllm"], out["vllm bare prefill"])],
                      "ratio vllm served": [a / b for a, b in zip(out["vllm"], out["vllm bare prefill, served"])],
                      "ratio hf": [a / b for a, b in zip(out["hf"], out["hf bare forward"])]}
    say(f"extract: vllm / bare prefill = {spread(res['extract']['ratio vllm'])}; hf / bare forward = "
        f"{spread(res['extract']['ratio hf'])}")


# -------------------------------------------------------------------------------------------------
# train, store, status


def train_part(args, res: dict) -> None:
    import bench_train_flops as tf

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the recipe's ranks run one thread each
    try:
        s = tf.step_profile(1024, 288, 3)
        peak = max(tf.bare_matmul(m, k, n, torch.float32, 10) for m, k, n in
                   ((1024, tf.H, tf.DRAFT_VOCAB), (1024, tf.H, tf.MLP), (1024, tf.MLP, tf.H), (tf.DRAFT_VOCAB, 1024, tf.H)))
    finally:
        torch.set_num_threads(threads)
    ideal_s = s["mm_gflop_per_step"] / peak
    res["train"] = {**s, "peak_gflops": peak, "ideal_s": ideal_s, "ratio": ideal_s / s["step_s"]}
    say(f"train: step {s['step_s']:.2f} s ({s['tokens_per_s']:,.0f} tokens/s, one thread); its products "
        f"{s['mm_gflop_per_step']:.0f} GFLOP at the best bare rate {peak:.0f} GFLOP/s would take {ideal_s:.2f} s; "
        f"products {s['mm_share']:.0%} of the step at {s['mm_gflops']:.0f} GFLOP/s")


def store_part(args, work: Path, res: dict) -> None:
    import bench_store as bs
    from draftsmith.extract import store

    length, per_batch, H = 512, 16, 4096
    num = max(2, int(0.25 * (1 << 30) / (store.bytes_per_token(3, H) * length)))
    plan = bs.batches(num, length, per_batch, 1000)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(per_batch, length, 3, H, generator=g).to(torch.bfloat16)
    last = torch.randn(per_batch, length, H, generator=g).to(torch.bfloat16)
    nbytes = num * (store.bytes_per_token(3, H) * length + 256)
    buf = aux.reshape(-1).view(torch.uint8).numpy()[: 8 << 20]
    ratios, raw_gbs, w_gbs = [], [], []
    for _ in range(args.repeats):
        rt, rb, _ = bs.raw_write(work / "raw", nbytes, buf)
        wt, wb, _ = bs.writer_write(work / "w", plan, aux, last, length, 4, "bf16", 1000)
        raw_gbs.append(rb / rt / 1e9)
        w_gbs.append(wb / wt / 1e9)
        ratios.append(w_gbs[-1] / raw_gbs[-1])
    res["store"] = {"raw_gbs": raw_gbs, "writer_gbs": w_gbs, "ratio": ratios, "bytes": nbytes}
    say(f"store: writer {spread(w_gbs)} GB/s, raw disk {spread(raw_gbs)} GB/s; ratio {spread(ratios)}")


def status_part(args, work: Path, res: dict) -> None:
    import bench_status as bst

    run = bst.build_run(work / "status", 10_000)
    cli, ls, floor = [], [], []
    for _ in range(max(5, args.repeats)):
        t = time.perf_counter()  # the floor of any Python command: the interpreter and draftsmith's imports
        subprocess.run([sys.executable, "-c", "import draftsmith.status"], check=True)
        floor.append(time.perf_counter() - t)
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "draftsmith", "status", str(run.path), "--json"],
                           capture_output=True, text=True)
        cli.append(time.perf_counter() - t)
        assert p.returncode == 0, p.stderr
        t = time.perf_counter()
        q = subprocess.run(f"ls {run.path}/extract/rows_*/ | wc -l", shell=True, capture_output=True, text=True)
        ls.append(time.perf_counter() - t)
        assert int(q.stdout) >= 10_000, q.stdout
    res["status"] = {"status_s": cli, "ls_s": ls, "import_s": floor, "ratio": [b / a for a, b in zip(cli, ls)]}
    say(f"status: draftsmith status --json {spread(cli)} s; ls | wc -l {spread(ls)} s; python -c 'import "
        f"draftsmith.status' {spread(floor)} s")


# -------------------------------------------------------------------------------------------------


def cell(r: list[float]) -> str:
    """A ratio's median and range over the passes."""
    return f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})"


def table(res: dict) -> None:
    med = statistics.median
    print("\n| stage | draftsmith | ceiling | ratio (median, min-max) |")
    print("| --- | --- | --- | --- |")
    if "generate" in res:
        g = res["generate"]
        rate = {k: [r["tokens"] / r["seconds"] for r in v] for k, v in g["passes"].items()}
        for other in ("vLLM offline", "peer"):
            if f"ratio to {other}" in g:
                r = g[f"ratio to {other}"]
                print(f"| generate | {med(rate['draftsmith']):.0f} tokens/s | {other} {med(rate[other]):.0f} tokens/s "
                      f"| {cell(r)} |")
    if "extract" in res:
        e = res["extract"]
        for k, ceil, r in (("vllm", "vllm bare prefill", "vllm"), ("vllm", "vllm bare prefill, served", "vllm served"),
                           ("hf", "hf bare forward", "hf")):
            if ceil in e["tokens_per_s"]:
                print(f"| extract ({k}) | {med(e['tokens_per_s'][k]):,.0f} tokens/s | {ceil} "
                      f"{med(e['tokens_per_s'][ceil]):,.0f} tokens/s | {cell(e[f'ratio {r}'])} |")
    if "train" in res:
        t = res["train"]
        print(f"| train (one rank, one thread) | {t['step_s']:.2f} s a step | its products at {t['peak_gflops']:.0f} "
              f"GFLOP/s: {t['ideal_s']:.2f} s | {t['ratio']:.2f}x |")
    if "store" in res:
        s = res["store"]
        print(f"| store writes | {med(s['writer_gbs']):.2f} GB/s | raw disk {med(s['raw_gbs']):.2f} GB/s | "
              f"{cell(s['ratio'])} |")
    if "status" in res:
        s = res["status"]
        print(f"| status, 10k files | {med(s['status_s']):.3f} s | ls \\| wc -l {med(s['ls_s']):.3f} s | "
              f"{cell(s['ratio'])} |")
        print(f"| (status's floor) | python -c 'import draftsmith.status' {med(s['import_s']):.3f} s | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--limit", type=int, default=400, help="prompts of the recipe's selection (default all 400)")
    ap.add_argument("--repeats", type=int, default=3, help="passes per side")
    ap.add_argument("--parts", default="generate,extract,train,store,status")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for draftsmith's generate (repeatable)")
    ap.add_argument("--peer-dtype", default=None, help="the peer server's dtype (default: draftsmith's)")
    ap.add_argument("--out", type=Path, default=None,
                    help="keep the runs and limits.json here (default: a temporary folder keeping limits.json only)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if unknown := parts - {"generate", "extract", "train", "store", "status"}:
        sys.exit(f"bench_limits: unknown part(s) {', '.join(sorted(unknown))}")
    if "extract" in parts and "generate" not in parts:
        sys.exit("bench_limits: extract measures on generate's answers: --parts needs generate too")
    work = args.out or Path(tempfile.mkdtemp(prefix="bench-limits-"))
    work.mkdir(parents=True, exist_ok=True)
    res: dict = {"machine": machine(), "command": " ".join(sys.argv), "started": time.strftime("%Y-%m-%d %H:%M")}
    say(res["machine"])
    try:
        if "generate" in parts:
            run_path = generate_part(args, work, res)
            if "extract" in parts:
                extract_part(args, work, run_path, res)
        if "train" in parts:
            train_part(args, res)
        if "store" in parts:
            store_part(args, work, res)
        if "status" in parts:
            status_part(args, work, res)
    finally:
        res["load_after"] = os.getloadavg()[0]
        (work / "limits.json").write_text(json.dumps(res, indent=1))
    table(res)
    print(f"\nmachine: {res['machine']} -> {res['load_after']:.1f}; figures in {work / 'limits.json'}")
    if not args.out:  # the runs go, the figures stay
        for d in work.iterdir():
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
