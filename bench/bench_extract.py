"""Benchmark the extract stage against a bare Hugging Face forward on the same batches.

    .venv/bin/python bench/bench_extract.py [--samples 64] [--batch-tokens 8192] [--repeats 2] [--dtype auto]

Target: SmolLM2-135M-Instruct in --dtype (default `auto`, as extract uses it). Data: the first
--samples ShareGPT conversations (user and assistant turns as they are in the file), rendered
with the target's chat template and cut to --max-length tokens, written as prepare/samples.jsonl
in a temporary run.

Measured --repeats times (best kept: the machine is shared). The samples are cut into --chunks
shards; for each shard in turn, over the batches extract plans for it (same grouping, padding,
dtype, torch.inference_mode):
- A = the bare `model(input_ids, position_ids, output_hidden_states=True)`, and
- B = extract's capture forward (base model + hooks, no LM head), nothing written,
  alternating batch by batch; then
- C = `run_extract(run, cfg, rank=shard, world_size=chunks, target=...)`, the whole stage for that
  shard: reading the prepare output, the forwards, serialising, sha256, fsync'd atomic writes,
  shard.json (and the manifest after the last shard).
So A, B and C run minutes apart at most and see the same machine load.
The model load is outside all three. Tokens/s count real (unpadded) tokens, so a ratio is a ratio
of times. Wall and CPU seconds (process_time, all threads) are both printed: when other jobs share
the cores, wall time swings with them and CPU time much less.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.extract.hf import make_batch, plan_batches  # noqa: E402
from draftsmith.target.capture import HiddenCapture  # noqa: E402
from draftsmith.extract.stage import run_extract  # noqa: E402
from draftsmith.rundir import RunDir, file_sha256  # noqa: E402
from draftsmith.store_format import bytes_per_token, shard_ranges  # noqa: E402
from draftsmith.target import load_target  # noqa: E402

from _sharegpt import sharegpt_conversations  # noqa: E402


def sharegpt_samples(tokenizer, n: int, max_length: int) -> list[dict]:
    """The first n ShareGPT conversations with at least one user and one assistant turn."""
    out = []
    for sid, msgs in sharegpt_conversations(n):
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:max_length]
        out.append({"id": sid, "input_ids": ids, "loss_mask": [1] * len(ids), "truncated": len(ids) == max_length})
    return out


def write_prepare(run: RunDir, info, samples: list[dict]) -> None:
    d = run.ensure().stage_dir("prepare")
    text = "".join(json.dumps(s) + "\n" for s in samples)
    (d / "samples.jsonl").write_text(text)
    run.write_manifest("prepare", fingerprint=file_sha256(d / "samples.jsonl"), settings={},
                       inputs={"target": info.name, "target_fingerprint": info.fingerprint},
                       counts={"done": len(samples), "total": len(samples), "unit": "samples"},
                       started=time.time(), outputs=["samples.jsonl"])


class Clock:
    """Wall and CPU seconds (process_time: all threads of this process, the writer's included).
    CPU seconds hardly move when other jobs share the cores; wall seconds do."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def __enter__(self):
        self._w, self._c = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall += time.perf_counter() - self._w
        self.cpu += time.process_time() - self._c


def forwards(model, capture, samples: list[dict], batches: list[list[int]], device, bare: Clock, cap: Clock) -> None:
    """Per batch: the bare HF forward (output_hidden_states=True, LM head) and the capture
    forward extract uses (base model + hooks, no LM head), nothing written; which goes first
    alternates, so neither always inherits the other's freed memory or a load change."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.inference_mode():
        for j, b in enumerate(batches):
            ids, pos = make_batch([samples[i] for i in b])
            ids, pos = ids.to(device), pos.to(device)
            for which in ((0, 1) if j % 2 == 0 else (1, 0)):
                if which == 0:
                    with bare:
                        out = model(input_ids=ids, position_ids=pos, output_hidden_states=True, use_cache=False)
                        del out
                        sync()
                else:
                    with cap:
                        aux, last = capture(ids, pos)
                        del aux, last
                        sync()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=8, help="Interleave A, B and C over this many shards.")
    ap.add_argument("--dtype", default="auto", help="Target dtype for both (config `dtype`; auto = bf16 on GPUs/AMX CPUs, else float32).")
    ap.add_argument("--dir", default=None, help="Scratch folder (default: a temporary one, removed after).")
    args = ap.parse_args()

    load0 = os.getloadavg()[0]
    target = load_target(args.target, dtype=args.dtype, log=lambda m: None)
    info, model, device = target.info, target.model, target.device
    samples = sharegpt_samples(target.tokenizer, args.samples, args.max_length)
    lengths = [len(s["input_ids"]) for s in samples]
    tokens = sum(lengths)
    # C runs as `chunks` ranks one after the other (shard r = rank r), each right after A and B
    # over the same shard's batches: the three are measured under the same machine load.
    chunks = max(1, min(args.chunks, len(samples)))
    shard_size = -(-len(samples) // chunks)
    cfg = load_config(None, [f"target={args.target}", f"extract.batch_tokens={args.batch_tokens}",
                             f"extract.shard_size={shard_size}", f"dtype={args.dtype}"])
    layers = cfg.extract.layers or info.default_aux_layers()
    shards = shard_ranges(len(samples), shard_size)
    shard_batches = [plan_batches(list(range(s, e)), lengths, args.batch_tokens) for s, e in shards]
    batches = [b for sb in shard_batches for b in sb]
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)

    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-extract-"))
    run = RunDir(scratch / "run")
    write_prepare(run, info, samples)
    with torch.inference_mode():  # warm-up (kernel selection, allocator) on one small batch
        ids, pos = make_batch([samples[i] for i in batches[-1]])
        model.model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False)

    bare, cap, ext = [], [], []
    manifest = None
    for _ in range(args.repeats):
        shutil.rmtree(run.path / "extract", ignore_errors=True)
        b, c, e = Clock(), Clock(), Clock()
        for r, sb in enumerate(shard_batches):
            capture = HiddenCapture(model, layers)
            forwards(model, capture, samples, sb, device, b, c)
            capture.remove()
            with e:
                manifest = run_extract(run, cfg, rank=r, world_size=len(shards), target=target)
        bare.append(b)
        cap.append(c)
        ext.append(e)
    assert manifest is not None and manifest["counts"]["done"] == len(samples)
    on_disk = sum(p.stat().st_size for p in (run.path / "extract").rglob("*.safetensors"))

    def row(name: str, clocks: list[Clock]) -> None:
        w, c = min(x.wall for x in clocks), min(x.cpu for x in clocks)
        print(f"| {name} | {w:.1f} | {tokens / w:,.0f} | {c:.1f} | {tokens / c * torch.get_num_threads():,.0f} |")

    print()
    print(f"extract bench: {info.name}, {len(samples)} ShareGPT samples, {tokens:,} tokens "
          f"(mean {tokens / len(samples):.0f}, max {max(lengths)}), batch_tokens {args.batch_tokens}, "
          f"{len(batches)} batches in {len(shards)} shards, {100 * (1 - tokens / padded):.1f}% padding, {str(target.dtype).replace('torch.', '')}, "
          f"{device.type}, {torch.get_num_threads()} threads, best of {args.repeats}; load average before/after "
          f"{load0:.1f}/{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print()
    print("| run | wall s | tokens/s (wall) | CPU s | tokens/s (CPU, x threads) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    row(f"A. bare forward, output_hidden_states=True (LM head, all {info.num_layers + 1} states)", bare)
    row(f"B. capture forward only (hooks on {layers}, no LM head), nothing written", cap)
    row("C. draftsmith extract end to end (run_extract per shard: read, forward, serialise, sha256, fsync'd writes)", ext)
    best = lambda xs, k: min(getattr(x, k) for x in xs)  # noqa: E731
    print()
    print(f"extract (C) vs bare forward (A): {best(bare, 'wall') / best(ext, 'wall'):.2f}x wall, "
          f"{best(bare, 'cpu') / best(ext, 'cpu'):.2f}x CPU time")
    print(f"capture (B) vs bare forward (A): {best(bare, 'wall') / best(cap, 'wall'):.2f}x wall, "
          f"{best(bare, 'cpu') / best(cap, 'cpu'):.2f}x CPU time")
    ref = 4 * info.hidden_size * 2
    print(f"bytes per token on disk: {on_disk / tokens:,.0f} (format: {bytes_per_token(3, info.hidden_size):,} = "
          f"(3 aux + 1 last) x {info.hidden_size} x 2 + 4 id + 1 mask, plus a header per file); "
          f"reference 4 layers in bf16: 4 x {info.hidden_size} x 2 = {ref:,} + id")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
