"""The attention masks of training-time test (TTT): which keys each query of an unrolled drafting
step sees, and the block-sparse ways of computing that attention.

Keys of step k are laid out [step0 (L) | step1 (L) | ... | stepk (L)]; query i sees the step-0 keys
j <= i of its own document (the verified prefix) and key i of each later step (its own chain).
Three ways to run it (ttt_step_masks): the dense [L, (k+1)L] mask through SDPA, TTTMask (SDPA per
query block over just the keys it may see) and FlexTTTMask (compiled flex attention over a block
mask). Eagle3Drafter.ttt_forward (eagle3.py) unrolls the steps over these masks.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F

from draftsmith.model.config import ATTN_BLOCK

try:  # flex attention exists from torch 2.5 on; draftsmith allows 2.4, which then has the SDPA path only
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch 2.4
    BlockMask = flex_attention = None

# TTT attention implementations (Eagle3Drafter.ttt_forward's `attention`)
ATTENTION_PATHS = ("sdpa", "flex")
# flex attention's tile (its default sparse block size): the block mask says, per tile of 128
# queries x 128 keys, whether the tile is skipped, fully visible, or visible by the mask function
FLEX_BLOCK = 128


def first_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] any ids -> [B, L] int64: the first position of each position's document in its row,
    i.e. the first step-0 key its query sees in TTT attention. Fixed-shape ops only (a stable sort
    per row groups the ids; the group's first element is its first position), so no device->host
    read; also an id per document (equal ids <=> equal documents) bounded by L."""
    B, L = doc_ids.shape
    ids, order = doc_ids.sort(dim=-1, stable=True)  # [B, L]; within a group, positions ascending
    at = torch.arange(L, device=doc_ids.device).expand(B, L)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    group_start = torch.where(starts, at, 0).cummax(-1).values  # [B, L] sorted index of the group's first
    first_sorted = order.gather(-1, group_start)  # its position in the row
    return torch.empty_like(order).scatter_(-1, order, first_sorted)


