"""Where the training samples come from and how they reach the loop.

Sources: `train.mode=offline` reads the target's hidden states from extract/ (OfflineSource);
`online` computes them with the target in this process from prepare/samples.jsonl (OnlineSource)
or, with `extract.backend=vllm`, gets them from vLLM server(s) (ServerSource). That is the only
difference between the modes: all three hand the loop the same Batch.

Packing: samples are packed into rows of `row_len` tokens (doc ids and per-document positions keep
packed samples apart), `rows_per_batch` rows per micro-batch; an optimizer step takes
`ranks x train.grad_accum` consecutive micro-batches, rank r the r-th, (r + world)-th, ...
"""

import bisect
import contextlib
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from draftsmith import DraftsmithError
from draftsmith.extract.hf import HiddenCapture, make_batch, plan_batches
from draftsmith.extract.store import ExtractStore
from draftsmith.extract.vllm_backend import open_client
from draftsmith.http import SampleFailed
from draftsmith.prepare import iter_prepared
from draftsmith.stage import recorded_target_fingerprint, upstream
from draftsmith.target import load_target

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

    @classmethod
    def of(cls, lengths: list[int], tc) -> "Packing":
        row_len = min(tc.seq_len, tc.batch_tokens)
        return cls(lengths, row_len, max(1, tc.batch_tokens // row_len), tc.seed)

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
            f"train.epochs: {tc.epochs} epoch(s) of {len(packing.lengths)} samples pack into {n_mb} micro-batches, fewer than one "
            f"optimizer step takes ({per_step} = ranks x train.grad_accum); set train.max_steps or lower train.batch_tokens")
    return n_mb // per_step


@dataclass
class Batch:
    """A packed micro-batch. R rows of T tokens; padding has doc id -1 and no loss mask."""

    input_ids: Any  # [R, T] int64
    loss_mask: Any  # [R, T] bool
    doc_ids: Any  # [R, T] int64, 0.. per row in packing order
    position_ids: Any  # [R, T] int64, restarting at 0 per document
    aux_hidden: Any  # [R, T, 3H] target states entering the aux layers, in layer order
    last_hidden: Any  # [R, T, H] the target's final normed state
    samples: list[int]  # sample indices (source.name(i) gives the id)
    tokens: int  # real (non-padding) tokens

    def to(self, device, dtype) -> "Batch":
        nb = device.type == "cuda"
        return Batch(self.input_ids.to(device, non_blocking=nb), self.loss_mask.to(device, non_blocking=nb),
                     self.doc_ids.to(device, non_blocking=nb), self.position_ids.to(device, non_blocking=nb),
                     self.aux_hidden.to(device, dtype, non_blocking=nb), self.last_hidden.to(device, dtype, non_blocking=nb),
                     self.samples, self.tokens)


def pack_rows(rows: list[list[dict]]) -> Batch:
    """Samples (dicts with input_ids [L], loss_mask [L], aux_hidden [L, 3H], last_hidden [L, H],
    index), already cut to the row length, laid out row by row. T = the longest row."""
    first = rows[0][0]
    device, dtype = first["aux_hidden"].device, first["aux_hidden"].dtype
    R = len(rows)
    T = max(sum(len(s["input_ids"]) for s in row) for row in rows)
    A, H = first["aux_hidden"].shape[-1], first["last_hidden"].shape[-1]
    input_ids = torch.zeros(R, T, dtype=torch.long, device=device)
    loss_mask = torch.zeros(R, T, dtype=torch.bool, device=device)
    doc_ids = torch.full((R, T), -1, dtype=torch.long, device=device)
    position_ids = torch.zeros(R, T, dtype=torch.long, device=device)
    aux = torch.zeros(R, T, A, dtype=dtype, device=device)
    last = torch.zeros(R, T, H, dtype=dtype, device=device)
    ids, tokens = [], 0
    for r, row in enumerate(rows):
        off = 0
        for d, s in enumerate(row):
            n = len(s["input_ids"])
            input_ids[r, off:off + n] = s["input_ids"]
            loss_mask[r, off:off + n] = s["loss_mask"]
            doc_ids[r, off:off + n] = d
            position_ids[r, off:off + n] = torch.arange(n, device=device)
            aux[r, off:off + n] = s["aux_hidden"]
            last[r, off:off + n] = s["last_hidden"]
            ids.append(s["index"])
            off += n
        tokens += off
    return Batch(input_ids, loss_mask, doc_ids, position_ids, aux, last, ids, tokens)


# -------------------------------------------------------------------------------------------------
# Upstream: what the mode reads, checked against the target and the config


def _check_store(run, cfg, info, store: ExtractStore) -> list[int]:
    """The aux layers of the extract store, refusing a store of another target, other layers,
    another hidden size or other prepared data than the current ones."""
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
    if int(meta.get("hidden_size", info.hidden_size)) != info.hidden_size:
        raise DraftsmithError(f"{where}: hidden_size {meta.get('hidden_size')} but target {info.name} has {info.hidden_size}")
    prep = run.read_manifest("prepare")
    pfp = meta.get("prepare_fingerprint")
    if pfp is None and isinstance(meta.get("prepare"), dict):
        pfp = meta["prepare"].get("fingerprint")
    if prep is not None and pfp is not None and pfp != prep.get("fingerprint"):
        raise DraftsmithError(f"{where}: extracted from other prepared data than the current prepare stage; "
                              f"rerun `draftsmith extract --run {run.path}`")
    if len(store) == 0:
        raise DraftsmithError(f"{where}: the extract store holds no samples")
    return layers


def open_upstream(run, cfg, info) -> tuple[list[int], dict[str, dict], ExtractStore | None]:
    """(aux layers, upstream manifests by stage, the extract store or None) for train.mode,
    refusing missing or mismatched inputs."""
    if cfg.train.mode == "offline":
        em = upstream(run, "extract", by="draftsmith train (train.mode=offline; or use --mode online)", target=info)
        store = ExtractStore(run)
        return _check_store(run, cfg, info, store), {"extract": em}, store
    prep = upstream(run, "prepare", by="draftsmith train (train.mode=online)", target=info)
    layers = info.check_layers(list(cfg.extract.layers) if cfg.extract.layers is not None else info.default_aux_layers())
    return layers, {"prepare": prep}, None


# -------------------------------------------------------------------------------------------------
# Data sources: the only difference between the modes


class OfflineSource:
    """Samples from the extract store (hidden states on disk)."""

    prefetch = True  # file reads overlap the training step

    def __init__(self, store: ExtractStore):
        self.store = store
        self.lengths = [int(n) for n in store.lengths]

    def sample(self, i: int, row_len: int) -> dict:
        rec = self.store[i]
        n = min(self.lengths[i], row_len)
        aux = torch.as_tensor(rec["aux_hidden"])[:n]
        return {
            "input_ids": torch.as_tensor(rec["input_ids"])[:n].long(),
            "loss_mask": torch.as_tensor(rec["loss_mask"])[:n].bool(),
            "aux_hidden": aux.reshape(n, -1),  # [L, 3, H] -> [L, 3H], layer-major like fc expects
            "last_hidden": torch.as_tensor(rec["last_hidden"])[:n],
            "index": i,
        }

    def name(self, i: int) -> str:
        return str(self.store.metadata(i).get("id", i))

    def batch(self, rows: list[list[int]], row_len: int) -> Batch:
        return pack_rows([[self.sample(i, row_len) for i in row] for row in rows])

    def close(self) -> None:
        """Nothing to release: the store's files are opened per read."""


class OnlineSource:
    """Samples from prepare/samples.jsonl, their hidden states computed by the target in-process
    with extract's capture (so they equal what extract would store: bf16, same layers)."""

    prefetch = False  # the target's forwards share the cores with training: no overlap to gain

    def __init__(self, run, target, layers: list[int], batch_tokens: int):
        self.target, self.batch_tokens, self.device = target, batch_tokens, target.device
        self.capture = HiddenCapture(target.model, layers)
        self.read_prepared(run)

    def read_prepared(self, run) -> None:
        self.ids, self.masks, self.names = [], [], []
        for i, rec, ids, mask in iter_prepared(run):
            self.ids.append(ids)
            self.masks.append(mask)
            self.names.append(str(rec.get("id", i)))
        self.lengths = [len(x) for x in self.ids]

    def name(self, i: int) -> str:
        return self.names[i]

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
        """{i: {aux_hidden [n, 3, H], last_hidden [n, H]}} (bf16) for samples cut to row_len."""
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

    def batch(self, rows: list[list[int]], row_len: int) -> Batch:
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
                    "aux_hidden": states[i]["aux_hidden"].to(dev).reshape(n, -1),
                    "last_hidden": states[i]["last_hidden"].to(dev),
                    "index": i,
                })
        return pack_rows(samples)

    def close(self) -> None:
        """Nothing to release: the target goes with the process."""


