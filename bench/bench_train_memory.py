"""Peak memory of one drafter training step per GPU, measured without a GPU.

    .venv/bin/python bench/bench_train_memory.py [--rows all] [--json FILE]

What runs: the project's own training step as train.stage._optimizer_step runs it on one GPU
(TTTObjective: the drafter's TTT forward and the loss, under bf16 autocast; backward; gradient
clipping; the fused AdamW step; zero_grad), with the recipes' shapes: a drafter sized by
DrafterConfig.from_target_config from the target's config.json, fp32 master weights and the frozen
fp32 embedding as training keeps them, the frozen teacher head (bf16 under bf16, as
train.distributed.distribute stores it), the micro-batch's bf16 target
states, and for online training the target itself in bf16 (transformers' model built from the
same config).

How it runs without a GPU or the memory: every floating-point tensor is a fake tensor (torch's
FakeTensorMode: shape, dtype and strides, no data, CPU dispatch so CPU autocast applies), while
integer and boolean tensors (token ids, document ids, masks, indices) stay real, so that the
step's data-dependent parts (which positions are trained, the block mask's tiles, the chunk
bounds) run as they do on real data. A TorchDispatchMode (LiveBytes) counts the bytes of every
tensor storage from the op that creates it until it is freed (a weakref callback on the storage).
The step runs twice and the peak of the second is reported (the first also creates AdamW's
moments). Flex attention runs its own fake rule (output and log-sum-exp, what its fused kernel
allocates) instead of torch.compile, which does not run under a dispatch mode; SDPA runs the CPU
kernels' memory rules (the fused kernel: q, k, v, the mask bias, output and log-sum-exp kept for
backward, as CUDA's memory-efficient kernel keeps them).

Not counted: the CUDA context and cuBLAS workspaces (~0.5-1 GB), the caching allocator's
fragmentation (bench/device_check.sh compares with torch.cuda.max_memory_allocated on a GPU),
NCCL buffers. DDP's gradient buckets are the gradients themselves (gradient_as_bucket_view); the
step as it was before (`before`) kept them as a second copy (4 bytes per trainable parameter), which
the table adds to that column for the recipes that run DDP. Worst-case data: every position is trained (loss on every token, each in the draft
vocabulary) and each row is one document (the longest attention).

Rows: Llama-3.1-8B (configs/llama-8b-1xh100.yaml: 16,384 tokens a micro-batch, online with the
target on the same GPU) at rows of 4,096 and 8,192 tokens, and Kimi-K2 (configs/kimi-k2-8xh200.yaml:
16,384 tokens, offline, DDP over 8 GPUs) at 8,192; TTT 3 and 7; before (SDPA block-sparse attention
and the loss over the whole micro-batch) and after (flex attention and the chunked loss).
"""

import argparse
import contextlib
import json
import sys
import types
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.attention.flex_attention as flex_module
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily
from torch.utils._pytree import tree_flatten
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from draftsmith.config import load_config  # noqa: E402
from draftsmith.estimate import HARDWARE, _drafter_params, target_shape, train_memory  # noqa: E402
# the module whose compiled_flex_attention FlexTTTMask calls: flex_without_compile patches it there
import draftsmith.model.ttt as ttt_module  # noqa: E402
from draftsmith.model.config import DrafterConfig  # noqa: E402
from draftsmith.model.eagle3 import Eagle3Drafter  # noqa: E402
from draftsmith.train.data import Batch  # noqa: E402
from draftsmith.train.objective import TTTObjective, step_counts  # noqa: E402
from draftsmith.train.schedule import make_optimizer  # noqa: E402

GB = 1e9
# the code paths compared: before this change (SDPA per query block, the loss over the whole
# micro-batch) and after (flex attention, the loss in chunks)
VARIANTS = {"before": dict(attention="sdpa", chunk_tokens=0), "after": dict(attention="flex", chunk_tokens=None)}