def _block_floors(first: torch.Tensor, block: int) -> list[int]:
    """[B, L] first visible key of each query -> per query block of `block` positions, the
    smallest over the block and the rows (one device->host read)."""
    B, L = first.shape
    nb = -(-L // block)
    padded = F.pad(first, (0, nb * block - L), value=L)  # a padded query sees nothing before L
    return padded.view(B, nb, block).amin(dim=(0, 2)).tolist()


def key_floors(doc_ids: torch.Tensor, block: int = ATTN_BLOCK) -> list[int]:
    """ttt_forward's `key_floors` for doc_ids [B, L]: per query block of `block` positions, the first
    step-0 key any of its queries sees. Computed where doc_ids is on the host (the data thread),
    it spares ttt_forward a device->host read per micro-batch."""
    return _block_floors(first_positions(doc_ids), block)


class TTTMask:
    """The attention pattern of a training-time-test step, computed block-sparsely.

    Keys are laid out [step0 (L) | step1 (L) | ... | stepk (L)]; query i sees the
    step-0 keys allowed by `step0` ([B, 1, L, L]: j <= i, same document) and key i
    of each later step. The dense [L, (k+1)L] mask is almost all False: a block of
    queries [s, e) can only see step-0 keys [lo, e) (lo = the first key any of them
    sees) and keys [s, e) of the later steps. `attend` runs one SDPA per query
    block over just those keys with the same mask entries, so the softmax is the
    dense one (the keys it leaves out are masked for these queries anyway) at a
    fraction of the cost: about (1 + k*block/L)/(2(k+1)) of it for one document
    per row, much less for short packed documents.
    """

    def __init__(self, step0: torch.Tensor, block: int, floors: list[int] | None = None) -> None:
        """floors: key_floors(doc_ids, block) when the caller has it from the host (no device
        read here); None: computed from `step0` (one device->host read)."""
        self.step0, self.block = step0, block
        L = step0.shape[-1]
        if floors is None:
            first = step0[:, 0].to(torch.uint8).argmax(-1)  # [B, L] first visible key (argmax: first max)
            floors = _block_floors(first, block)
        # per query block b: (s, e, a) = its queries [s, e) and the first step-0 key
        # block a it needs (keys are taken in whole blocks, so from a * block on)
        self.spans = [(s, min(L, s + block), floors[b] // block) for b, s in enumerate(range(0, L, block))]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, heads, L, d]; keys, values [B, heads, (k+1)L, d] -> [B, heads, L, d]."""
        B, L = q.shape[0], q.shape[2]
        later = keys.shape[2] // L - 1  # k
        # One split into per-step blocks: its backward is a single concatenation,
        # where a slice per query block would allocate a full-size gradient each.
        sizes = [min(self.block, L - s) for s in range(0, L, self.block)]
        nb = len(sizes)
        kb, vb = keys.split(sizes * (later + 1), dim=2), values.split(sizes * (later + 1), dim=2)
        out = []
        for b, (s, e, a) in enumerate(self.spans):
            chunks = list(range(a, b + 1)) + [d * nb + b for d in range(1, later + 1)]
            eye = torch.eye(e - s, dtype=torch.bool, device=q.device).expand(B, 1, e - s, e - s)
            mask = torch.cat([self.step0[:, :, s:e, a * self.block:e]] + [eye] * later, dim=-1)
            out.append(F.scaled_dot_product_attention(
                q[:, :, s:e], torch.cat([kb[c] for c in chunks], dim=2),
                torch.cat([vb[c] for c in chunks], dim=2), attn_mask=mask))
        return torch.cat(out, dim=2)


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process. Uncompiled it is a reference implementation that
    materialises every score ([B, heads, L, (k+1)L]); compiled it is a fused kernel that visits only
    the tiles the block mask lists. dynamic=True: one kernel for every row length and TTT step
    (each new key length would otherwise compile again, ~20 s each)."""
    if flex_attention is None:
        raise ValueError(f"flex attention needs torch >= 2.5 (this is {torch.__version__})")
    return torch.compile(flex_attention, dynamic=True)


def _ordered_tiles(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, nq, nkv] bool (which key tiles each query tile visits) -> BlockMask's (counts [B, 1, nq]
    int32, indices [B, 1, nq, nkv] int32: the visited tiles first, in increasing order)."""
    counts = tiles.sum(-1, dtype=torch.int32)
    order = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[:, None], order[:, None]


class FlexTTTMask:
    """The attention pattern of a training-time-test step as a flex-attention block mask.

    Same pattern as TTTMask (query i sees the step-0 keys j <= i of its document and key i of each
    later step), computed by flex attention: a fused kernel that visits only the 128 x 128 tiles
    holding a visible key and reads GQA keys/values in place (enable_gqa), so neither the per-block
    key copies of TTTMask nor the expanded kv heads are kept for backward.

    Built once per batch: which step-0 tiles are visible, and which of those fully, from the
    document ids alone ([B, tiles, documents]; no [L, L] mask). Extended per TTT step k: one diagonal
    tile per query tile and later step (block_mask(k), cached for the layers of that step).
    Rows are padded to Lp, a multiple of 128, and each step's keys too, so that every step's keys
    start on a tile; the padding is a document of its own, which no real query sees.
    """

    def __init__(self, doc_ids: torch.Tensor) -> None:
        B, L = doc_ids.shape
        self.L = L
        self.Lp = -(-L // FLEX_BLOCK) * FLEX_BLOCK
        nb = self.Lp // FLEX_BLOCK
        # documents renumbered 1..L per row by their first position (any ids, -1 padding included;
        # fixed-shape, no device->host read as torch.unique and a max would need); the tile padding is 0
        self.doc = F.pad(first_positions(doc_ids) + 1, (0, self.Lp - L))  # [B, Lp]
        n_docs = L + 1
        present = torch.zeros(B, nb, n_docs, dtype=torch.bool, device=doc_ids.device)
        present.scatter_(2, self.doc.view(B, nb, FLEX_BLOCK), True)  # [B, tiles, documents]
        # a query tile sees a key tile before it iff they share a document (every j < i there);
        # fully iff both hold that one document only; its own tile is causal, so partly
        shared = torch.bmm(present.float(), present.float().transpose(1, 2)) > 0  # [B, nb, nb]
        single = present.sum(-1) == 1
        t = torch.arange(nb, device=doc_ids.device)
        below = t[:, None] > t[None, :]
        self.full0 = below & shared & single[:, :, None] & single[:, None, :]
        self.partial0 = (below & shared & ~self.full0) | (t[:, None] == t[None, :])
        self._masks: dict[int, Any] = {}
        doc = self.doc

        def mask_mod(b, h, q_idx, kv_idx):
            # flex's per-element rule inside partly visible tiles; keys [step0 | step1 | ...], Lp each
            Lp = doc.shape[1]
            step, j = kv_idx // Lp, kv_idx % Lp
            return torch.where(step == 0, (j <= q_idx) & (doc[b, q_idx] == doc[b, j]), j == q_idx)

        self.mask_mod = mask_mod  # a plain function of (b, h, q_idx, kv_idx), as flex tells mask from score mods

    def block_mask(self, k: int):
        """The block mask of TTT step k: the step-0 tiles, then k diagonal tiles per query tile."""
        if k not in self._masks:
            B, nb, _ = self.partial0.shape
            eye = torch.eye(nb, dtype=torch.bool, device=self.doc.device).expand(B, nb, nb)
            partial = torch.cat([self.partial0] + [eye] * k, dim=-1)  # [B, nb, (k+1)nb]
            full = torch.cat([self.full0] + [torch.zeros_like(eye)] * k, dim=-1)
            self._masks[k] = BlockMask.from_kv_blocks(
                *_ordered_tiles(partial), *_ordered_tiles(full), BLOCK_SIZE=FLEX_BLOCK,
                mask_mod=self.mask_mod, seq_lengths=(self.Lp, (k + 1) * self.Lp))
        return self._masks[k]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, heads, L, d]; keys, values [B, kv_heads, (k+1)L, d] -> [B, heads, L, d]."""
        L, pad = self.L, self.Lp - self.L
        steps = keys.shape[2] // L
        if pad:
            q = F.pad(q, (0, 0, 0, pad))
            keys = F.pad(keys.unflatten(2, (steps, L)), (0, 0, 0, pad)).flatten(2, 3)
            values = F.pad(values.unflatten(2, (steps, L)), (0, 0, 0, pad)).flatten(2, 3)
        else:  # the padded ones are contiguous: one memory layout, so the compiled kernel serves both
            q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
        out = compiled_flex_attention()(q, keys, values, block_mask=self.block_mask(steps - 1), enable_gqa=True)
        return out[:, :, :L]



def ttt_step_masks(doc_ids: torch.Tensor, attention: str, attn_block: int | None,
                   floors: list[int] | None) -> Callable[[int], Any]:
    """Step k's attention mask as a function of k, for doc_ids [B, L]; what Eagle3Attention takes.

    attention "flex": a FlexTTTMask, built once (its block mask grows by a diagonal per step);
    "sdpa" with attn_block: a TTTMask of that query block (floors: key_floors(doc_ids, attn_block)
    from the host, or None: read here from the device); "sdpa" with attn_block None: the dense
    bool mask [B, 1, L, (k+1)L], True = may attend.
    """
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
    if attention == "flex":
        flex_mask = FlexTTTMask(doc_ids)
        return lambda k: flex_mask

    # Attention at step k for query i: step-0 keys j <= i of the same document (the verified
    # prefix) plus i's own chain at steps 1..k, so the mask is a causal same-document block
    # followed by k diagonal blocks. Dense, most of it is masked out (it would cost (k+1)L^2 per
    # step, as much as all the matmuls at L=2048); TTTMask skips the masked-out keys.
    B, L = doc_ids.shape
    device = doc_ids.device
    idx = torch.arange(L, device=device)
    causal = idx[None, :] <= idx[:, None]  # [L, L], [i, j] = j <= i
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]  # [B, L, L]
    step0_mask = (causal & same_doc).unsqueeze(1)  # [B, 1, L, L]
    if attn_block is None:
        diag = torch.eye(L, dtype=torch.bool, device=device).expand(B, 1, L, L)
        return lambda k: torch.cat([step0_mask] + [diag] * k, dim=-1)  # [B, 1, L, (k+1)L]
    blocked = TTTMask(step0_mask, attn_block, floors)
    return lambda k: blocked
