"""The host's share of offline training and of vLLM extraction at Kimi-K2's widths, measured on this CPU.

    .venv/bin/python bench/bench_data_thread.py [--samples 16] [--length 2048] [--batch-tokens 16384]
                                               [--repeats 3] [--threads 1,2] [--dir DIR]

Part 1, the training data thread (issue 39). A synthetic fp8 store (extract.store_format's default) at
hidden 7168 with three aux layers, --samples samples of --length tokens, written by the real writer and
read once so that the page cache holds it (the disk is the estimate's other bound, not this one). Then,
side by side and alternating per repeat, one rank's data thread turning it into micro-batches of
--batch-tokens tokens in rows of 8,192 (configs/kimi-k2-8xh200.yaml):
  before: every sample dequantised on the host to bf16 (store[i]), packed into fresh tensors, then
          copied once more into page-locked memory (pin_memory's copy; emulated by a copy into a fresh
          tensor, as this CPU build has no pinned memory);
  after:  the stored fp8 rows and their scales packed into a reused host arena (pinned on CUDA), as
          train/data.py does now; the GPU dequantises (not timed: the GPU's work, overlapped).
each with --threads torch threads (plain torchrun gives each rank 1). Printed: tokens/s and stored GB/s
of each, their ratio, and beside them what one training step consumes per rank on an H200 by the
estimate (configs/kimi-k2-8xh200.yaml, its drafter's FLOPs at the profile's MFU): the data thread must
keep up with it, or it is the bound.

Part 2, extraction's host work per request (extract.backend=vllm): for each sample, the connector's
file in /dev/shm (bf16, three aux layers + the last, as vLLM writes it), read back as the client does
(wait_and_load), checked (isfinite), the last state normed in float32 (FinalNorm), and encoded as
the fp8 store's file (quantisation included), one thread. Printed: bytes of connector file per second,
the rate draftsmith.estimate uses for that host work (EXTRACT_HOST_BYTES_PER_S).

The CPU model and load average are printed; compare the ratios measured side by side, not the
absolute figures of another machine.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_store import cpu_model, load  # noqa: E402

from draftsmith.config import load_config  # noqa: E402
from draftsmith.estimate import HARDWARE, estimate, target_shape  # noqa: E402
from draftsmith.extract import store  # noqa: E402
from draftsmith.extract.vllm_backend import FinalNorm, wait_and_load  # noqa: E402
from draftsmith.extract.codecs import codec_of  # noqa: E402
from draftsmith.rundir import atomic_write_json  # noqa: E402
from draftsmith.store_format import BF16, FP8  # noqa: E402
from draftsmith.train.data import HostArena, OfflineSource, pack_rows, packed_bytes  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
HIDDEN, AUX, LAYERS = 7168, 3, [2, 30, 58]  # Kimi-K2: 61 layers of 7,168
ROW = 8192  # configs/kimi-k2-8xh200.yaml train.seq_len


def build_store(d: Path, samples: int, length: int) -> store.ExtractStore:
    """An fp8 store as extract writes it (states scaled like a residual stream: a few large dims)."""
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, length, AUX, HIDDEN, generator=g).to(torch.bfloat16)
    aux[..., :4] *= 40
    last = torch.randn(1, length, HIDDEN, generator=g).to(torch.bfloat16)
    w = store.ShardWriter(d, LAYERS, threads=2, fmt=FP8)
    for s in store.shard_ranges(samples, samples):
        for i in range(*s):
            w.write_batch(s, [i], [{"id": f"s{i}", "input_ids": [i % 1000] * length, "loss_mask": [1] * length}],
                          aux, last)
        w.finish_shard(s)
    w.close()
    atomic_write_json(d / "meta.json", {"lengths": [length] * samples, "layers": LAYERS, "hidden_size": HIDDEN,
                                       "shard_size": samples, "store_format": FP8.name})
    return store.ExtractStore(d)


def micro_batches(src: OfflineSource, samples: int, length: int, batch_tokens: int) -> list[list[list[int]]]:
    """Micro-batches of batch_tokens // ROW rows, each row the samples that fill ROW tokens."""
    per_row = max(1, ROW // length)
    rows = [list(range(i, min(i + per_row, samples))) for i in range(0, samples, per_row)]
    k = max(1, batch_tokens // ROW)
    return [rows[j:j + k] for j in range(0, len(rows), k)]


def before(src: OfflineSource, plan) -> int:
    tokens = 0
    for rows in plan:
        packed = []
        for row in rows:
            packed.append([])
            for i in row:
                rec = src.store[i]  # dequantised on the host, to bf16
                packed[-1].append({"input_ids": rec["input_ids"].long(), "loss_mask": rec["loss_mask"].bool(),
                                   "aux_hidden": (rec["aux_hidden"],), "last_hidden": (rec["last_hidden"],),
                                   "index": i})
        b = pack_rows(packed, codec=codec_of(BF16))
        for t in b.tensors():
            t.clone()  # pin_memory(): one more copy, into page-locked memory
        tokens += b.tokens
    return tokens


def after(src: OfflineSource, plan, arena: HostArena) -> int:
    tokens = 0
    for rows in plan:
        b = pack_rows([[src.sample(i, ROW) for i in row] for row in rows], arena.reset(), codec=src.store.codec)
        tokens += b.tokens
    return tokens


def step_tokens_per_s_per_rank() -> float:
    """What one H200 rank's training consumes, tokens/s, by the estimate of the Kimi-K2 recipe."""
    cfg = load_config(REPO / "configs" / "kimi-k2-8xh200.yaml", [])
    shape = target_shape(REPO / "configs" / "targets" / "kimi-k2-instruct.json")
    e = estimate(cfg, shape, HARDWARE["h200"], 8, 300, 1800)
    return e["tokens_per_s"]["train_compute"] / 8


def part1(args, scratch: Path) -> None:
    src = OfflineSource(build_store(scratch / "store", args.samples, args.length))
    plan = micro_batches(src, args.samples, args.length, args.batch_tokens)
    for i in range(len(src.store)):  # into the page cache
        src.store.raw(i)
    stored = store.bytes_per_token(AUX, HIDDEN, "fp8")
    first = [[src.sample(i, ROW) for i in row] for row in plan[0]]
    arena = HostArena(packed_bytes(len(plan[0]), ROW, first[0][0]), pin=False)
    total = sum(args.length * len(r) for rows in plan for r in rows)
    print(f"part 1: {args.samples} samples x {args.length} tokens (fp8 store, {stored:,} B/token, "
          f"{total * stored / 1e9:.2f} GB), micro-batches of {args.batch_tokens:,} tokens in rows of {ROW:,}")
    need = step_tokens_per_s_per_rank()
    print(f"one H200 rank's training step consumes ~{need:,.0f} tokens/s by the estimate "
          f"(configs/kimi-k2-8xh200.yaml)\n")
    print("| data thread | torch threads | tokens/s (median) | stored GB/s | passes | after / before | "
          "/ the step's need |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        runs = {"before": [], "after": []}
        for _ in range(args.repeats):
            for name in ("before", "after"):
                t0 = time.perf_counter()
                n = before(src, plan) if name == "before" else after(src, plan, arena)
                runs[name].append(n / (time.perf_counter() - t0))
        med = {k: statistics.median(v) for k, v in runs.items()}
        for name in ("before", "after"):
            ratio = f"{med['after'] / med['before']:.2f}x" if name == "after" else ""
            passes = ", ".join(f"{x:,.0f}" for x in runs[name])
            print(f"| {name} | {threads} | {med[name]:,.0f} | {med[name] * stored / 1e9:.2f} | {passes} | {ratio} | "
                  f"{med[name] / need:.2f}x |")
    print()


def part2(args, scratch: Path) -> None:
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else scratch
    folder = Path(tempfile.mkdtemp(prefix="ds-bench-hs-", dir=shm))
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(args.length, AUX + 1, HIDDEN, generator=g).to(torch.bfloat16)
    tok = torch.arange(args.length) % 1000
    norm = FinalNorm(torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6)
    sample = {"id": "s", "input_ids": tok.tolist(), "loss_mask": [1] * args.length}
    torch.set_num_threads(1)
    rates = []
    try:
        for r in range(args.repeats):
            paths = []
            for i in range(args.samples):  # the connector's files, written before the clock starts
                p = str(folder / f"req{r}-{i}.safetensors")
                save_file({"hidden_states": hs, "token_ids": tok}, p)
                paths.append(p)
            t0 = time.perf_counter()
            for p in paths:
                t, _ = wait_and_load(p, 10.0)
                x = t["hidden_states"]
                assert bool(torch.isfinite(x).all())
                store.encode_sample(0, sample, x[:, :AUX], norm(x[:, AUX]), LAYERS, FP8)
                os.unlink(p)
            rates.append(args.samples * hs.numel() * hs.element_size() / (time.perf_counter() - t0))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = statistics.median(rates)
    per_token = (AUX + 1) * HIDDEN * 2
    print(f"part 2: extraction's host work per request, one thread, {args.samples} requests of {args.length} tokens "
          f"({per_token:,} B/token of connector file): {med / 1e9:.2f} GB/s (passes "
          + ", ".join(f"{x / 1e9:.2f}" for x in rates) + f"), {med / per_token:,.0f} tokens/s per thread")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")], default=[1, os.cpu_count() or 1])
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; {load()}; torch {torch.__version__}\n")
    scratch = Path(tempfile.mkdtemp(prefix="ds-bench-dt-", dir=args.dir))
    try:
        part1(args, scratch)
        part2(args, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