@dataclass(frozen=True)
class Row:
    """One row of the table: a recipe's target and training settings at a row length and TTT depth."""

    name: str
    recipe: str  # configs/*.yaml: draft vocabulary, batch_tokens, mode, devices
    target_config: str  # configs/targets/*.json
    hardware: str  # estimate.HARDWARE key of the GPU the recipe runs on
    devices: int  # GPUs the recipe trains on (DDP when > 1)
    seq_len: int
    ttt_steps: int

    def config(self):
        return load_config(REPO / self.recipe, [f"train.seq_len={self.seq_len}", f"train.ttt_steps={self.ttt_steps}"])


LLAMA = ("configs/llama-8b-1xh100.yaml", "configs/targets/llama-3.1-8b-instruct.json", "h100", 1)
KIMI = ("configs/kimi-k2-8xh200.yaml", "configs/targets/kimi-k2-instruct.json", "h200", 8)
ROWS = {r.name: r for r in [
    Row("llama-8b 4096 ttt3", *LLAMA, 4096, 3),
    Row("llama-8b 4096 ttt7", *LLAMA, 4096, 7),
    Row("llama-8b 8192 ttt3", *LLAMA, 8192, 3),
    Row("llama-8b 8192 ttt7", *LLAMA, 8192, 7),
    Row("kimi-k2 8192 ttt3", *KIMI, 8192, 3),
    Row("kimi-k2 8192 ttt7", *KIMI, 8192, 7),
]}


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensor storages alive: each from the op that creates it (or from
    watch()) until it is freed. Ops that touch a fake tensor run under the fake mode (their real
    integer inputs become fake); the others run for real, fake mode set aside."""

    supports_higher_order_operators = True  # flex attention is a higher-order op

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # id(storage) -> bytes
        self.refs: dict[int, weakref.ref] = {}
        self.now = self.peak = 0

    def watch(self, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._count(t)

    def reset_peak(self) -> None:
        self.peak = self.now

    def _count(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = id(st)
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.now += self.live[key]
        self.peak = max(self.peak, self.now)

        def freed(_, key=key):
            self.now -= self.live.pop(key)
            self.refs.pop(key, None)

        self.refs[key] = weakref.ref(st, freed)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(x, FakeTensor) for x in tree_flatten((args, kwargs))[0]):
            out = func(*args, **kwargs)
        else:
            with unset_fake_temporarily():
                out = func(*args, **kwargs)
        self.watch(tree_flatten(out)[0])
        return out


@contextlib.contextmanager
def flex_without_compile(live: LiveBytes):
    """Flex attention as its higher-order op, so that its fake rule runs: no compile (torch.compile
    refuses a dispatch mode) and no CPU check (the CPU has no backward, but a fake backward
    allocates what a GPU's does). The op's autograd set-up makes fake example values with
    factories, which LiveBytes would make real: it runs with LiveBytes set aside, and its output
    and log-sum-exp (what it keeps for backward besides its inputs) are counted after."""
    def flex(q, keys, values, block_mask):  # compiled_flex_attention's call (model.ttt._fused_flex)
        with _pop_mode_temporarily():
            out, aux = flex_module.flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=True,
                                                  return_aux=flex_module.AuxRequest(lse=True))
        live.watch([out, aux.lse])
        return out

    saved = (ttt_module.compiled_flex_attention, flex_module._validate_device,
             flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG)
    ttt_module.compiled_flex_attention = lambda: flex
    flex_module._validate_device = lambda *a, **k: None
    flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        yield
    finally:
        (ttt_module.compiled_flex_attention, flex_module._validate_device,
         flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG) = saved


def real_batch(rows: int, seq_len: int, draft_ids: torch.Tensor, aux, last) -> Batch:
    """A worst-case micro-batch: one document per row, every token trained and in the draft
    vocabulary; its integer tensors on draft_ids' device."""
    g = torch.Generator().manual_seed(0)
    ids = draft_ids[torch.randint(0, draft_ids.numel(), (rows, seq_len), generator=g).to(draft_ids.device)]
    return Batch(input_ids=ids, loss_mask=torch.ones_like(ids, dtype=torch.bool), doc_ids=torch.zeros_like(ids),
                 position_ids=torch.arange(seq_len, device=ids.device).expand(rows, seq_len).contiguous(),
                 aux_hidden=aux, last_hidden=last, samples=[], tokens=rows * seq_len)


def build(dcfg: DrafterConfig, tc, variant: dict, rows: int, seq_len: int, target_hf, mode, precision: str,
          device: str = "cpu"):
    """(objective, optimizer, trainable parameters, batch, resident tensors) for one step; the float
    tensors made under `mode` (a FakeTensorMode; a null context for real tensors; torch.device("cuda")
    on a GPU, with `device` "cuda" for the integer ones)."""
    H, A = dcfg.hidden_size, dcfg.num_aux_layers
    draft_ids = torch.linspace(0, dcfg.vocab_size - 1, dcfg.draft_vocab_size, device=device).long().unique()
    assert draft_ids.numel() == dcfg.draft_vocab_size
    with mode:
        torch.manual_seed(0)
        drafter = Eagle3Drafter(dcfg)
        act = torch.bfloat16 if precision == "bf16" else torch.float32  # as train.stage.fit moves each batch
        target_head = torch.randn(dcfg.draft_vocab_size, H, dtype=act)  # stored as distribute() stores it
        aux = torch.randn(rows, seq_len, A * H, dtype=act)
        last = torch.randn(rows, seq_len, H, dtype=act)
        target = None
        if target_hf is not None:  # online: the target, in bf16, shares the GPU
            target = AutoModelForCausalLM.from_config(target_hf, dtype=torch.bfloat16)
    # the vocabulary maps are data the step indexes with: real, as the token ids are
    drafter.d2t = draft_ids - torch.arange(dcfg.draft_vocab_size, device=device)
    drafter.t2d = torch.zeros(dcfg.vocab_size, dtype=torch.bool, device=device)
    drafter.t2d[draft_ids] = True
    objective = TTTObjective(drafter, target_head, tc.ttt_steps, tc.gamma, attention=variant["attention"],
                             chunk_tokens=variant["chunk_tokens"])
    named = [(n, p) for n, p in objective.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    optimizer = make_optimizer(named, tc, fused=True)
    batch = real_batch(rows, seq_len, draft_ids, aux, last)
    resident = list(objective.parameters()) + list(objective.buffers()) + [aux, last]
    if target is not None:
        resident += list(target.parameters()) + list(target.buffers())
    return objective, optimizer, params, batch, resident


def train_step(objective, optimizer, params, batch: Batch, tc, precision: str) -> None:
    """One optimizer step as train.stage._optimizer_step takes it (one micro-batch, one rank; bf16
    autocast or float32 as train.precision resolves), less its checks of the loss and gradient."""
    denom = step_counts(batch, objective.drafter.t2d, tc.ttt_steps).tolist()
    with torch.autocast(batch.input_ids.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss, _ = objective(batch, denom, scale=1.0)
    loss.backward()
    del loss
    torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(dcfg: DrafterConfig, tc, variant: str | dict, rows: int, seq_len: int, target_hf=None, fake: bool = True,
            precision: str = "bf16") -> dict:
    """Bytes of one training step: `peak` (the second step's), `resident` (what lives between
    steps: weights, AdamW's moments, the batch, the online target). variant: a VARIANTS name or
    its dict (attention, chunk_tokens); fake=False runs real tensors (tiny shapes only: the check
    that fake and real steps count the same)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    variant = VARIANTS[variant] if isinstance(variant, str) else variant
    objective, optimizer, params, batch, resident = build(dcfg, tc, variant, rows, seq_len, target_hf, mode, precision)
    live = LiveBytes()
    with flex_without_compile(live), mode:
        with live:
            live.watch(resident + [batch.input_ids, batch.loss_mask, batch.doc_ids, batch.position_ids])
            train_step(objective, optimizer, params, batch, tc, precision)
            between = live.now
            live.reset_peak()
            train_step(objective, optimizer, params, batch, tc, precision)
    return {"peak": live.peak, "resident": between}


def target_config(row: Row) -> types.SimpleNamespace:
    """The target's config.json as the attributes DrafterConfig.from_target_config reads (Kimi-K2's
    own config class, remote code, has no head_dim: its drafter's heads are hidden // heads wide)."""
    return types.SimpleNamespace(**json.loads((REPO / row.target_config).read_text()))


def row_shapes(row: Row) -> tuple:
    """(drafter config, train config, rows per micro-batch, the online target's config or None) of
    a row: the drafter training builds for the target (train/drafter.py's drafter_config),
    batch_tokens // seq_len rows of seq_len tokens, the target beside it when training online."""
    cfg = row.config()
    hf = target_config(row)
    dcfg = DrafterConfig.from_target_config(hf, draft_vocab_size=cfg.vocab.draft_vocab_size,
                                           num_hidden_layers=cfg.train.num_layers,
                                           attention=cfg.train.drafter_attention)
    online = None
    if cfg.train.mode == "online":  # the target as train.mode=online loads it (Llama only here)
        online = AutoConfig.for_model(**{k: v for k, v in vars(hf).items() if not k.startswith("_")})
    return dcfg, cfg.train, max(1, cfg.train.batch_tokens // row.seq_len), online


def measure_row(row: Row, variant: str) -> dict:
    """measure() at a row's shapes (row_shapes)."""
    dcfg, tc, rows, online = row_shapes(row)
    return measure(dcfg, tc, variant, rows, row.seq_len, online)


def table(names: list[str]) -> list[dict]:
    """Each row measured before and after, beside what `draftsmith estimate` says and the device."""
    out = []
    for name in names:
        row = ROWS[name]
        cfg = row.config()
        shape = target_shape(REPO / row.target_config)
        hw = HARDWARE[row.hardware]
        trainable, _ = _drafter_params(shape, cfg.vocab.draft_vocab_size, cfg.train.num_layers)
        # before gradient_as_bucket_view, DDP's buckets were a second copy of the gradients on every rank
        ddp = 4 * trainable if row.devices > 1 and not cfg.train.fsdp else 0
        got = {v: measure_row(row, v) for v in VARIANTS}
        est = train_memory(cfg.train, shape, hw, row.devices, cfg.vocab.draft_vocab_size)["total"]
        after = got["after"]["peak"]
        out.append({"row": name, "rows": max(1, cfg.train.batch_tokens // row.seq_len), "seq_len": row.seq_len,
                    "ttt_steps": row.ttt_steps, "mode": cfg.train.mode, "before": got["before"]["peak"] + ddp,
                    "after": after, "ddp_buckets": ddp, "resident": got["after"]["resident"], "estimate": est,
                    "device": hw.name, "device_bytes": hw.mem, "fits": after <= hw.mem})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="all", help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    names = list(ROWS) if args.rows == "all" else [r.strip() for r in args.rows.split(",")]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        ap.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    results = table(names)
    print(f"# peak memory of one training step per GPU (GB = 1e9 bytes), torch {torch.__version__}, fake tensors")
    head = (f"| {'row':<19} | {'micro-batch':>11} | {'before':>7} | {'after':>7} | {'DDP copy (before)':>17} | "
            f"{'estimate':>8} | {'est/after':>9} | {'device':<18} | fits |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for r in results:
        print(f"| {r['row']:<19} | {r['rows']:>2} x {r['seq_len']:<6} | {r['before'] / GB:>7.1f} | {r['after'] / GB:>7.1f} | "
              f"{r['ddp_buckets'] / GB:>17.1f} | {r['estimate'] / GB:>8.1f} | {r['estimate'] / r['after']:>9.3f} | "
              f"{r['device']:<18} | {'yes' if r['fits'] else 'NO':<4} |")
    print("(before: SDPA per 256-query block, GQA heads expanded, the loss over the whole micro-batch; after: flex "
          "attention, the loss in chunks. Llama rows train online, the bf16 target on the same GPU; Kimi rows offline "
          "under DDP on 8 GPUs (before: its gradient buckets a second copy, added; after: the gradients themselves). Not counted: CUDA context, workspaces, fragmentation.)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
