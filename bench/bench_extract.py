"""Benchmark the extract stage against a bare Hugging Face forward on the same batches.

    .venv/bin/python bench/bench_extract.py [--samples 64] [--batch-tokens 8192] [--repeats 2]

Target: SmolLM2-135M-Instruct (bf16). Data: the first --samples ShareGPT conversations (user and
assistant turns as they are in the file), rendered with the target's chat template and cut to
--max-length tokens, written as prepare/samples.jsonl in a temporary run.

Measured, alternating, --repeats times each (best kept, the machine is shared):
- baseline: `model(input_ids, position_ids, output_hidden_states=True)` over the batches extract
  plans (same grouping, padding and dtype), under torch.inference_mode; nothing is written;
- extract: `run_extract(run, cfg, target=...)` from scratch into a fresh store, wall clock of
  the whole call: reading prepare output, the forwards, serialising, hashing, fsync'd writes,
  shard.json, manifest (the model load is excluded from both).
Tokens/s count real (unpadded) tokens in both, so the ratio is baseline time / extract time.
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.extract import bytes_per_token, make_batch, plan_batches, run_extract, shard_ranges  # noqa: E402
from draftsmith.prompts import iter_records, resolve_source  # noqa: E402
from draftsmith.rundir import RunDir, file_sha256  # noqa: E402
from draftsmith.target import load_target  # noqa: E402

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}


def sharegpt_samples(tokenizer, n: int, max_length: int) -> list[dict]:
    """The first n ShareGPT conversations with at least one user and one assistant turn."""
    path, _ = resolve_source("sharegpt")
    out = []
    for _, rec in iter_records(path, tolerate_cut_tail=True):
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(conv, list):
            continue
        msgs = [{"role": ROLES[t.get("from")], "content": t.get("value")} for t in conv
                if isinstance(t, dict) and t.get("from") in ROLES and isinstance(t.get("value"), str) and t["value"].strip()]
        if len({m["role"] for m in msgs}) < 2 or msgs[0]["role"] != "user":
            continue
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)[:max_length]
        out.append({"id": str(rec.get("id", len(out))), "input_ids": ids, "loss_mask": [1] * len(ids),
                    "truncated": len(ids) == max_length})
        if len(out) == n:
            break
    return out


def write_prepare(run: RunDir, info, samples: list[dict]) -> None:
    d = run.ensure().stage_dir("prepare")
    text = "".join(json.dumps(s) + "\n" for s in samples)
    (d / "samples.jsonl").write_text(text)
    run.write_manifest("prepare", fingerprint=file_sha256(d / "samples.jsonl"), settings={},
                       inputs={"target": info.name, "target_fingerprint": info.fingerprint},
                       counts={"done": len(samples), "total": len(samples), "unit": "samples"},
                       started=time.time(), outputs=["samples.jsonl"])


def baseline(model, samples: list[dict], batches: list[list[int]], device) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in batches:
            ids, pos = make_batch([samples[i] for i in b])
            out = model(input_ids=ids.to(device), position_ids=pos.to(device), output_hidden_states=True, use_cache=False)
            del out
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def extract_once(run: RunDir, cfg, target) -> tuple[float, dict]:
    shutil.rmtree(run.path / "extract", ignore_errors=True)
    t0 = time.perf_counter()
    manifest = run_extract(run, cfg, target=target)
    return time.perf_counter() - t0, manifest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--max-length", type=int, default=2048)
    ap.add_argument("--batch-tokens", type=int, default=8192)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="Scratch folder (default: a temporary one, removed after).")
    args = ap.parse_args()

    target = load_target(args.target, log=lambda m: None)
    info, model, device = target.info, target.model, target.device
    samples = sharegpt_samples(target.tokenizer, args.samples, args.max_length)
    lengths = [len(s["input_ids"]) for s in samples]
    tokens = sum(lengths)
    cfg = load_config(None, [f"target={args.target}", f"extract.batch_tokens={args.batch_tokens}"])
    # the batches extract plans: length-sorted within each shard
    batches = [b for s, e in shard_ranges(len(samples), cfg.extract.shard_size)
               for b in plan_batches(list(range(s, e)), lengths, args.batch_tokens)]
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)

    scratch = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-extract-"))
    run = RunDir(scratch / "run")
    write_prepare(run, info, samples)
    with torch.inference_mode():  # warm-up (kernel selection, allocator) on one small batch
        ids, pos = make_batch([samples[i] for i in batches[-1]])
        model.model(input_ids=ids.to(device), position_ids=pos.to(device), use_cache=False)

    base_s, ext_s = [], []
    manifest = None
    for _ in range(args.repeats):
        base_s.append(baseline(model, samples, batches, device))
        t, manifest = extract_once(run, cfg, target)
        ext_s.append(t)
    ratios = [b / e for b, e in zip(base_s, ext_s)]
    on_disk = sum(p.stat().st_size for p in (run.path / "extract").rglob("*.safetensors"))

    print()
    print(f"extract bench: {info.name}, {len(samples)} ShareGPT samples, {tokens:,} tokens "
          f"(mean {tokens / len(samples):.0f}, max {max(lengths)}), batch_tokens {args.batch_tokens}, "
          f"{len(batches)} batches, {100 * (1 - tokens / padded):.1f}% padding, {str(target.dtype).replace('torch.', '')}, "
          f"{device.type}, {torch.get_num_threads()} threads, best of {args.repeats}")
    print()
    print("| run | seconds | tokens/s |")
    print("| --- | ---: | ---: |")
    print(f"| bare forward, output_hidden_states=True (LM head, all {info.num_layers + 1} states) | {min(base_s):.2f} | {tokens / min(base_s):,.0f} |")
    print(f"| draftsmith extract (hooks on {manifest['settings']['layers']}, no LM head), writing included | {min(ext_s):.2f} | {tokens / min(ext_s):,.0f} |")
    print(f"| ratio extract / bare (best vs best) | | {min(base_s) / min(ext_s):.2f}x |")
    print(f"| ratio per repeat (median) | | {statistics.median(ratios):.2f}x ({', '.join(f'{r:.2f}' for r in ratios)}) |")
    print()
    ref = 4 * info.hidden_size * 2
    print(f"bytes per token on disk: {on_disk / tokens:,.0f} (format: {bytes_per_token(3, info.hidden_size):,} = "
          f"(3 aux + 1 last) x {info.hidden_size} x 2 + 4 id + 1 mask, plus a header per file); "
          f"reference 4 layers in bf16: 4 x {info.hidden_size} x 2 = {ref:,} + id")
    if not args.dir:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
