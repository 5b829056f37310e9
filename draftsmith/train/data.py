"""Where the training samples come from and how they reach the loop.

Sources: `train.mode=offline` reads the target's hidden states from extract/ (OfflineSource);
`online` computes them with the target in this process from prepare/samples.jsonl (OnlineSource)
or, with `extract.backend=vllm`, gets them from vLLM server(s) (ServerSource). That is the only
difference between the modes: all three hand the loop the same Batch.

Packing: samples are packed into rows of `row_len` tokens (doc ids and per-document positions keep
packed samples apart), `rows_per_batch` rows per micro-batch; an optimizer step takes
`ranks x train.grad_accum` consecutive micro-batches, rank r the r-th, (r + world)-th, ...

To the device: a step's micro-batches are read, packed and given their host-side layout (the
sizes the loss needs, objective.ttt_layout) in the data thread (Prefetcher); on CUDA that thread
also pins them and copies them to the GPU on a side stream (DeviceFeeder), so the copy overlaps
the training step and the loop never waits on it.
"""

import bisect
import contextlib
import queue
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from draftsmith import DraftsmithError
from draftsmith.extract.codecs import Codec, codec_of
from draftsmith.extract.hf import make_batch, plan_batches
from draftsmith.extract.store import ExtractStore
from draftsmith.extract.vllm_backend import open_client, server_dtype
from draftsmith.http import SampleFailed
from draftsmith.prepared_format import iter_prepared
from draftsmith.released import Released, aux_layers, check_store_layers
from draftsmith.stage import recorded_target_fingerprint, upstream
from draftsmith.store_format import BF16
from draftsmith.target import load_target
from draftsmith.target.capture import HiddenCapture

# -------------------------------------------------------------------------------------------------
# Packing samples into rows and micro-batches


def pack_epoch(lengths: list[int], row_len: int, rows_per_batch: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """One epoch's micro-batches: a list of micro-batches, each a list of rows, each a list of
    sample indices whose lengths (capped at row_len) fit in row_len.

    Best-fit decreasing over the shuffled epoch (few padding tokens), then the rows are shuffled
    so that micro-batches mix long and short samples. Depends only on the lengths, the seed and
    the epoch: every rank and every resumed run computes the same plan.
    """
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = [i for i in torch.randperm(len(lengths), generator=g).tolist() if lengths[i] > 0]
    order.sort(key=lambda i: -min(lengths[i], row_len))  # stable: equal lengths keep the shuffle
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row index), sorted
    for i in order:
        n = min(lengths[i], row_len)
        k = bisect.bisect_left(free, (n, -1))  # the open row with the least room that fits
        if k < len(free):
            room, r = free.pop(k)
        else:
            rows.append([])
            room, r = row_len, len(rows) - 1
        rows[r].append(i)
        if room > n:
            bisect.insort(free, (room - n, r))
    rows = [rows[r] for r in torch.randperm(len(rows), generator=g).tolist()]
    return [rows[j:j + rows_per_batch] for j in range(0, len(rows), rows_per_batch)]


