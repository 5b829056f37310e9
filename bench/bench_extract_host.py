"""Extraction's host side (extract.backend=vllm) with today's thread sizes against host.extract_threads' (issue 55).

    .venv/bin/python bench/bench_extract_host.py [--hidden 4096] [--length 1024] [--samples 96] [--passes 3]
                                                [--concurrency 32] [--writers 4] [--dir /dev/shm]

What runs: `run_extract` as a user runs it with extract.servers pointing at device_parts.SyntheticExtractServer,
which answers each completion like vLLM with the extract_hidden_states method and draftsmith's connector: a
safetensors file in --dir (hidden_states [T, 4, H] bf16, token_ids [T], metadata `layers`), hard-linked from one
written beforehand per distinct prompt, so that the timed work is draftsmith's side: the fetch threads (HTTP, wait
on the file's lock, read, check ids/shape/dtype/isfinite, the final norm in float32) and the store's writers (fp8
quantisation, the safetensors layout, sha256, write, grouped fsync). The store goes to --dir too (tmpfs by
default: the disk is the estimate's other bound, not this one).

Two ways, alternating pass by pass (today first, then sized; a fresh run folder each pass), both with the
process's torch threads at every core (what the CLI's thread policy sets on an idle node before vLLM starts;
--today-threads N sets N instead, standing in on these cores for a bigger node's count):
  today:  that count in every fetch and writer thread, extract.concurrency fetch threads all reading and
          checking at once, extract.writers writers;
  sized:  host.extract_threads for this machine with --busy cores taken (default 0: an idle node, as the seed's
          was when its policy ran; a live reading here would count the other work sharing this machine, which
          comes and goes between passes) and no server of its own.
Each way's sizes replace vllm_backend.host_threads; the code path is otherwise the user's. --spinners N starts
N processes that keep a core busy each, as vLLM's API server, engine core and workers do, and tells the rule they
are the server's; their turns/s in each pass is how much CPU the extraction left them.
Printed: each pass's tokens/s and tokens per CPU-second of this process (all its threads, the synthetic
server's included), then per way the median (min, max) and the ratio sized/today of each pair, with the CPU
model, its flags and the load average before and after. On a machine shared with other work, tokens/s also
measures how much of the cores a way takes from the others (more threads, a bigger share: on a GPU node the
others are vLLM's own processes); tokens per CPU-second is what the host work costs. Compare ratios measured
side by side, not the absolute figures of another machine.
"""

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

from bench_limits import machine, spread  # noqa: E402  (bench/ is scripts, not a package)
from device_parts import SyntheticExtractServer, extract_target  # noqa: E402
from test_extract import write_prepare  # noqa: E402

from draftsmith.config import load_config  # noqa: E402
from draftsmith.extract import vllm_backend  # noqa: E402
from draftsmith.extract.stage import run_extract  # noqa: E402
from draftsmith.host import ExtractThreads, extract_threads, usable_cores  # noqa: E402
from draftsmith.rundir import RunDir  # noqa: E402
from draftsmith.target import target_info  # noqa: E402

LAYERS = 61  # Kimi-K2.5's decoder layers (its recipe extracts through vLLM); only the ids in the files depend on it
# a process that keeps a core busy as vLLM's engine core and workers do, writing its count of turns (of 100,000
# empty loops each) to the file named by its argument: how much CPU it got beside the extraction
SPIN = ("import os, struct, sys\nfd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\nn = 0\nwhile True:\n"
        "    for _ in range(100000):\n        pass\n    n += 1\n    os.pwrite(fd, struct.pack('<Q', n), 0)\n")


class Spinners:
    """`n` SPIN processes; `turns()` is the sum of their counts so far."""

    def __init__(self, n: int, folder: Path):
        self.files = [folder / f"spin-{k}" for k in range(n)]
        for f in self.files:
            f.write_bytes(bytes(8))
        self.procs = [subprocess.Popen([sys.executable, "-c", SPIN, str(f)]) for f in self.files]

    def turns(self) -> int:
        total = 0
        for f in self.files:
            with open(f, "rb") as fh:
                data = fh.read(8)
            total += struct.unpack("<Q", data)[0] if len(data) == 8 else 0
        return total

    def close(self) -> None:
        for p in self.procs:
            p.terminate()
            p.wait()


def templates(folder: Path, info, hidden: int, length: int, distinct: int) -> tuple[dict, list[list[int]]]:
    """One connector file per distinct prompt (lengths from half to 1.5x `length`), as the connector writes it."""
    ids_of = vllm_backend.server_layer_ids(info.default_aux_layers(), info.num_layers)
    g = torch.Generator().manual_seed(0)
    prompts, recs = {}, []
    for k in range(distinct):
        n = length // 2 + (k * length) // max(1, distinct - 1)
        ids = [1000 + k] + torch.randint(3, 32000, (n - 1,), generator=g).tolist()
        hs = torch.randn(n, len(ids_of), hidden, generator=g).to(torch.bfloat16)
        f = folder / f"template-{k}.safetensors"
        save_file({"hidden_states": hs, "token_ids": torch.tensor(ids)}, str(f),
                  metadata={"format": "draftsmith-hidden-states-1", "layers": json.dumps(ids_of)})
        prompts[tuple(ids[:8])] = f
        recs.append(ids)
    return prompts, recs


