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
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from draftsmith import DraftsmithError
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


@dataclass(frozen=True)
class FlexShape:
    """The shapes a run calls flex attention at, so that Dynamo compiles a bounded set of graphs.

    Every call is padded to `rows` rows (a micro-batch's train rows: a tail micro-batch of fewer
    rows, down to the 1-row tail of an epoch, is padded up) and to a bucketed length (length):
    2, 3, 4, 6, 8, 12, 16, ... tiles of 128 tokens (2^i and 3 x 2^(i-1)), capped at the tiles of
    `row_len` (no row is longer). Padding costs memory, not compute: the padded q/k/v copies and
    output are at most 1.5x the unpadded ones (a short row in a length bucket), never more than a
    full micro-batch of row_len rows; the padding's query tiles visit no key tile, so the kernel
    skips them. The loss is untouched: the outputs are cut back to the rows and length asked for.

    What Dynamo may key graphs on is then: the length bucket, the TTT step (keys (k+1) x length)
    and the grad mode (training; validation under no_grad): graph_bound at most. With
    dynamic shapes it compiles far fewer (tests/test_flex_bounds.py counts them).
    """

    rows: int  # rows every call is padded to (train rows_per_batch)
    row_len: int  # tokens of the longest row (train row_len)
    steps: int  # TTT steps (train ttt_steps): the keys of step k are (k + 1) x the length

    def __post_init__(self) -> None:
        if min(self.rows, self.row_len, self.steps) < 1:
            raise ValueError(f"FlexShape needs rows, row_len and steps >= 1, got {self}")

    @property
    def max_tiles(self) -> int:
        """Tiles of the longest bucket: row_len's, at least 2 (one tile would compile a graph of its own:
        Dynamo specialises a size-1 dimension)."""
        return max(2, -(-self.row_len // FLEX_BLOCK))

    def tiles(self, length: int) -> int:
        """The bucket of a row of `length` tokens, in tiles of FLEX_BLOCK."""
        if not 1 <= length <= self.row_len:
            raise ValueError(f"flex attention: a row of {length} tokens is outside 1..{self.row_len} (row_len)")
        need, b = -(-length // FLEX_BLOCK), 2
        while b < need:
            b = b * 3 // 2 if b & (b - 1) == 0 else b * 4 // 3  # 2 -> 3 -> 4 -> 6 -> 8 -> 12 -> 16 ...
        return min(b, self.max_tiles)

    def buckets(self) -> list[int]:
        """Every bucket, in tiles."""
        return sorted({self.tiles(min(self.row_len, n * FLEX_BLOCK)) for n in range(1, self.max_tiles + 1)})

    @property
    def graph_bound(self) -> int:
        """The most graphs flex can compile for these shapes: one per length bucket, TTT step and grad
        mode (Dynamo's recompile limit is set to it)."""
        return len(self.buckets()) * self.steps * 2


# One entry per graph Dynamo compiled for flex attention in this process (what it was compiled at):
# its count is what the train stage logs and records (flex_graphs)
FLEX_GRAPHS: list[str] = []


def _counted_inductor(gm, example_inputs):
    """torch.compile's inductor backend, counting each graph it is handed (one per Dynamo compile)."""
    FLEX_GRAPHS.append("")  # the shape is filled in by FlexTTTMask.attend, which knows it
    return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)


class _Unfused(Exception):
    """flex attention reached its eager (unfused) path: Dynamo ran the call without compiling it."""


def _fused_flex(q, keys, values, block_mask):
    # Traced by Dynamo, is_compiling() is True and this test vanishes from the graph. Run as plain
    # Python (Dynamo disabled, or it skipped the frame) flex_attention would take its unfused path,
    # materialising [B, H, L, (k+1)L] fp32 scores (~100 GB at Kimi-K2.5's widths) behind one
    # UserWarning per process: refused instead.
    if not torch.compiler.is_compiling():
        raise _Unfused()
    return flex_attention(q, keys, values, block_mask=block_mask, enable_gqa=True)


@functools.cache
def compiled_flex_attention():
    """flex_attention compiled once per process. Uncompiled it is a reference implementation that
    materialises every score ([B, heads, L, (k+1)L]); compiled it is a fused kernel that visits only
    the tiles the block mask lists. dynamic=True: few graphs over the buckets and TTT steps (each new
    key length would otherwise compile again, ~20 s each); fullgraph=True: a graph break is an error,
    never a partly eager call."""
    if flex_attention is None:
        raise ValueError(f"flex attention needs torch >= 2.5 (this is {torch.__version__})")
    return torch.compile(_fused_flex, dynamic=True, fullgraph=True, backend=_counted_inductor)


class _LimitNote(logging.Filter):
    """Keeps Dynamo's multi-line notice of a hit recompile limit off the console, and its last reason (the guard
    that failed) for run_flex's one line."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = None

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if "recompile_limit" not in msg:
            return True
        self.reason = next((line.split("last reason:", 1)[1].strip() for line in msg.splitlines()
                            if "last reason:" in line), None)
        return False


def run_flex(q, keys, values, block_mask, bound: int):
    """compiled_flex_attention on q [R, heads, Lp, d], keys/values [R, kv_heads, (k+1)Lp, d], with
    Dynamo's recompile limit at `bound` graphs (FlexShape.graph_bound) and failing when hit; hitting
    it, or any unfused run, stops with a one-line DraftsmithError instead of torch's silent eager
    fallback."""
    cfg = torch._dynamo.config
    # torch >= 2.7's names, else the older ones; past the limit without the fail flag Dynamo would run the call as
    # plain Python, which _fused_flex refuses
    limit, accumulated, fail = (new if hasattr(cfg, new) else old for new, old in (
        ("recompile_limit", "cache_size_limit"), ("accumulated_recompile_limit", "accumulated_cache_size_limit"),
        ("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit")))
    limits = {limit: bound, accumulated: max(bound, getattr(cfg, accumulated)), fail: True}
    limit_hit = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None) or torch._dynamo.exc.FailOnCacheLimitHit
    note, dynamo_log = _LimitNote(), logging.getLogger("torch._dynamo.convert_frame")
    dynamo_log.addFilter(note)
    try:
        with cfg.patch(**limits):
            return compiled_flex_attention()(q, keys, values, block_mask)
    except limit_hit:
        raise DraftsmithError(
            f"flex attention: a graph past this run's bound of {bound} (Dynamo's recompile limit) is needed at q "
            f"{list(q.shape)}, keys {list(keys.shape)}, {'with' if torch.is_grad_enabled() else 'without'} grad "
            f"(failed guard: {note.reason or 'not logged'}); past it torch would run flex unfused ([B, H, L, "
            "(k+1)L] fp32 scores, out of memory at real widths): set train.attention: sdpa, and report this line"
        ) from None
    except _Unfused:
        raise DraftsmithError(
            "flex attention: torch ran it without compiling it (TORCHDYNAMO_DISABLE, torch._dynamo.config.disable "
            "or suppress_errors), the unfused path that materialises [B, H, L, (k+1)L] fp32 scores; unset that, "
            "or set train.attention: sdpa") from None
    finally:
        dynamo_log.removeFilter(note)


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
    document ids alone ([R, tiles, documents]; no [L, L] mask). Extended per TTT step k: one diagonal
    tile per query tile and later step (block_mask(k), cached for the layers of that step).
    The B rows of L tokens are padded to the FlexShape's R rows of Lp tokens (its length bucket, a
    multiple of 128), and each step's keys too, so that every step's keys start on a tile; the
    padding is a document of its own, which no real query sees, and a query tile of padding alone
    (a padded row, or the tiles past L) visits no key tile.
    """

    def __init__(self, doc_ids: torch.Tensor, shape: FlexShape) -> None:
        """shape: the run's FlexShape (ttt_forward's default: this batch's own rows and length)."""
        B, L = doc_ids.shape
        self.shape = shape
        if B > shape.rows:
            raise ValueError(f"flex attention: {B} rows, more than the {shape.rows} rows of its FlexShape")
        R, nb = shape.rows, shape.tiles(L)
        self.B, self.L, self.Lp = B, L, nb * FLEX_BLOCK
        device = doc_ids.device
        # documents renumbered 1..L per row by their first position (any ids, -1 padding included;
        # fixed-shape, no device->host read as torch.unique and a max would need); the padding is 0
        self.doc = torch.zeros(R, self.Lp, dtype=torch.long, device=device)
        self.doc[:B, :L] = first_positions(doc_ids) + 1
        present = torch.zeros(R, nb, L + 1, dtype=torch.bool, device=device)
        present.scatter_(2, self.doc.view(R, nb, FLEX_BLOCK), True)  # [R, tiles, documents]
        # a query tile sees a key tile before it iff they share a document (every j < i there);
        # fully iff both hold that one document only; its own tile is causal, so partly
        shared = torch.bmm(present.float(), present.float().transpose(1, 2)) > 0  # [R, nb, nb]
        single = present.sum(-1) == 1
        t = torch.arange(nb, device=device)
        below = t[:, None] > t[None, :]
        # [R, nb, 1]: query tiles holding a real token (rows < B, tiles < ceil(L / 128)); the others visit nothing
        self.real = ((torch.arange(R, device=device) < B)[:, None] & (t < -(-L // FLEX_BLOCK))[None, :])[..., None]
        self.full0 = below & shared & single[:, :, None] & single[:, None, :] & self.real
        self.partial0 = ((below & shared & ~self.full0) | (t[:, None] == t[None, :])) & self.real
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
            R, nb, _ = self.partial0.shape
            eye = torch.eye(nb, dtype=torch.bool, device=self.doc.device).expand(R, nb, nb) & self.real
            partial = torch.cat([self.partial0] + [eye] * k, dim=-1)  # [R, nb, (k+1)nb]
            full = torch.cat([self.full0] + [torch.zeros_like(eye)] * k, dim=-1)
            self._masks[k] = BlockMask.from_kv_blocks(
                *_ordered_tiles(partial), *_ordered_tiles(full), BLOCK_SIZE=FLEX_BLOCK,
                mask_mod=self.mask_mod, seq_lengths=(self.Lp, (k + 1) * self.Lp))
        return self._masks[k]

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """q [B, heads, L, d]; keys, values [B, kv_heads, (k+1)L, d] -> [B, heads, L, d]."""
        B, L, Lp, R = self.B, self.L, self.Lp, self.shape.rows
        steps = keys.shape[2] // L

        def padded(x: torch.Tensor, n: int) -> torch.Tensor:
            # [B, h, n*L, d] -> [R, h, n*Lp, d], contiguous and not a view (Dynamo guards a view's base: more
            # graphs); x itself when it is so already (the concatenated keys of full rows: no copy)
            if B == R and L == Lp:
                return x if x.is_contiguous() and x._base is None else x.clone(memory_format=torch.contiguous_format)
            out = x.new_zeros(R, x.shape[1], n * Lp, x.shape[3])  # zeros but for x, written through a view
            out.view(R, x.shape[1], n, Lp, x.shape[3])[:B, :, :, :L] = x.unflatten(2, (n, L))
            return out

        graphs = len(FLEX_GRAPHS)
        out = run_flex(padded(q, 1), padded(keys, steps), padded(values, steps), self.block_mask(steps - 1),
                       self.shape.graph_bound)
        if len(FLEX_GRAPHS) > graphs:  # this call compiled a graph: say at what
            FLEX_GRAPHS[-1] = (f"rows {R}, length {Lp}, keys {steps * Lp}, heads {q.shape[1]}/{keys.shape[1]}, "
                               f"{'with' if torch.is_grad_enabled() else 'without'} grad")
        return out[:B, :, :L]


def ttt_step_masks(doc_ids: torch.Tensor, attention: str, attn_block: int | None,
                   floors: list[int] | None, flex_shape: FlexShape | None = None) -> Callable[[int], Any]:
    """Step k's attention mask as a function of k, for doc_ids [B, L]; what Eagle3Attention takes.

    attention "flex": a FlexTTTMask of flex_shape, built once (its block mask grows by a diagonal per step);
    "sdpa" with attn_block: a TTTMask of that query block (floors: key_floors(doc_ids, attn_block)
    from the host, or None: read here from the device); "sdpa" with attn_block None: the dense
    bool mask [B, 1, L, (k+1)L], True = may attend.
    """
    if attention not in ATTENTION_PATHS:
        raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {attention!r}")
    if attention == "flex":
        if flex_shape is None:
            raise ValueError("attention flex needs a flex_shape")
        flex_mask = FlexTTTMask(doc_ids, flex_shape)
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