class ServerSource(OnlineSource):
    """train.mode=online with extract.backend=vllm: the states come from vLLM server(s), as the
    vllm extract backend gets them (draftsmith/extract/vllm_backend.py), for a target too big to run
    here. Nothing is stored: each file the server writes is deleted as soon as it is read, so
    the disk holds at most extract.concurrency of them; the Prefetcher keeps the server busy
    with the next step's samples while this one trains."""

    prefetch = True

    def __init__(self, run):
        self.device = torch.device("cpu")
        self.read_prepared(run)
        self._stack = contextlib.ExitStack()
        self.client = None

    def start(self, cfg, info, layers: list[int], row_len: int, world: int, log, folder: Path) -> "ServerSource":
        """Connect to extract.servers, or start a server (its log and file buffer under `folder`)."""
        if world > 1 and not cfg.extract.servers:
            raise DraftsmithError(f"extract.servers: train.mode=online with extract.backend=vllm on {world} ranks needs "
                                  "running servers that the ranks share (each rank would start its own)")
        max_len = min(max(self.lengths), row_len)
        self.client = self._stack.enter_context(open_client(cfg, info, layers, folder, max_len, log))
        return self

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
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


def open_source(run, cfg, info, layers: list[int], store: ExtractStore | None, device, world: int, folder: Path, log):
    """The source of train.mode (and, online, extract.backend); `folder`: the stage's folder."""
    tc = cfg.train
    if tc.mode == "offline":
        return OfflineSource(store)
    if cfg.extract.backend == "vllm":
        return ServerSource(run).start(cfg, info, layers, min(tc.seq_len, tc.batch_tokens), world, log, folder)
    log(f"loading target {info.name} for online hidden states (layers {layers})")
    target = load_target(cfg.target, device=str(device), dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, log=log)
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