def one_pass(way: str, work: Path, target: Path, samples: list[dict], cfg, sizes: ExtractThreads,
             spinners: Spinners) -> tuple[float, float, float]:
    """(tokens/s, tokens per CPU-second of this process, the spinners' turns/s) of run_extract on a fresh run
    with these sizes."""
    run = RunDir(work / f"run-{way}")
    shutil.rmtree(run.path, ignore_errors=True)
    write_prepare(run, str(target), samples)
    measured = vllm_backend.host_threads
    vllm_backend.host_threads = lambda _cfg: sizes
    try:
        t0, c0, s0 = time.perf_counter(), time.process_time(), spinners.turns()
        m = run_extract(run, cfg)
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        spun = (spinners.turns() - s0) / seconds
    finally:
        vllm_backend.host_threads = measured
    shutil.rmtree(run.path, ignore_errors=True)
    if m is None or m["counts"]["done"] != len(samples):
        raise SystemExit(f"{way}: the store is not complete")
    tokens = sum(len(s["input_ids"]) for s in samples)
    return tokens / seconds, tokens / cpu, spun


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--length", type=int, default=1024, help="mean tokens a sample")
    ap.add_argument("--samples", type=int, default=96)
    ap.add_argument("--distinct", type=int, default=4, help="distinct prompts (connector files written beforehand)")
    ap.add_argument("--passes", type=int, default=3, help="passes of each way, alternating")
    ap.add_argument("--concurrency", type=int, default=32, help="extract.concurrency (the Kimi recipes' 32)")
    ap.add_argument("--writers", type=int, default=4, help="extract.writers (the default 4)")
    ap.add_argument("--dir", default="/dev/shm", help="where the connector files and the store go")
    ap.add_argument("--busy", type=float, default=0.0, help="cores taken by other work, told to the rule")
    ap.add_argument("--today-threads", type=int, default=None,
                    help="the process's torch threads (default: this machine's cores, what the CLI's policy sets on "
                    "an idle node); more stands in for a bigger node's count on these cores")
    ap.add_argument("--spinners", type=int, default=0,
                    help="processes keeping a core busy beside the extraction, as vLLM's do (told to the rule as the "
                    "server's)")
    a = ap.parse_args()

    before = machine()
    cores = usable_cores()
    process = a.today_threads or cores
    torch.set_num_threads(process)  # the CLI's policy on an idle node: every core, in each thread that runs an op
    c, w = a.concurrency, a.writers
    ways = {"today": ExtractThreads(c, c, w, process, cores, "today's sizes: every thread at the process's count"),
            "sized": extract_threads(cores, a.busy, a.spinners, c, w)}
    work = Path(tempfile.mkdtemp(prefix="bench-extract-host-", dir=a.dir))
    try:
        target = extract_target(work / "target", a.hidden, LAYERS)
        info = target_info(str(target))
        prompts, recs = templates(work, info, a.hidden, a.length, a.distinct)
        samples = [{"id": f"s{i}", "input_ids": recs[i % a.distinct], "loss_mask": [1] * len(recs[i % a.distinct]),
                    "truncated": False} for i in range(a.samples)]
        tokens = sum(len(s["input_ids"]) for s in samples)
        server = SyntheticExtractServer(work, prompts)
        spinners = Spinners(a.spinners, work)
        try:
            cfg = load_config(None, [f"target={target}", "dtype=bfloat16", "extract.backend=vllm",
                                     f"extract.servers={json.dumps([server.url])}", "extract.store_format=fp8",
                                     f"extract.concurrency={a.concurrency}", f"extract.writers={a.writers}",
                                     "extract.shard_size=64", "extract.backoff_s=0"])
            print(f"machine: {before}; torch {torch.__version__}, {process} torch threads in the main thread")
            print(f"{a.samples} samples, {tokens:,} tokens, hidden {a.hidden}, connector files and store in {a.dir}; "
                  f"extract.concurrency {c}, extract.writers {w}")
            for way, sizes in ways.items():
                print(f"{way}: {sizes.line()}", flush=True)
            rates: dict[str, list[float]] = {way: [] for way in ways}
            per_cpu: dict[str, list[float]] = {way: [] for way in ways}
            spun: dict[str, list[float]] = {way: [] for way in ways}
            for p in range(a.passes):
                for way, sizes in ways.items():
                    r, e, t = one_pass(way, work, target, samples, cfg, sizes, spinners)
                    rates[way].append(r)
                    per_cpu[way].append(e)
                    spun[way].append(t)
                    print(f"pass {p + 1} {way}: {r:,.0f} tokens/s, {e:,.0f} tokens per CPU-second, "
                          + (f"spinners {t:,.1f} turns/s, " if a.spinners else "")
                          + f"load {os.getloadavg()[0]:.1f}", flush=True)
        finally:
            spinners.close()
            server.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for what, xs in (("tokens/s", rates), ("tokens per CPU-second", per_cpu)) + (
            (("spinners' turns/s", spun),) if a.spinners else ()):
        ratios = [s / t for s, t in zip(xs["sized"], xs["today"])]
        print(f"{what}: today {spread(xs['today'])}, sized {spread(xs['sized'])}; sized / today pass by pass "
              f"{spread(ratios)}, mean {statistics.mean(ratios):.3g}")
    print(f"load average after: {'/'.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
