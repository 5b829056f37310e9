"""The checks of the training step that need a GPU (issue 24): run on a CUDA machine.

    python bench/gpu_smoke_flex.py [--rows "llama-8b 4096 ttt3,kimi-k2 8192 ttt3"] [--skip-memory]

1. Flex attention against the SDPA paths, forward AND gradients (the CPU has no flex backward):
   ttt_forward with attention="flex" against the block-sparse SDPA path and the dense mask, in
   float32 (TF32 off) and under bf16 autocast, for a GQA drafter with 64-wide heads and an MHA
   drafter with 112-wide heads (Kimi-K2's drafter: not a power of two), rows padded to a tile and
   rows that fill their tiles, packed documents and padding. Every parameter's gradient is compared.
2. Speed: forward + backward of ttt_forward at Llama-8B widths (4 x 4,096 tokens, 3 TTT steps, bf16)
   with each attention path, after a warm-up (and flex's compile).
3. Memory: one real training step (bench/bench_train_memory.py's build and train_step, on the GPU)
   at the given rows, before and after; torch.cuda.max_memory_allocated of the second step beside
   what the fake-tensor measurement says for the same row (docs/scaling.md's table). Expect the GPU
   figure a few % above (allocator rounding, cuBLAS workspaces); the script fails above 10 %.

Prints one line per check and exits non-zero on any failure. Needs torch >= 2.5 with CUDA,
transformers, and this repository's draftsmith (run from the repository root).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import bench_train_memory as bm  # noqa: E402

from draftsmith.model.config import Eagle3Config  # noqa: E402
from draftsmith.model.eagle3 import Eagle3Drafter  # noqa: E402

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def drafter(cfg: Eagle3Config, seed: int = 0) -> Eagle3Drafter:
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    with torch.no_grad():  # random norm weights: a swapped or skipped norm shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return d.cuda()


def run_paths(d: Eagle3Drafter, ids, aux, pos, doc, autocast: bool) -> dict:
    """{path: (states, gradients)} of a random linear function of ttt_forward's states."""
    out = {}
    for name, kw in (("flex", {"attention": "flex"}), ("sdpa", {}), ("dense", {"attn_block": None})):
        d.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            states = d.ttt_forward(ids, aux, 3, position_ids=pos, doc_ids=doc, return_hidden=True, **kw)
        g = torch.Generator(device="cuda").manual_seed(1)
        sum((s.float() * torch.randn(s.shape, device="cuda", generator=g)).sum() for s in states).backward()
        out[name] = ([s.detach().float() for s in states], {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    return out


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def gradients() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = {
        "gqa hd64": Eagle3Config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=500, draft_vocab_size=200, num_hidden_layers=2),
        "mha hd112": Eagle3Config(hidden_size=448, intermediate_size=640, num_attention_heads=4, num_key_value_heads=4,
                                  vocab_size=500, draft_vocab_size=200),
    }
    for cname, cfg in cases.items():
        d = drafter(cfg)
        for L in (1000, 1024):
            g = torch.Generator().manual_seed(L)
            ids = torch.randint(0, cfg.vocab_size, (2, L), generator=g).cuda()
            aux = torch.randn(2, L, 3 * cfg.hidden_size, generator=g).cuda()
            doc = torch.tensor([[0] * L, [0] * 300 + [1] * 500 + [2] * (L - 840) + [0] * 20 + [-1] * 20]).cuda()
            pos = torch.stack([torch.arange(L), torch.cat([torch.arange(300), torch.arange(500), torch.arange(L - 840),
                                                           torch.arange(20), torch.zeros(20, dtype=torch.long)])]).cuda()
            for autocast, tol in ((False, 1e-4), (True, 3e-2)):
                out = run_paths(d, ids, aux, pos, doc, autocast)
                for ref in ("sdpa", "dense"):
                    fwd = max(rel(a, b) for a, b in zip(out["flex"][0], out[ref][0]))
                    grad = max(rel(out["flex"][1][n], out[ref][1][n]) for n in out[ref][1])
                    same = out["flex"][1].keys() == out[ref][1].keys()
                    check(f"flex == {ref}, {cname}, L={L}, {'bf16' if autocast else 'fp32'}", same and fwd < tol and grad < tol,
                          f"max relative difference: states {fwd:.2e}, gradients {grad:.2e} (tolerance {tol:g})")


def speed() -> None:
    cfg = Eagle3Config(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, draft_vocab_size=32000)
    d = drafter(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 4096), device="cuda")
    aux = torch.randn(4, 4096, 3 * cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    times = {}
    for name, kw in (("flex", {"attention": "flex"}), ("sdpa", {})):
        for rep in range(4):  # the first: warm-up (and flex's compile)
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                states = d.ttt_forward(ids, aux, 3, return_hidden=True, **kw)
            sum(s.float().square().mean() for s in states).backward()
            torch.cuda.synchronize()
            if rep:
                times[name] = min(times.get(name, 1e9), time.perf_counter() - t)
            d.zero_grad(set_to_none=True)
    check("flex is faster than sdpa at Llama-8B widths", times["flex"] <= times["sdpa"],
          f"forward+backward of 4 x 4096 tokens, 3 TTT steps, bf16: flex {times['flex'] * 1e3:.0f} ms, "
          f"sdpa {times['sdpa'] * 1e3:.0f} ms")


def memory(rows: list[str]) -> None:
    for name in rows:
        row = bm.ROWS[name]
        dcfg, tc, n_rows, online = bm.row_shapes(row)
        for variant in ("after", "before"):
            torch.cuda.empty_cache()
            objective, optimizer, params, batch, _ = bm.build(dcfg, tc, bm.VARIANTS[variant], n_rows, row.seq_len, online,
                                                           torch.device("cuda"), "bf16", device="cuda")
            objective.cuda()
            bm.train_step(objective, optimizer, params, batch, tc, "bf16")
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            bm.train_step(objective, optimizer, params, batch, tc, "bf16")
            torch.cuda.synchronize()
            gpu = torch.cuda.max_memory_allocated()
            del objective, optimizer, params, batch
            fake = bm.measure_row(row, variant)["peak"]
            check(f"memory {name} {variant}", abs(gpu / fake - 1) < 0.10,
                  f"GPU max_memory_allocated {gpu / 1e9:.2f} GB, fake-tensor measurement {fake / 1e9:.2f} GB "
                  f"(ratio {gpu / fake:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="llama-8b 4096 ttt3,kimi-k2 8192 ttt3",
                    help=f"table rows to measure, comma-separated, of: {', '.join(bm.ROWS)}")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_smoke_flex: no CUDA device")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    gradients()
    speed()
    if not args.skip_memory:
        memory([r.strip() for r in args.rows.split(",") if r.strip()])
    if FAILED:
        sys.exit(f"gpu_smoke_flex: {len(FAILED)} check(s) failed: {FAILED}")
    print("gpu_smoke_flex: all checks passed")


if __name__ == "__main__":
    main()
