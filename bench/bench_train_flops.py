"""Where a training step's time goes on this machine, and whether a faster number format exists.

    .venv/bin/python bench/bench_train_flops.py [--threads 1] [--row 1024] [--doc 288] [--steps 3] [--repeats 10]

Part 1, one training step as the recipes run it (one rank): the train stage's own objective
(draftsmith.train.objective: SmolLM2-135M dimensions, H 576, MLP 1536, draft vocabulary 8,192, 3 TTT steps) on
one packed row of --row tokens (documents of --doc tokens, the 400-prompt recipe's mean sample),
forward + backward + fused AdamW, float32. Token ids are drawn from the draft vocabulary, so every
position trains, as with `loss_on: all` on the real data (98 % of its tokens are in the vocabulary).
Random ids drawn from the whole vocabulary would leave five positions in six untrained and make the
LM head look cheap. torch.profiler counts the step's matrix products (aten::mm, FLOPs from their
shapes) and their share of the step's CPU time.

Part 2, the same products alone: GFLOP/s of the step's largest matrix shapes in float32, bfloat16 and
float16, best of --repeats, and each format's ratio to float32. Ratios, not absolute figures, carry
over between runs on a shared machine.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.model.config import DrafterConfig  # noqa: E402
from draftsmith.model.eagle3 import Eagle3Drafter  # noqa: E402
from draftsmith.train.data import Batch  # noqa: E402
from draftsmith.train.objective import TTTObjective  # noqa: E402
from draftsmith.train.schedule import ADAM_BETAS  # noqa: E402

H, MLP, HEADS, KV_HEADS, VOCAB, DRAFT_VOCAB = 576, 1536, 9, 3, 49152, 8192  # SmolLM2-135M


def step_profile(row: int, doc: int, steps: int) -> dict:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=MLP, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, rope_theta=100000.0)
    drafter = Eagle3Drafter(cfg)
    draft_ids = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    drafter.d2t.copy_(draft_ids - torch.arange(DRAFT_VOCAB))
    drafter.t2d.zero_()
    drafter.t2d[draft_ids] = True
    drafter.embed_tokens.weight.requires_grad_(False)  # frozen in training too
    objective = TTTObjective(drafter, torch.randn(DRAFT_VOCAB, H) * 0.05, 3, 0.8)
    params = [p for p in objective.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=ADAM_BETAS, fused=True)

    ids = draft_ids[torch.randint(0, DRAFT_VOCAB, (1, row))]
    doc_ids = (torch.arange(row) // doc).unsqueeze(0)
    pos = (torch.arange(row) % doc).unsqueeze(0)
    aux, last = torch.randn(1, row, 3 * H), torch.randn(1, row, H)
    loss_mask = torch.ones(1, row, dtype=torch.bool)
    batch = Batch(ids, loss_mask, doc_ids, pos, aux, last, samples=[], tokens=row)
    denom = [float(row)] * 3

    def step() -> None:
        loss, _ = objective(batch, denom)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):  # warm-up: oneDNN/MKL kernel selection, allocator
        step()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    wall = (time.perf_counter() - t) / steps
    from torch.profiler import profile

    with profile(record_shapes=True, with_flops=True) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    mm = [e for e in events if e.key == "aten::mm"]
    mm_us = sum(e.self_cpu_time_total for e in mm)
    mm_flops = sum(e.flops for e in mm)
    return {"step_s": wall, "tokens_per_s": row / wall, "mm_share": mm_us / total_us,
            "mm_gflops": mm_flops / (mm_us * 1e-6) / 1e9, "mm_gflop_per_step": mm_flops / steps / 1e9}


def bare_matmul(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    for _ in range(3):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * m * k * n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the recipes run one per rank)")
    ap.add_argument("--row", type=int, default=1024, help="tokens per micro-batch row (the recipes' seq_len)")
    ap.add_argument("--doc", type=int, default=288, help="tokens per packed document")
    ap.add_argument("--steps", type=int, default=3, help="timed and profiled training steps")
    ap.add_argument("--repeats", type=int, default=10, help="repeats per bare product (best is kept)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()[0]

    s = step_profile(args.row, args.doc, args.steps)
    shapes = [(args.row, H, DRAFT_VOCAB, "LM head forward"), (args.row, H, MLP, "MLP gate/up forward"),
              (args.row, MLP, H, "MLP down forward"), (DRAFT_VOCAB, args.row, H, "LM head weight gradient")]
    rows = []
    for m, k, n, what in shapes:
        g = {dt: bare_matmul(m, k, n, dt, args.repeats) for dt in (torch.float32, torch.bfloat16, torch.float16)}
        rows.append((what, m, k, n, g))
    peak = max(r[4][torch.float32] for r in rows)
    load1 = os.getloadavg()[0]

    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)()
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    print(f"# torch {torch.__version__}, {args.threads} thread(s); AMX: {amx}, AVX512-BF16: {'avx512_bf16' in flags}, "
          f"AVX512-FP16: {'avx512_fp16' in flags}; load average {load0:.1f} -> {load1:.1f}")
    print(f"training step (one rank, one {args.row}-token row of {args.doc}-token documents, float32): "
          f"{s['step_s']:.2f} s = {s['tokens_per_s']:,.0f} tokens/s; matrix products {s['mm_gflop_per_step']:.0f} GFLOP, "
          f"{s['mm_share']:.0%} of the step's CPU time, at {s['mm_gflops']:.0f} GFLOP/s "
          f"= {s['mm_gflops'] / peak:.2f}x the best bare float32 product below")
    print(f"| {'product':<24} | {'shape [m x k] x [k x n]':>28} | {'fp32 GFLOP/s':>12} | {'bf16 / fp32':>11} | {'fp16 / fp32':>11} |")
    print(f"|{'-' * 26}|{'-' * 30}|{'-' * 14}|{'-' * 13}|{'-' * 13}|")
    for what, m, k, n, g in rows:
        f32 = g[torch.float32]
        print(f"| {what:<24} | {f'[{m} x {k}] x [{k} x {n}]':>28} | {f32:>12.0f} | {g[torch.bfloat16] / f32:>10.2f}x | "
              f"{g[torch.float16] / f32:>10.2f}x |")


if __name__ == "__main__":
    main()
