"""Benchmark the two extract backends on the same samples in one run: `hf` (transformers forward in
this process) and `vllm` (a vLLM server with the extract_hidden_states method and draftsmith's
hidden-states connector).

    .venv/bin/python bench/bench_extract_vllm.py [--samples 48] [--max-length 1024] [--repeats 2] [--concurrency 16]

Target: SmolLM2-135M-Instruct. Data: the first --samples ShareGPT conversations rendered with the
target's chat template, cut to --max-length tokens (as bench_extract.py), written as
prepare/samples.jsonl. The hf backend runs in --dtype (default `auto`, as extract uses it); the
vllm backend against one server per --vllm-dtypes entry (default bfloat16, what `auto` gives that
backend, and float32), all started (one after the other) before the first run with `--enforce-eager` and kept up
(idle, one uses about 1% of a core), their start-up reported apart. The servers run with
`--no-enable-prefix-caching`: with vLLM's prefix cache a repeat would find every prompt cached and
skip the forward (measured: 13 s instead of 147 s), which says nothing about extraction speed.

Each repeat runs `run_extract` end to end for each backend into a fresh extract/ folder, hf then
each server (best repeat kept: the machine is shared), so all see the same load within minutes.
Tokens/s count real tokens. Wall seconds and CPU seconds are printed: for hf the process's CPU
time, for vllm this process's plus the server's whole process group (from /proc), i.e. all the
CPU the backend cost. Also printed: how far the two stores are apart (mean relative error per
layer), as a check that both did the same work.
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.extract.stage import run_extract  # noqa: E402
from draftsmith.extract.store import ExtractStore  # noqa: E402
from draftsmith.extract.vllm_backend import server_args, server_layer_ids  # noqa: E402
from draftsmith.rundir import RunDir  # noqa: E402
from draftsmith.target import load_target  # noqa: E402
from draftsmith.vllm_server import VLLMServer, group_members, vllm_python  # noqa: E402

from bench_extract import sharegpt_samples, write_prepare  # noqa: E402


def group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) of the live processes of a process group."""
    total = 0
    for pid in group_members(pgid):
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(f[11]) + int(f[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=16, help="extract.concurrency of the vllm backend")
    ap.add_argument("--dtype", default="auto", help="Config `dtype` of the hf backend.")
    ap.add_argument("--vllm-dtypes", default="bfloat16,float32", help="One vLLM server per dtype (comma-separated).")
    ap.add_argument("--dir", default=None, help="Scratch folder (default: a temporary one, removed after).")
    args = ap.parse_args()

    uptime0 = Path("/proc/loadavg").read_text().split()[:3]
    target = load_target(args.target, dtype=args.dtype, log=lambda m: None)
    info = target.info
    samples = sharegpt_samples(target.tokenizer, args.samples, args.max_length)
    lengths = [len(s["input_ids"]) for s in samples]
    tokens = sum(lengths)
    layers = info.default_aux_layers()
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-extract-vllm-"))

    hf_sets = [f"target={args.target}", f"dtype={args.dtype}"]
    servers: dict[str, VLLMServer] = {}
    for dt in args.vllm_dtypes.split(","):
        storage = scratch / f"server-states-{dt}"
        storage.mkdir(parents=True, exist_ok=True)
        sargs, env = server_args(server_layer_ids(layers, info.num_layers), storage, "draftsmith", dt,
                                 ["--enforce-eager", "--no-enable-prefix-caching"])
        servers[dt] = VLLMServer(info.path, extra_args=sargs, env=env, log_path=scratch / f"vllm-{dt}.log",
                                 python=vllm_python(), max_model_len=max(lengths) + 1)
    backends = {"hf": (hf_sets, None)}
    results: dict[str, list[tuple[float, float]]] = {}
    runs: dict[str, RunDir] = {}
    try:
        for srv in servers.values():
            srv.start()
        startup = ", ".join(f"{dt} in {srv.startup_s:.0f}s" for dt, srv in servers.items())
        for dt, srv in servers.items():
            backends[f"vllm {dt}"] = ([f"target={args.target}", f"dtype={dt}", "extract.backend=vllm",
                                       f"extract.concurrency={args.concurrency}", f"extract.servers=[{srv.base_url}]"], srv)
        for r in range(args.repeats):
            for name, (sets, srv) in backends.items():
                run = RunDir(scratch / f"{name.replace(' ', '-')}-{r}")
                shutil.rmtree(run.path, ignore_errors=True)
                write_prepare(run, info, samples)
                cfg = load_config(None, sets)
                w0, c0 = time.perf_counter(), time.process_time()
                s0 = group_cpu_s(srv.pid) if srv else 0.0
                m = run_extract(run, cfg, target=target if srv is None else None)
                wall = time.perf_counter() - w0
                cpu = time.process_time() - c0 + (group_cpu_s(srv.pid) - s0 if srv else 0.0)
                assert m is not None and m["counts"]["done"] == len(samples)
                results.setdefault(name, []).append((wall, cpu))
                runs[name] = run
    finally:
        for srv in servers.values():
            srv.stop()
    uptime1 = Path("/proc/loadavg").read_text().split()[:3]

    # how far apart the stores are (all should be the target's states at the same layers)
    sh = ExtractStore(runs["hf"])

    def rel(a, b):
        a, b = a.float(), b.float()
        return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).mean().item()

    print()
    print(f"extract backends: {info.name}, {len(samples)} ShareGPT samples, {tokens:,} tokens (mean {tokens / len(samples):.0f}, "
          f"max {max(lengths)}), layers {layers} + last; hf in {sh.meta['compute_dtype']} ({torch.get_num_threads()} threads); "
          f"vllm servers --enforce-eager --no-enable-prefix-caching, concurrency {args.concurrency}, started ({startup}) "
          f"(not counted); best of {args.repeats}; load average (1/5/15 min) before {'/'.join(uptime0)}, after "
          f"{'/'.join(uptime1)} on {os.cpu_count()} cores")
    print()
    print("| backend | wall s | tokens/s (wall) | CPU s (all processes) | tokens per CPU-second | mean rel. error vs hf [2, 15, 27, last] |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    best = {}
    for name in backends:
        wall, cpu = min(x[0] for x in results[name]), min(x[1] for x in results[name])
        best[name] = (wall, cpu)
        err = ""
        if name != "hf":
            sv = ExtractStore(runs[name])
            e = torch.tensor([[rel(sv[i]["aux_hidden"][:, j], sh[i]["aux_hidden"][:, j]) for j in range(len(layers))]
                              + [rel(sv[i]["last_hidden"], sh[i]["last_hidden"])] for i in range(len(samples))]).mean(0)
            err = ", ".join(f"{x:.4f}" for x in e.tolist())
        print(f"| {name} | {wall:.1f} | {tokens / wall:,.0f} | {cpu:.1f} | {tokens / cpu:,.0f} | {err} |")
    print()
    for name in backends:
        if name != "hf":
            print(f"{name} vs hf: {best['hf'][0] / best[name][0]:.2f}x tokens/s (wall), "
                  f"{best['hf'][1] / best[name][1]:.2f}x tokens per CPU-second")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