@dataclass
class Packing:
    """The packing of a run: rows of `row_len` tokens (train.seq_len, at most train.batch_tokens),
    `rows_per_batch` rows per micro-batch, a new order per epoch (pack_epoch)."""

    lengths: list[int]  # tokens per sample
    row_len: int
    rows_per_batch: int
    seed: int
    _plans: dict[int, list] = field(default_factory=dict, repr=False)

    @staticmethod
    def rows_of(tc) -> tuple[int, int]:
        """(row_len, rows_per_batch) of the train section `tc`."""
        row_len = min(tc.seq_len, tc.batch_tokens)
        return row_len, max(1, tc.batch_tokens // row_len)

    @classmethod
    def of(cls, lengths: list[int], tc) -> "Packing":
        return cls(lengths, *Packing.rows_of(tc), tc.seed)

    def plan(self, epoch: int) -> list[list[list[int]]]:
        """pack_epoch of this epoch, kept until another epoch is asked for."""
        if epoch not in self._plans:
            self._plans.clear()  # one epoch at a time is enough for a stream that only moves forward
            self._plans[epoch] = pack_epoch(self.lengths, self.row_len, self.rows_per_batch, self.seed, epoch)
        return self._plans[epoch]

    def micro_batches(self, epochs: float) -> int:
        """Micro-batches in `epochs` epochs (a fraction of the last one rounded)."""
        full, frac = int(epochs), epochs - int(epochs)
        n = sum(len(pack_epoch(self.lengths, self.row_len, self.rows_per_batch, self.seed, e)) for e in range(full))
        if frac > 0:
            n += round(frac * len(pack_epoch(self.lengths, self.row_len, self.rows_per_batch, self.seed, full)))
        return n


def count_steps(tc, packing: Packing, per_step: int) -> int:
    """The optimizer steps of the run: train.max_steps, else those train.epochs pack into
    (`per_step` micro-batches each: ranks x train.grad_accum)."""
    if tc.max_steps is not None:
        return tc.max_steps
    n_mb = packing.micro_batches(tc.epochs)
    if n_mb // per_step == 0:
        raise DraftsmithError(
            f"train.epochs: {tc.epochs} epoch(s) of {len(packing.lengths)} samples pack into {n_mb} micro-batches, "
            f"fewer than one optimizer step takes ({per_step} = ranks x train.grad_accum); set train.max_steps or "
            "lower train.batch_tokens")
    return n_mb // per_step


@dataclass
class Batch:
    """A packed micro-batch. R rows of T tokens; padding has doc id -1 and no loss mask.

    As packed by a source, the states stay encoded as their store format holds them (`codec`: its
    parts, e.g. fp8 values and scales) until they reach the device, where `to` decodes them. Why: on
    a GPU, from an fp8 store, that halves the host-to-device bytes against bf16 and takes the multiply
    off the host, whose one data thread per rank is what bounds offline training at Kimi-K2's widths
    (bench/bench_data_thread.py). Once moved (or when built with codec None) they are plain tensors.
    """

    input_ids: Any  # [R, T] int64
    loss_mask: Any  # [R, T] bool
    doc_ids: Any  # [R, T] int64, 0.. per row in packing order
    position_ids: Any  # [R, T] int64, restarting at 0 per document
    aux_hidden: Any  # [R, T, 3H] target states entering the aux layers, in layer order (encoded: parts [R, T, 3, ...])
    last_hidden: Any  # [R, T, H] the target's final normed state (encoded: parts [R, T, ...])
    samples: list[int]  # sample indices (source.name(i) gives the id)
    tokens: int  # real (non-padding) tokens
    layout: Any = None  # objective.TTTLayout: the loss's sizes, read on the host (None: the objective reads them)
    codec: Codec | None = None  # the store format's codec aux_hidden / last_hidden are encoded in (None: plain)
    host: Any = None  # the HostArena its host tensors were packed into (None: their own allocations)

    def states(self) -> list:
        """The tensors holding the states: the parts of each when encoded."""
        if self.codec is None:
            return [self.aux_hidden, self.last_hidden]
        return [*self.aux_hidden, *self.last_hidden]

    def tensors(self) -> list:
        return [self.input_ids, self.loss_mask, self.doc_ids, self.position_ids, *self.states()]

    def to(self, device, dtype, non_blocking: bool | None = None) -> "Batch":
        """The batch on `device`, its states in `dtype` (decoded there when encoded), aux [R, T, 3H].
        non_blocking (default: on CUDA) is only asynchronous from pinned memory (pin); from pageable
        memory the copy waits."""
        nb = device.type == "cuda" if non_blocking is None else non_blocking

        def moved(state):
            if self.codec is None:
                return state.to(device, dtype, non_blocking=nb)
            return self.codec.decode(tuple(p.to(device, non_blocking=nb) for p in state), dtype).flatten(2)
        return Batch(self.input_ids.to(device, non_blocking=nb), self.loss_mask.to(device, non_blocking=nb),
                     self.doc_ids.to(device, non_blocking=nb), self.position_ids.to(device, non_blocking=nb),
                     moved(self.aux_hidden), moved(self.last_hidden), self.samples, self.tokens, self.layout)

    def pin(self) -> "Batch":
        """The batch with its host tensors in pinned (page-locked) memory, which a non_blocking copy
        to the GPU reads asynchronously; tensors already pinned or on a device are left as they are."""
        def pinned(t):
            return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()

        def state(s):
            return pinned(s) if self.codec is None else tuple(pinned(p) for p in s)
        fields = ("input_ids", "loss_mask", "doc_ids", "position_ids")
        return replace(self, **{k: pinned(getattr(self, k)) for k in fields}, aux_hidden=state(self.aux_hidden),
                       last_hidden=state(self.last_hidden))


class HostArena:
    """One preallocated block of host memory that a micro-batch is packed into (pinned on CUDA, so
    that its copy to the GPU is asynchronous and no pageable-to-pinned copy of the states is made).
    `done` is the CUDA event its last copy to the device ends with: the block is reused only after it."""

    ALIGN = 64  # bytes: every tensor carved from the block starts on a cache line

    def __init__(self, nbytes: int, pin: bool):
        self.pin = pin
        self.block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.used = 0
        self.done = None

    def reset(self) -> "HostArena":
        if self.done is not None:
            self.done.synchronize()  # its previous batch's copy must have left this memory
            self.done = None
        self.used = 0
        return self

    def alloc(self, shape: tuple, dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor carved from the block."""
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // self.ALIGN) * self.ALIGN
        if start + nbytes > self.block.numel():
            raise ValueError(f"host arena of {self.block.numel()} bytes cannot hold {shape} {dtype}")
        self.used = start + nbytes
        return self.block[start:start + nbytes].view(dtype).view(shape)


class HostArenas:
    """Round-robin host arenas for the data thread, each sized on first use for the largest
    micro-batch this run packs (train.batch_tokens rows at the widest dtype), never grown after.
    `count` arenas: a step's micro-batches use `accum` of them, and the next step's are packed
    while this one's copy runs, so 2 x accum never waits on a copy in flight."""

    def __init__(self, count: int, pin: bool):
        self.count, self.pin = count, pin
        self.arenas: list[HostArena] = []
        self.next = 0

    def take(self, nbytes: int) -> HostArena:
        if len(self.arenas) < self.count:
            self.arenas.append(HostArena(nbytes, self.pin))
            return self.arenas[-1]
        i, self.next = self.next, (self.next + 1) % self.count  # the oldest: its copy is the likeliest done
        arena = self.arenas[i].reset()
        if arena.block.numel() < nbytes:  # a larger micro-batch than the one it was sized for
            arena = self.arenas[i] = HostArena(nbytes, self.pin)
        return arena


def packed_bytes(R: int, T: int, sample: dict) -> int:
    """Host bytes of a micro-batch of R rows of T tokens shaped like `sample` (aligned per tensor)."""
    per_token = 8 * 3 + 1  # input_ids, doc_ids, position_ids int64; loss_mask bool
    parts = [*sample["aux_hidden"], *sample["last_hidden"]]  # the encoded states' parts, [n, ...] each
    per_token += sum(p[0].numel() * p.element_size() for p in parts)
    return R * T * per_token + (4 + len(parts)) * HostArena.ALIGN


def pack_rows(rows: list[list[dict]], arena: HostArena | None = None, *, codec: Codec) -> Batch:
    """Samples (dicts with input_ids [L], loss_mask [L], index, and aux_hidden and last_hidden encoded by
    `codec`: its parts [L, ...] each), already cut to the row length, laid out row by row. T = the
    longest row. Into `arena` when given (its tensors are views of it), else into fresh tensors; only
    the padding is zeroed, not the whole batch."""
    first = rows[0][0]
    device = first["input_ids"].device
    R = len(rows)
    T = max(sum(len(s["input_ids"]) for s in row) for row in rows)

    def new(shape, dt):
        return arena.alloc(shape, dt) if arena is not None else torch.empty(shape, dtype=dt, device=device)

    input_ids, loss_mask = new((R, T), torch.long).zero_(), new((R, T), torch.bool).zero_()
    doc_ids, position_ids = new((R, T), torch.long).fill_(-1), new((R, T), torch.long).zero_()
    states = {k: tuple(new((R, T, *p.shape[1:]), p.dtype) for p in first[k]) for k in ("aux_hidden", "last_hidden")}
    ids, tokens = [], 0
    for r, row in enumerate(rows):
        off = 0
        for d, s in enumerate(row):
            n = len(s["input_ids"])
            input_ids[r, off:off + n] = s["input_ids"]
            loss_mask[r, off:off + n] = s["loss_mask"]
            doc_ids[r, off:off + n] = d
            position_ids[r, off:off + n] = torch.arange(n, device=device)
            for k, packed in states.items():
                for t, p in zip(packed, s[k]):
                    t[r, off:off + n] = p
            ids.append(s["index"])
            off += n
        for packed in states.values():
            for t in packed:
                t[r, off:].zero_()  # padding: zero parts, which every codec decodes to zero states
        tokens += off
    return Batch(input_ids, loss_mask, doc_ids, position_ids, states["aux_hidden"], states["last_hidden"], ids, tokens,
                 codec=codec, host=arena)


# -------------------------------------------------------------------------------------------------
# Upstream: what the mode reads, checked against the target and the config


def _check_store(run, cfg, info, store: ExtractStore, rel: Released | None) -> list[int]:
    """The aux layers of the extract store, refusing a store of another target, other layers (than extract.layers, or
    than the released drafter `rel` reads), another hidden size or other prepared data than the current ones."""
    meta = store.meta
    where = run.stage_dir("extract", create=False) / "meta.json"
    fp = recorded_target_fingerprint(meta)
    if fp is not None and fp != info.fingerprint:
        raise DraftsmithError(f"{where}: hidden states of another target (fingerprint {fp}) than the configured "
                              f"target {info.name} ({info.fingerprint}); rerun `draftsmith extract --run {run.path}`")
    layers = [int(x) for x in meta.get("layers") or []]
    info.check_layers(layers, field=f"{where}: layers")
    if cfg.extract.layers is not None and list(cfg.extract.layers) != layers:
        raise DraftsmithError(f"extract.layers: {list(cfg.extract.layers)} differs from the layers {layers} that "
                              f"{where} was extracted with; rerun `draftsmith extract --run {run.path}`")
    check_store_layers(rel, layers, where)
    if int(meta.get("hidden_size", info.hidden_size)) != info.hidden_size:
        raise DraftsmithError(f"{where}: hidden_size {meta.get('hidden_size')} but target {info.name} has "
                              f"{info.hidden_size}")
    prepare_manifest = run.read_manifest("prepare")
    stored_fp = meta.get("prepare_fingerprint")  # of the prepared data the store was extracted from
    if stored_fp is None and isinstance(meta.get("prepare"), dict):
        stored_fp = meta["prepare"].get("fingerprint")
    if prepare_manifest is not None and stored_fp is not None and stored_fp != prepare_manifest.get("fingerprint"):
        raise DraftsmithError(f"{where}: extracted from other prepared data than the current prepare stage; "
                              f"rerun `draftsmith extract --run {run.path}`")
    if len(store) == 0:
        raise DraftsmithError(f"{where}: the extract store holds no samples")
    return layers


def open_upstream(run, cfg, info, rel: Released | None = None
                  ) -> tuple[list[int], dict[str, dict], ExtractStore | None]:
    """(aux layers, upstream manifests by stage, the extract store or None) for train.mode, refusing missing or
    mismatched inputs; `rel`: the released drafter the run starts from, whose aux layers it reads."""
    if cfg.train.mode == "offline":
        extract_manifest = upstream(run, "extract", by="draftsmith train (train.mode=offline; or use --mode online)",
                                    target=info)
        store = ExtractStore(run)
        return _check_store(run, cfg, info, store, rel), {"extract": extract_manifest}, store
    prepare_manifest = upstream(run, "prepare", by="draftsmith train (train.mode=online)", target=info)
    return aux_layers(cfg, info, rel), {"prepare": prepare_manifest}, None


# -------------------------------------------------------------------------------------------------
# Data sources: the only difference between the modes


class OfflineSource:
    """Samples from the extract store (hidden states on disk)."""

    mode = "offline"  # train.mode
    prefetch = True  # file reads overlap the training step

    def __init__(self, store: ExtractStore):
        self.store = store
        self.lengths = [int(n) for n in store.lengths]

    def sample(self, i: int, row_len: int) -> dict:
        """Sample i cut to row_len, its states as stored (the store's codec decodes them on the training
        device, in Batch.to)."""
        n = min(self.lengths[i], row_len)
        rec, states = self.store.states(i)
        return {
            "input_ids": torch.as_tensor(rec["input_ids"])[:n].long(),
            "loss_mask": torch.as_tensor(rec["loss_mask"])[:n].bool(),
            "aux_hidden": tuple(p[:n] for p in states["aux"]),
            "last_hidden": tuple(p[:n] for p in states["last"]),
            "index": i,
        }

    def name(self, i: int) -> str:
        return str(self.store.metadata(i).get("id", i))

    def sample_ids(self) -> list[str]:
        """Every sample's id: from the store's meta.json (stores extracted since it records them), else
        from each file's own metadata (one header read per file)."""
        ids = self.store.meta.get("ids")
        if isinstance(ids, list) and len(ids) == len(self.lengths):
            return [str(x) for x in ids]
        return [self.name(i) for i in range(len(self.lengths))]

    def damaged(self, i: int) -> str | None:
        """What is wrong with sample i's stored states, naming its file (None: all finite). Read on
        the failure path only (the loop checks a whole micro-batch on the device)."""
        rec = self.store[i]
        if all(bool(torch.isfinite(torch.as_tensor(rec[k]).float()).all()) for k in ("aux_hidden", "last_hidden")):
            return None
        return f"{self.store.path(i)}: the stored hidden states of sample {self.name(i)!r} hold non-finite values"

    def batch(self, rows: list[list[int]], row_len: int, arenas: "HostArenas | None" = None) -> Batch:
        samples = [[self.sample(i, row_len) for i in row] for row in rows]
        # the arena is sized for full rows of row_len, so that one block fits every micro-batch of the run
        arena = arenas.take(packed_bytes(len(rows), row_len, samples[0][0])) if arenas is not None else None
        return pack_rows(samples, arena, codec=self.store.codec)

    def close(self) -> None:
        """Nothing to release: the store's files are opened per read."""


class PreparedSource:
    """Samples from prepare/samples.jsonl, their hidden states computed as they are needed: what
    the two online sources share. A subclass gives `states` (and `prefetch`, `close`); batches
    are packed on `device`."""

    def __init__(self, run, device):
        self.device = device
        self.ids, self.masks, self.names = [], [], []
        for i, rec, ids, mask in iter_prepared(run):
            self.ids.append(ids)
            self.masks.append(mask)
            self.names.append(str(rec.get("id", i)))
        self.lengths = [len(x) for x in self.ids]

    def name(self, i: int) -> str:
        return self.names[i]

    def sample_ids(self) -> list[str]:
        return list(self.names)

    def damaged(self, i: int) -> str | None:
        """Nothing is stored: non-finite states here are the target's own (see the loop's error)."""
        return None

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
        """{i: {aux_hidden [n, 3, H], last_hidden [n, H]}} (bf16) for samples cut to row_len."""
        raise NotImplementedError

    def batch(self, rows: list[list[int]], row_len: int, arenas: "HostArenas | None" = None) -> Batch:
        dev = self.device
        states = self.states(sorted({i for row in rows for i in row}), row_len)
        samples = []
        for row in rows:
            samples.append([])
            for i in row:
                n = min(self.lengths[i], row_len)
                samples[-1].append({
                    "input_ids": torch.from_numpy(self.ids[i][:n]).to(dev),
                    "loss_mask": torch.from_numpy(self.masks[i][:n]).to(dev),
                    "aux_hidden": (states[i]["aux_hidden"].to(dev),),  # bf16 states: BF16's one part
                    "last_hidden": (states[i]["last_hidden"].to(dev),),
                    "index": i,
                })
        on_host = arenas is not None and dev.type == "cpu"
        return pack_rows(samples, arenas.take(packed_bytes(len(rows), row_len, samples[0][0])) if on_host else None,
                         codec=codec_of(BF16))


class OnlineSource(PreparedSource):
    """Prepared samples whose hidden states the target computes in-process with extract's capture
    (so they equal what extract would store: bf16, same layers)."""

    mode = "online"
    prefetch = False  # the target's forwards share the cores with training: no overlap to gain

    def __init__(self, run, target, layers: list[int], batch_tokens: int):
        super().__init__(run, target.device)
        self.target, self.batch_tokens = target, batch_tokens
        self.capture = HiddenCapture(target.model, layers)

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
        """The target's states of these samples (cut to row_len), computed here in padded batches."""
        states: dict[int, dict] = {}
        # the one length grouper, extract's: the same padded batches as an extraction of these samples
        for group in plan_batches(indices, [min(n, row_len) for n in self.lengths], self.batch_tokens):
            ids, pos = make_batch([{"input_ids": self.ids[i][:row_len]} for i in group])
            with torch.inference_mode():
                aux, last = self.capture(ids.to(self.device), pos.to(self.device))  # [B, T, 3, H], [B, T, H]
            for b, i in enumerate(group):
                n = min(self.lengths[i], row_len)
                # bf16 like the extract store, so both modes train on the same numbers
                states[i] = {"aux_hidden": aux[b, :n].to(torch.bfloat16), "last_hidden": last[b, :n].to(torch.bfloat16)}
        return states

    def close(self) -> None:
        """Nothing to release: the target goes with the process."""


class ServerSource(PreparedSource):
    """train.mode=online with extract.backend=vllm: prepared samples whose states come from vLLM
    server(s), as the vllm extract backend gets them (draftsmith/extract/vllm_backend.py), for a
    target too big to run here. Nothing is stored: each file the server writes is deleted as soon
    as it is read, so the disk holds at most extract.concurrency of them; the Prefetcher keeps the
    server busy with the next step's samples while this one trains."""

    mode = "online"
    prefetch = True

    def __init__(self, run):
        super().__init__(run, torch.device("cpu"))
        self._stack = contextlib.ExitStack()
        self.client = None

    def start(self, cfg, info, layers: list[int], row_len: int, world: int, log, folder: Path) -> "ServerSource":
        """Connect to extract.servers, or start a server (its log and file buffer under `folder`)."""
        if world > 1 and not cfg.extract.servers:
            raise DraftsmithError(f"extract.servers: train.mode=online with extract.backend=vllm on {world} ranks "
                                  "needs running servers that the ranks share (each rank would start its own)")
        max_len = min(max(self.lengths), row_len)
        self.client = self._stack.enter_context(open_client(cfg, info, layers, folder, max_len, log))
        return self

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
        """The server's states of these samples (cut to row_len), in bf16 like the other sources."""
        out = {}
        for i, res in self.client.map((i, self.ids[i][:row_len].tolist()) for i in indices):
            if isinstance(res, SampleFailed):
                raise DraftsmithError(f"train: no hidden states for sample {self.names[i]} from the vLLM server(s) "
                                      f"after {res.attempts} attempt(s): {res}")
            aux, last = res  # [n, 3, H], [n, H] in the server's dtype
            out[i] = {"aux_hidden": aux.to(torch.bfloat16), "last_hidden": last.to(torch.bfloat16)}
        return out

    def close(self) -> None:
        """Stops the vLLM server draftsmith started and removes its file buffer."""
        self._stack.close()


def served_states(cfg) -> dict | None:
    """What the run's fingerprint records of states that come from a vLLM server (train.mode=online with
    extract.backend=vllm: the dtype the server computes in, the connector); None for states from the store or this
    process's forward."""
    if cfg.train.mode == "online" and cfg.extract.backend == "vllm":
        return {"source": "vllm", "dtype": server_dtype(cfg), "connector": cfg.extract.connector}
    return None


def open_source(run, cfg, info, layers: list[int], store: ExtractStore | None, device, world: int, folder: Path, log):
    """The source of train.mode (and, online, extract.backend); `folder`: the stage's folder."""
    tc = cfg.train
    if tc.mode == "offline":
        return OfflineSource(store)
    if cfg.extract.backend == "vllm":
        return ServerSource(run).start(cfg, info, layers, min(tc.seq_len, tc.batch_tokens), world, log, folder)
    log(f"loading target {info.name} for online hidden states (layers {layers})")
    target = load_target(cfg.target, device=str(device), dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code,
                         log=log)
    return OnlineSource(run, target, layers, cfg.extract.batch_tokens)


# -------------------------------------------------------------------------------------------------
# The stream of optimizer steps


def micro_batch_stream(plan_of, epoch: int, index: int) -> Iterator[tuple[int, int, list[list[int]]]]:
    """(epoch, index, rows) of every micro-batch from position (epoch, index) on, endlessly."""
    while True:
        plan = plan_of(epoch)
        for j in range(index, len(plan)):
            yield epoch, j, plan[j]
        epoch, index = epoch + 1, 0


def step_batches(stream, source, rank: int, world: int, accum: int, row_len: int,
                 prepare: Callable[[Batch], Batch] | None = None,
                 arenas: HostArenas | None = None) -> Iterator[tuple[tuple[int, int], list[Batch]]]:
    """Per optimizer step: the data position after it and this rank's micro-batches (each passed
    through `prepare`, while still on the host, when given), packed into `arenas` when given and
    the source packs on the host.

    A step consumes world*accum consecutive micro-batches of the stream; rank r takes r, r+world, ...
    """
    while True:
        group = [next(stream) for _ in range(world * accum)]
        mine = [source.batch(rows, row_len, arenas) for _, _, rows in group[rank::world]]
        if prepare is not None:
            mine = [prepare(b) for b in mine]
        epoch, index, _ = group[-1]
        yield (epoch, index + 1), mine


class DeviceFeeder:
    """Moves a step's micro-batches, (position, [Batch]), to the training device.

    On CUDA, `send` runs in the data thread: the source has packed each batch into a pinned host
    arena (`arenas`, reused round-robin), copied from there to the GPU on a side stream with
    non_blocking=True (from pageable memory such a copy would wait, and on the training stream it
    would queue behind the step), the states decoded there, then an event is recorded on the
    side stream after the step's copies; the arenas are reused only after it. `receive` runs in the
    training thread: the current stream waits for that event (on the GPU; the host does not wait)
    and every tensor is record_stream'ed on it, because its memory was allocated on the side
    stream, whose next allocations could otherwise reuse it while the training stream still reads it.
    Elsewhere (the CPU): `send` is the plain .to(device, dtype) of before, `receive` nothing.
    """

    def __init__(self, device, dtype, accum: int = 1):
        self.device, self.dtype, self.stream, self.arenas = torch.device(device), dtype, None, None
        if self.device.type == "cuda":
            # the index now, from the training thread: the data thread's current device is GPU 0
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.stream = torch.cuda.Stream(self.device)
            self.arenas = HostArenas(2 * accum, pin=True)

    def send(self, item: tuple) -> tuple:
        """(position, [Batch] on the host) -> (position, [Batch] on the device, the event their copies end with
        or None)."""
        position, micro_batches = item
        if self.stream is None:
            return position, [b.to(self.device, self.dtype) for b in micro_batches], None
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            moved = [b.pin().to(self.device, self.dtype, non_blocking=True) for b in micro_batches]
            copied = torch.cuda.Event()
            copied.record(self.stream)
        for b in micro_batches:
            if b.host is not None:
                b.host.done = copied
        return position, moved, copied

    def receive(self, sent: tuple) -> tuple:
        """send's result -> (position, [Batch]) ready for the current stream."""
        position, micro_batches, copied = sent
        if copied is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(copied)
            for b in micro_batches:
                for t in b.tensors():
                    t.record_stream(current)
        return position, micro_batches

class Prefetcher:
    """Runs an iterator in a background thread, `depth` items ahead (file reads and packing
    overlap the training step; torch releases the GIL).

    feeder: a DeviceFeeder whose `send` runs in the thread on each item and `receive` in the
    consumer. With a side stream (CUDA) at most `on_device` items are on the device at once (the
    one training and the next), as each holds a step's states in GPU memory.
    """

    def __init__(self, it: Iterator, depth: int = 2, feeder: DeviceFeeder | None = None, on_device: int = 2):
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._feeder = feeder
        self._slots = threading.Semaphore(on_device) if feeder is not None and feeder.stream is not None else None
        self._handed = False  # an item was handed on: the next __next__ frees its device slot
        self._thread = threading.Thread(target=self._work, args=(it,), name="train-data", daemon=True)
        self._thread.start()

    def _put(self, entry: tuple) -> bool:
        """Queue an entry unless the consumer has stopped reading (then drop it: close() joins us)."""
        while not self._stop.is_set():
            try:
                self._q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _slot(self) -> bool:
        """Wait for room on the device (with a side stream) unless the consumer has stopped."""
        while self._slots is not None and not self._stop.is_set():
            if self._slots.acquire(timeout=0.1):
                return True
        return not self._stop.is_set()

    def _work(self, it: Iterator) -> None:
        try:
            for item in it:
                if self._feeder is not None:
                    if not self._slot():
                        return
                    item = self._feeder.send(item)
                if not self._put(("ok", item)):
                    return
        except BaseException as e:  # handed to the consumer, raised there (unless it has stopped reading)
            self._put(("error", e))

    def __iter__(self):
        return self

    def __next__(self):
        if self._slots is not None and self._handed:
            self._slots.release()  # the consumer is done with the item it had (its memory is record_stream'ed)
        kind, item = self._q.get()
        if kind == "error":
            raise item
        self._handed = True
        return self._feeder.receive(item) if self._feeder is not None else item

    def close(self) -> None:
        # Join, not just signal: a daemon thread still inside torch when the interpreter exits can
        # abort the process ("terminate called without an active exception") after the work is done.
        self._stop.set()
        self._thread.join(timeout=60)


def step_stream(packing: Packing, source, position: tuple[int, int], rank: int, world: int, accum: int,
                prepare: Callable[[Batch], Batch] | None = None, feeder: DeviceFeeder | None = None):
    """This rank's micro-batches of every optimizer step from data position (epoch, micro-batch)
    on, each through `prepare` on the host, then moved by `feeder` (when given) to the device;
    read ahead in a thread when the source gains from it. Whichever it is, close it with .close()
    when done (a Prefetcher's joins its thread; a generator's just ends it)."""
    stream = micro_batch_stream(packing.plan, *position)
    arenas = feeder.arenas if feeder is not None and source.prefetch else None
    steps = step_batches(stream, source, rank, world, accum, packing.row_len, prepare, arenas)
    if source.prefetch:
        return Prefetcher(steps, feeder=feeder)
    if feeder is None:
        return steps
    # the online target computes the states on the training device itself: a plain move there,
    # on the current stream (a side stream would not wait for the target's forwards)
    return ((pos, [b.to(feeder.device, feeder.dtype) for b in micro_batches]) for pos, micro_batches in steps)