def step_batches(stream, source, rank: int, world: int, accum: int, row_len: int) -> Iterator[tuple[tuple[int, int], list[Batch]]]:
    """Per optimizer step: the data position after it and this rank's micro-batches.

    A step consumes world*accum consecutive micro-batches of the stream; rank r takes r, r+world, ...
    """
    while True:
        group = [next(stream) for _ in range(world * accum)]
        mine = [source.batch(rows, row_len) for _, _, rows in group[rank::world]]
        epoch, index, _ = group[-1]
        yield (epoch, index + 1), mine


class Prefetcher:
    """Runs an iterator in a background thread, `depth` items ahead (file reads and packing
    overlap the training step; torch releases the GIL)."""

    def __init__(self, it: Iterator, depth: int = 2):
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
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

    def _work(self, it: Iterator) -> None:
        try:
            for item in it:
                if not self._put(("ok", item)):
                    return
        except BaseException as e:  # handed to the consumer, raised there (unless it has stopped reading)
            self._put(("error", e))

    def __iter__(self):
        return self

    def __next__(self):
        kind, item = self._q.get()
        if kind == "error":
            raise item
        return item

    def close(self) -> None:
        # Join, not just signal: a daemon thread still inside torch when the interpreter exits can
        # abort the process ("terminate called without an active exception") after the work is done.
        self._stop.set()
        self._thread.join(timeout=60)


def step_stream(packing: Packing, source, position: tuple[int, int], rank: int, world: int, accum: int):
    """This rank's micro-batches of every optimizer step from data position (epoch, micro-batch)
    on, read ahead in a thread when the source gains from it (close it with .close() then)."""
    stream = micro_batch_stream(packing.plan, *position)
    steps = step_batches(stream, source, rank, world, accum, packing.row_len)
    return Prefetcher(steps) if source.prefetch else steps
