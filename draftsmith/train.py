"""The `train` stage: fit the EAGLE-3 drafter to the target with training-time test (TTT).

Data. `train.mode=offline` reads the target's hidden states from extract/ (ExtractStore);
`online` runs the target in this process on prepare/samples.jsonl and writes nothing but
train/ (with `extract.backend=vllm` the states stream from vLLM server(s) instead, through a
buffer of at most extract.concurrency files, each deleted once read). All feed the same loop:
samples are packed into rows of `train.seq_len` tokens (doc ids and per-document positions keep
packed samples apart), `train.batch_tokens // seq_len` rows per micro-batch, `train.grad_accum`
micro-batches per rank per optimizer step.

Objective. The drafter is unrolled for `train.ttt_steps` steps (Eagle3Drafter.ttt_forward); step
k at index i predicts token t[i+2+k]. Its target is the target model's own next-token
distribution there, softmax(W_d @ last_hidden[i+1+k]) over the draft vocabulary (W_d = rows of
the target's lm_head at the draft ids, [Dv, H]). The loss is the forward KL(target || drafter),
averaged over the positions where it is defined (i+2+k inside the row and the same document,
loss_mask[i+2+k] = 1, t[i+2+k] in the draft vocabulary) across the whole optimizer step and all
ranks, weighted gamma**k per step. Accuracy at step k counts the d2t-mapped argmax == t[i+2+k]
over every loss-masked position (tokens outside the draft vocabulary are misses), so that
1 + sum_k prod_{j<=k} acc_j estimates the acceptance length of chain drafting.

Outputs (docs/run-directory.md, train/):
    checkpoints/step_{N}/   model.safetensors, drafter.json, optimizer.pt, rng.safetensors,
                            state.json (written last; a folder is complete when it has it);
                            built as a hidden temporary folder and renamed into place
    final/                  the last weights, same format
    metrics.jsonl           one line per log interval
    tb/                     TensorBoard events (train.tensorboard)
A run killed at any point resumes from its newest checkpoint to the same final weights as a run
never interrupted (model, optimizer, scheduler, data position and RNG are all restored).

Distributed: `torchrun --nproc-per-node N -m draftsmith -- train --run DIR ...` runs DDP (gloo on CPU, NCCL
on GPUs) or FSDP (`train.fsdp`); rank r takes micro-batches r, r+N, ... of each optimizer step,
so N ranks at batch b compute the same update as one rank at batch N*b.
"""

import bisect
import contextlib
import json
import math
import os
import queue
import shutil
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

from draftsmith import DraftsmithError
from draftsmith.progress import journal_failures
from draftsmith.export import FC_INPUT_SCALE  # train.fc_input_norm's factor in a checkpoint
from draftsmith.rundir import append_text, naming_full_disk, replace_dir

STAGE = "train"
TRAIN_VERSION = 1
CKPT_WEIGHTS, CKPT_META, CKPT_OPTIM, CKPT_RNG, CKPT_STATE = (
    "model.safetensors", "drafter.json", "optimizer.pt", "rng.safetensors", "state.json")
# Settings that change how a run is watched, stored or sharded, not what it computes: left out
# of the fingerprint, so that changing one resumes the run instead of restarting it.
NOT_FINGERPRINTED = ("log_every_s", "tensorboard", "checkpoint_every", "keep_checkpoints", "fsdp", "processes")
# knobs added after runs were made, with their defaults
LATER_KNOBS = {"freeze_lm_head": False, "max_minutes": None}
ADAM_BETAS = (0.9, 0.95)



# -------------------------------------------------------------------------------------------------
# Packing samples into rows and micro-batches


def pack_epoch(lengths: list[int], row_len: int, rows_per_batch: int, seed: int, epoch: int) -> list[list[list[int]]]:
    """One epoch's micro-batches: a list of micro-batches, each a list of rows, each a list of
    sample indices whose lengths (capped at row_len) fit in row_len.

    Best-fit decreasing over the shuffled epoch (few padding tokens), then the rows are shuffled
    so that micro-batches mix long and short samples. Depends only on the lengths, the seed and
    the epoch: every rank and every resumed run computes the same plan.
    """
    import torch

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
    import torch

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
# Data sources: the only difference between the two modes


class OfflineSource:
    """Samples from the extract store (hidden states on disk)."""

    prefetch = True  # file reads overlap the training step

    def __init__(self, store):
        self.store = store
        self.lengths = [int(n) for n in store.lengths]

    def sample(self, i: int, row_len: int) -> dict:
        import torch

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


class OnlineSource:
    """Samples from prepare/samples.jsonl, their hidden states computed by the target in-process
    with extract's capture (so they equal what extract would store: bf16, same layers)."""

    prefetch = False  # the target's forwards share the cores with training: no overlap to gain

    def __init__(self, run, target, layers: list[int], batch_tokens: int):
        from draftsmith.extract import HiddenCapture

        self.target, self.batch_tokens, self.device = target, batch_tokens, target.device
        self.capture = HiddenCapture(target.model, layers)
        self.read_prepared(run)

    def read_prepared(self, run) -> None:
        import numpy as np

        from draftsmith.prepare import iter_prepared

        path = run.stage_dir("prepare", create=False) / "samples.jsonl"
        self.ids, self.masks, self.names = [], [], []
        for i, rec in iter_prepared(run):
            try:
                ids = np.asarray(rec["input_ids"], dtype=np.int64)
                mask = np.asarray(rec["loss_mask"], dtype=bool)
            except (KeyError, TypeError, ValueError):
                raise DraftsmithError(f"{path}:{i + 1}: not a prepared sample (input_ids, loss_mask)") from None
            if ids.shape != mask.shape or ids.ndim != 1:
                raise DraftsmithError(f"{path}:{i + 1}: input_ids and loss_mask differ in shape")
            self.ids.append(ids)
            self.masks.append(mask)
            self.names.append(str(rec.get("id", i)))
        self.lengths = [len(x) for x in self.ids]

    def name(self, i: int) -> str:
        return self.names[i]

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
        """{i: {aux_hidden [n, 3, H], last_hidden [n, H]}} (bf16) for samples cut to row_len."""
        import torch

        from draftsmith.extract import make_batch

        order = sorted(indices, key=lambda i: -self.lengths[i])
        states: dict[int, dict] = {}
        # target forwards over length-sorted groups of at most batch_tokens padded tokens
        j = 0
        while j < len(order):
            n_max = min(self.lengths[order[j]], row_len)
            group = order[j:j + max(1, self.batch_tokens // n_max)]
            ids, pos = make_batch([{"input_ids": self.ids[i][:row_len]} for i in group])
            with torch.inference_mode():
                aux, last = self.capture(ids.to(self.device), pos.to(self.device))  # [B, T, 3, H], [B, T, H]
            for b, i in enumerate(group):
                n = min(self.lengths[i], row_len)
                # bf16 like the extract store, so both modes train on the same numbers
                states[i] = {"aux_hidden": aux[b, :n].to(torch.bfloat16), "last_hidden": last[b, :n].to(torch.bfloat16)}
            j += len(group)
        return states

    def batch(self, rows: list[list[int]], row_len: int) -> Batch:
        import torch

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


class ServerSource(OnlineSource):
    """train.mode=online with extract.backend=vllm: the states come from vLLM server(s), as the
    vllm extract backend gets them (draftsmith/extract_vllm.py), for a target too big to run
    here. Nothing is stored: each file the server writes is deleted as soon as it is read, so
    the disk holds at most extract.concurrency of them; the Prefetcher keeps the server busy
    with the next step's samples while this one trains."""

    prefetch = True

    def __init__(self, run):
        import torch

        self.device = torch.device("cpu")
        self.read_prepared(run)
        self._stack = contextlib.ExitStack()
        self.client = None

    def start(self, run, cfg, info, layers: list[int], row_len: int, world: int, log) -> "ServerSource":
        from draftsmith.extract_vllm import open_client

        if world > 1 and not cfg.extract.servers:
            raise DraftsmithError(f"extract.servers: train.mode=online with extract.backend=vllm on {world} ranks needs "
                                  "running servers that the ranks share (each rank would start its own)")
        max_len = min(max(self.lengths), row_len)
        self.client = self._stack.enter_context(open_client(cfg, info, layers, run.stage_dir(STAGE), max_len, log))
        return self

    def states(self, indices: list[int], row_len: int) -> dict[int, dict]:
        import torch

        from draftsmith.extract_vllm import SampleFailed

        out = {}
        for i, res in self.client.map((i, self.ids[i][:row_len].tolist()) for i in indices):
            if isinstance(res, SampleFailed):
                raise DraftsmithError(f"train: no hidden states for sample {self.names[i]} from the vLLM server(s) "
                                      f"after {res.attempts} attempt(s): {res}")
            aux, last = res  # [n, 3, H], [n, H] in the server's dtype
            out[i] = {"aux_hidden": aux.to(torch.bfloat16), "last_hidden": last.to(torch.bfloat16)}
        return out

    def close(self) -> None:
        self._stack.close()


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


# -------------------------------------------------------------------------------------------------
# The objective


def ttt_masks(input_ids, loss_mask, doc_ids, t2d, steps: int) -> list[tuple[Any, Any]]:
    """Per TTT step k: (masked [R, T], valid [R, T]) bool, indexed by the drafting position i.

    masked: t[i+2+k] is a loss-masked token of the same document inside the row (accuracy's
    denominator); valid: masked and t[i+2+k] is in the draft vocabulary (where the KL is taken).
    """
    import torch

    R, T = input_ids.shape
    in_vocab = t2d[input_ids]
    out = []
    for k in range(steps):
        s = k + 2
        masked = torch.zeros(R, T, dtype=torch.bool, device=input_ids.device)
        valid = torch.zeros_like(masked)
        if s < T:
            masked[:, :T - s] = loss_mask[:, s:] & (doc_ids[:, s:] == doc_ids[:, :T - s])
            valid[:, :T - s] = masked[:, :T - s] & in_vocab[:, s:]
        out.append((masked, valid))
    return out


def _objective_class():
    import torch
    import torch.nn as nn

    class TTTObjective(nn.Module):
        """The drafter plus the frozen target head: forward() is one micro-batch's loss.

        A module (not a function) so that DDP/FSDP wrap it and see every parameter used.
        target_head: W_d [Dv, H], the target lm_head's rows at the draft ids.
        """

        def __init__(self, drafter, target_head, steps: int, gamma: float, fc_input_scale=None, teacher_temperature: float = 1.0,
                     feature_noise: float = 0.0):
            super().__init__()
            self.drafter = drafter
            self.register_buffer("target_head", target_head, persistent=False)
            # [3H] or None: aux states are multiplied by it before fc (train.fc_input_norm)
            self.register_buffer("fc_input_scale", fc_input_scale, persistent=False)
            self.steps, self.gamma = steps, gamma
            self.teacher_temperature = teacher_temperature
            self.feature_noise = feature_noise

        def forward(self, input_ids, loss_mask, doc_ids, position_ids, aux_hidden, last_hidden, denom, scale: float = 1.0):
            """Returns (loss, stats [steps, 4] float64: KL sum, valid positions, correct, masked).

            loss = scale * sum_k gamma^k * KL_sum_k / denom[k]; denom [steps] = valid positions of
            step k over the whole optimizer step (all micro-batches, all ranks), so that the
            accumulated gradient is the token mean of the step whatever the micro-batching.
            denom is a list of floats (no device sync); scale = number of ranks, which undoes the
            gradient averaging of DDP/FSDP.
            """
            d = self.drafter
            R, T = input_ids.shape
            H = d.config.hidden_size
            masks = ttt_masks(input_ids, loss_mask, doc_ids, d.t2d, self.steps)
            if self.feature_noise > 0 and self.training:
                # train.feature_noise: Gaussian noise of std feature_noise x each state's own RMS
                # (per token and aux layer), so the noise follows the residual stream's scale
                A = aux_hidden.shape[-1] // H
                a = aux_hidden.float().reshape(R, T, A, H)
                rms = a.pow(2).mean(-1, keepdim=True).sqrt()  # [R, T, A, 1]
                aux_hidden = (a + self.feature_noise * rms * torch.randn_like(a)).reshape(R, T, A * H).to(aux_hidden.dtype)
            if self.fc_input_scale is not None:
                aux_hidden = aux_hidden * self.fc_input_scale.to(aux_hidden.dtype)
            states = d.ttt_forward(input_ids, aux_hidden, self.steps, position_ids=position_ids,
                                   doc_ids=doc_ids, return_hidden=True)  # steps x [R, T, H]

            # The target's log-probs over the draft vocab, once, at every position j = i+1+k some
            # step needs (its next token is step k's target at index i).
            need = torch.zeros(R, T, dtype=torch.bool, device=input_ids.device)
            for k, (_, valid) in enumerate(masks):
                need[:, 1 + k:] |= valid[:, :T - 1 - k]
            need_idx = need.flatten().nonzero().squeeze(1)
            row_of = torch.full((R * T,), -1, dtype=torch.long, device=input_ids.device)
            row_of[need_idx] = torch.arange(need_idx.numel(), device=input_ids.device)
            with torch.no_grad():
                t_logits = last_hidden.reshape(-1, H)[need_idx] @ self.target_head.t()  # [N, Dv]
                t_logp = torch.log_softmax(t_logits.float() / self.teacher_temperature, dim=-1)
                t_p = t_logp.exp()
                t_negent = (t_p * t_logp).sum(-1)  # [N] sum p log p, the KL's constant part

            flat_ids = input_ids.flatten()
            loss = 0.0
            stats = []
            for k, (masked, valid) in enumerate(masks):
                vi = valid.flatten().nonzero().squeeze(1)  # [N_k] flat drafting positions
                h = states[k].reshape(-1, H)[vi]
                logits = d.lm_head(d.norm(h))  # [N_k, Dv]
                logq = torch.log_softmax(logits.float(), dim=-1)
                rows = row_of[vi + 1 + k]
                # forward KL(p || q) summed over positions = sum p log p - sum p log q; the
                # cross term as one dot product (no [N_k, Dv] temporary in the forward)
                kl = t_negent[rows].sum() - torch.dot(t_p[rows].flatten(), logq.flatten())
                # every step's term stays in the graph (weight 0 when it has no position anywhere),
                # so every parameter gets a gradient on every rank
                loss = loss + (scale * self.gamma ** k / denom[k] if denom[k] > 0 else 0.0) * kl
                with torch.no_grad():
                    pred = logits.argmax(-1)
                    correct = ((pred + d.d2t[pred]) == flat_ids[vi + 2 + k]).sum()
                    stats.append(torch.stack([kl.detach().double(), torch.tensor(float(vi.numel()), dtype=torch.float64, device=kl.device),
                                              correct.double(), masked.sum().double()]))
            return loss, torch.stack(stats)

    return TTTObjective


def fc_input_scale(batch: Batch, eps: float = 1e-3):
    """[3H] float32: 1 / the RMS of each aux-state dimension over the batch's real tokens, leaving
    out each document's first token (an attention sink whose states are orders of magnitude larger:
    24,832 in SmolLM2's layers 15 and 27)."""

    keep = (batch.doc_ids >= 0) & (batch.position_ids > 0)
    if not bool(keep.any()):
        keep = batch.doc_ids >= 0
    x = batch.aux_hidden[keep].float()  # [N, 3H]
    return 1.0 / x.pow(2).mean(0).sqrt().clamp_min(eps)


def step_counts(batch: Batch, t2d, steps: int):
    """[steps] float64: positions where step k's KL is defined in this micro-batch."""
    import torch

    masks = ttt_masks(batch.input_ids, batch.loss_mask, batch.doc_ids, t2d, steps)
    return torch.stack([v.sum() for _, v in masks]).double()


def lr_lambda(warmup: int, total: int, min_ratio: float, time_share=None):
    """LR multiplier at optimizer step s (0-based): linear warm-up, then cosine to min_ratio.

    `time_share()`, when given, returns the share of a time budget spent (0..1); the cosine then
    follows whichever of steps and time is further along.
    """
    def f(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        progress = min(1.0, (s - warmup) / max(1, total - warmup))
        if time_share is not None:
            progress = max(progress, min(1.0, time_share()))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def resolve_precision(spec: str, device) -> str:
    """`auto` -> bf16 where bf16 matmuls are fast (CUDA with bf16, CPUs with AMX tiles), else fp32.

    Without AMX (e.g. AVX-512-BF16 only) oneDNN's bf16 GEMMs run slower than float32 ones, and
    autocast adds casts on top: measured 1.7x slower per training step on such a CPU.
    """
    from draftsmith.target import bf16_is_fast

    if spec != "auto":
        return spec
    return "bf16" if bf16_is_fast(device) else "fp32"


def acceptance_length(acc: list[float]) -> float:
    """1 + sum_k prod_{j<=k} acc_j: expected tokens per verification when draft k is accepted
    only if drafts 0..k-1 were."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= a
        tau += run
    return tau


# -------------------------------------------------------------------------------------------------
# Target weights


def _weight_map(folder: Path) -> dict[str, str]:
    """{tensor name: safetensors file} of a model folder (sharded or not); {} without safetensors."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
    if (folder / "model.safetensors").is_file():
        with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    return {}


def read_target_weights(info, log=print):
    """(embed [V, H], lm_head [V, H], final norm [H] or None) of the target, read from its
    safetensors files without building the model; loads the model only when they are absent."""
    import torch
    from safetensors import safe_open

    folder = Path(info.path)
    where = _weight_map(folder)

    def pick(cands):
        return min(cands, key=len) if cands else None

    embed_key = pick([k for k in where if k.endswith("embed_tokens.weight")])
    head_key = "lm_head.weight" if "lm_head.weight" in where else (embed_key if info.tie_word_embeddings else None)
    norm_key = pick([k for k in where if k.endswith("norm.weight") and ".layers." not in k and "embed" not in k])
    if embed_key is None or head_key is None:
        from draftsmith.target import load_target

        log(f"{folder}: no safetensors embeddings/lm_head found; loading the model to read them")
        t = load_target(str(folder), device="cpu", dtype="auto")
        norm = t.final_norm_weight()
        return (t.embed_weight().detach().clone(), t.lm_head_weight().detach().clone(),
                None if norm is None else norm.detach().clone())

    def get(key):
        with safe_open(str(folder / where[key]), framework="pt") as f:
            return f.get_tensor(key)

    embed = get(embed_key)
    head = embed if head_key == embed_key else get(head_key)
    norm = get(norm_key) if norm_key else None
    V = info.vocab_size
    if embed.shape[0] != V or head.shape[0] != V:
        # some checkpoints pad the embedding matrix beyond config.vocab_size
        embed, head = embed[:V], head[:V]
    return embed, head, (None if norm is None else torch.as_tensor(norm))


def read_target_layer(info, n: int) -> dict:
    """The target's decoder layer n as {name inside the layer: tensor}, read from its safetensors."""
    from safetensors import safe_open

    folder = Path(info.path)
    where = _weight_map(folder)
    if not where:
        raise DraftsmithError(f"train.init_layer: {folder} has no safetensors weights to read layer {n} from")
    # the decoder layers sit beside the token embeddings ("model.embed_tokens.weight" ->
    # "model.layers.N."); other stacks (a vision tower's "encoder.layers.N.", "mtp.layers.N.") do not
    embed = min((k for k in where if k.endswith("embed_tokens.weight")), key=len, default=None)
    if embed is None:
        raise DraftsmithError(f"train.init_layer: {folder} has no embed_tokens weight to locate its decoder layers by")
    prefix = f"{embed[:-len('embed_tokens.weight')]}layers.{n}."
    out = {}
    for key, file in where.items():
        if key.startswith(prefix):
            with safe_open(str(folder / file), framework="pt") as f:
                out[key[len(prefix):]] = f.get_tensor(key)
    if not out:
        raise DraftsmithError(f"train.init_layer: {folder} has no tensors named {prefix}*")
    return out


# -------------------------------------------------------------------------------------------------
# Checkpoints


def _complete_checkpoints(ck_dir: Path) -> list[tuple[int, Path]]:
    out = []
    if ck_dir.is_dir():
        for d in ck_dir.iterdir():
            if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and (d / CKPT_STATE).is_file():
                out.append((int(d.name[5:]), d))
    return sorted(out)


def _fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(dest: Path, model_sd: dict, meta: dict, optim: dict, rng: dict, state: dict) -> None:
    """Build the checkpoint in a hidden temporary folder beside `dest`, state.json last, then
    rename it into place: a folder named step_N (or final) is always complete."""
    import torch
    from safetensors.torch import save_file

    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with naming_full_disk(dest):  # a full disk: one line naming the checkpoint, no half folder
            tmp.mkdir(parents=True)
            save_file({k: v.contiguous() for k, v in model_sd.items()}, str(tmp / CKPT_WEIGHTS), metadata={"format": "pt"})
            (tmp / CKPT_META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
            with open(tmp / CKPT_OPTIM, "wb") as f:  # (a file object: torch then chains the OSError behind its own error)
                torch.save(optim, f)
            save_file(rng, str(tmp / CKPT_RNG))
            (tmp / CKPT_STATE).write_text(json.dumps(state, indent=2, sort_keys=True, default=float) + "\n")
            _fsync_tree(tmp)
            replace_dir(tmp, dest)  # final/ may be rewritten: swapped whole, never mixed
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fd = os.open(dest.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prune_checkpoints(ck_dir: Path, keep: int) -> None:
    for _, d in _complete_checkpoints(ck_dir)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DraftsmithError(f"{path}: cannot read ({e})") from None


# -------------------------------------------------------------------------------------------------
# Upstream checks


def _meta_target_fingerprint(meta: dict) -> str | None:
    t = meta.get("target")
    if isinstance(t, dict) and t.get("fingerprint"):
        return t["fingerprint"]
    return meta.get("target_fingerprint")


def _open_upstream(run, cfg, info, say):
    """(layers, upstream manifests, store or None) for the mode, refusing mismatched inputs."""
    from draftsmith.prepare import check_upstream_target

    tc = cfg.train
    if tc.mode == "offline":
        em = run.require_manifest("extract", by="draftsmith train (train.mode=offline; or use --mode online)")
        check_upstream_target(run, "extract", em, info)
        from draftsmith.extract import ExtractStore

        store = ExtractStore(run)
        meta = store.meta
        where = run.stage_dir("extract", create=False) / "meta.json"
        fp = _meta_target_fingerprint(meta)
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
        return layers, {"extract": em}, store
    prep = run.require_manifest("prepare", by="draftsmith train (train.mode=online)")
    check_upstream_target(run, "prepare", prep, info)
    layers = info.check_layers(list(cfg.extract.layers) if cfg.extract.layers is not None else info.default_aux_layers())
    return layers, {"prepare": prep}, None


def _launch_ranks(run, cfg) -> dict:
    """train.processes = N > 1 outside torchrun: run this stage as N local ranks under torchrun
    (DDP, gloo on the CPU) and return the manifest rank 0 writes.

    Why on a CPU: two single-threaded ranks keep both cores busy through the whole step, where one
    process with two threads leaves one idle in every small or sequential op (measured here: ~930
    against ~700 tokens/s). Each rank gets cpu_count // N threads unless OMP_NUM_THREADS is set."""
    import subprocess
    import sys
    import tempfile

    from draftsmith.progress import log
    from draftsmith.rundir import RunDir
    from draftsmith.target import pick_device
    from draftsmith.vllm_server import _die_with_parent

    rd = run if isinstance(run, RunDir) else RunDir(run)
    n = cfg.train.processes
    device = pick_device(cfg.device)
    if device.type == "cuda":
        import torch

        if n > torch.cuda.device_count():
            raise DraftsmithError(f"train.processes: {n} ranks need {n} GPUs, this node has {torch.cuda.device_count()}")
    env = dict(os.environ)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // n)))
    # the ranks read the resolved config from a file: --set overrides are already applied in it
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix=".train-ranks-", dir=rd.path, delete=False) as f:
        f.write(cfg.to_yaml())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "draftsmith", "--", "train", "--run", str(rd.path), "--config", f.name]
    log(f"{n} ranks under torchrun, {env['OMP_NUM_THREADS']} thread(s) each", stage=STAGE)
    # torchrun dies with us (PR_SET_PDEATHSIG) and takes its ranks with it
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_die_with_parent)
    error = None
    try:
        # rank 0's lines (the log) go on to our stdout; the ranks' final summary print is ours to make
        for line in proc.stdout:
            if line.startswith("draftsmith: error: "):
                error = error or line.strip()[len("draftsmith: error: "):]  # the first rank's, one line
            if not line.startswith("trained "):
                print(line, end="", flush=True)
        rc = proc.wait()
    except BaseException:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        with contextlib.suppress(OSError):
            os.unlink(f.name)
    if rc != 0:
        raise DraftsmithError(error or f"train: {n} ranks under torchrun exited with status {rc} (see {rd.path / STAGE / 'stage.log'})")
    manifest = rd.read_manifest(STAGE)
    if manifest is None:
        raise DraftsmithError(f"train: the ranks exited without writing {rd.path / STAGE / 'manifest.json'}")
    return manifest


# -------------------------------------------------------------------------------------------------
# The stage


def run_train(run, cfg, **opts) -> dict:
    """Train the drafter (train.mode offline or online); returns the train manifest.

    Resumes from the newest complete checkpoint of a run with the same fingerprint; moves the
    checkpoints of a run with other settings to train/previous/ and starts over.
    With train.processes > 1 outside torchrun, launches that many local ranks (they journal
    their own failures).
    """
    if cfg.train.processes > 1 and "WORLD_SIZE" not in os.environ:
        return _launch_ranks(run, cfg)
    return _train(run, cfg, **opts)


@journal_failures(STAGE)
def _train(run, cfg, **opts) -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict, set_optimizer_state_dict)

    from draftsmith.model import Eagle3Config, Eagle3Drafter, check_target_layer
    from draftsmith.progress import Progress, env_rank, fmt_duration, log
    from draftsmith.rundir import fingerprinted, stage_fingerprint, write_stage_config
    from draftsmith.target import load_target, pick_device, target_info
    from draftsmith.vocab import load_vocab

    started, cpu0 = time.time(), time.process_time()
    tc = cfg.train
    rank, world = env_rank()
    say = lambda msg: log(msg, stage=STAGE)  # noqa: E731 (console on rank 0, and stage.log)

    # -- device and process group ------------------------------------------------------------------
    device = pick_device(cfg.device)
    if device.type == "cuda" and world > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    own_group = world > 1 and not dist.is_initialized()
    if own_group:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    source = None
    try:
        # -- upstream: target, data, vocabulary -----------------------------------------------------
        info = target_info(cfg.target, cfg.trust_remote_code, log=say)
        layers, upstream, store = _open_upstream(run, cfg, info, say)
        d2t, t2d, vinfo = load_vocab(run, expect_target_fingerprint=info.fingerprint,
                                     expect_size=cfg.vocab.draft_vocab_size, by="draftsmith train")
        if t2d.numel() != info.vocab_size:
            raise DraftsmithError(f"vocab/vocab.safetensors: t2d has {t2d.numel()} entries but target {info.name} "
                                  f"has a vocabulary of {info.vocab_size}")
        upstream["vocab"] = run.read_manifest("vocab")
        section = cfg.section(STAGE)
        section[STAGE] = fingerprinted(section[STAGE], NOT_FINGERPRINTED, LATER_KNOBS)
        precision = resolve_precision(tc.precision, device)
        settings = {**section, "aux_layers": layers, "precision_used": precision, "version": TRAIN_VERSION}
        if tc.mode == "online" and cfg.extract.backend == "vllm":
            from draftsmith.extract_vllm import server_dtype

            # states from a server, not this process's forward, in the dtype the server computes in
            settings["online_states"] = {"source": "vllm", "dtype": server_dtype(cfg), "connector": cfg.extract.connector}
        fp = stage_fingerprint({**settings, "target_fingerprint": info.fingerprint}, upstream)

        d = run.path / STAGE
        ck_dir, final_dir = d / "checkpoints", d / "final"
        old = run.read_manifest(STAGE)
        if old is not None and old.get("fingerprint") == fp and (final_dir / CKPT_STATE).is_file():
            say(f"up to date ({old['counts'].get('done')} steps); nothing to do")
            return old

        # the init layer is read and checked before anything in train/ is touched: a bad value must
        # not move a good run's checkpoints aside
        from transformers import AutoConfig

        hf_cfg = AutoConfig.from_pretrained(info.path, trust_remote_code=cfg.trust_remote_code)
        hf_cfg = hf_cfg.get_text_config() if hasattr(hf_cfg, "get_text_config") else hf_cfg
        dcfg = Eagle3Config.from_target_config(hf_cfg, draft_vocab_size=int(d2t.numel()), num_hidden_layers=tc.num_layers)
        init_layer = None
        if tc.init_layer is not None:
            # drafter layer n starts from target layer init_layer - (num_layers - 1) + n: the last from init_layer
            first = tc.init_layer - (tc.num_layers - 1)
            if not 0 <= tc.init_layer < info.num_layers:
                raise DraftsmithError(f"train.init_layer: {tc.init_layer} is not a layer of the target (0..{info.num_layers - 1})")
            if first < 0:
                raise DraftsmithError(f"train.init_layer: {tc.init_layer} with train.num_layers {tc.num_layers} needs target "
                                      f"layers {first}..{tc.init_layer}; the target has 0..{info.num_layers - 1}")
            init_layer = []
            for n in range(first, tc.init_layer + 1):
                init_layer.append({k: v.float() for k, v in read_target_layer(info, n).items()})
                try:
                    check_target_layer(dcfg, init_layer[-1])
                except ValueError as e:
                    raise DraftsmithError(f"train.init_layer: layer {n} of {info.name}: {e}") from None

        # -- rank 0 prepares the folder; the others wait ---------------------------------------------
        if rank == 0:
            run.stage_dir(STAGE)
            if old is not None:
                run.invalidate(STAGE)
            write_stage_config(run, STAGE, cfg)
            for stale in list(d.glob(".step_*")) + list(ck_dir.glob(".step_*")) + list(d.glob(".final.*")):
                shutil.rmtree(stale, ignore_errors=True)  # temporary folders of a killed attempt
            newest = _complete_checkpoints(ck_dir)

            def stale(folder: Path) -> bool:
                return (folder / CKPT_STATE).is_file() and _read_json(folder / CKPT_STATE).get("train_fingerprint") != fp

            if (newest and stale(newest[-1][1])) or stale(final_dir):
                prev = d / "previous"
                shutil.rmtree(prev, ignore_errors=True)
                prev.mkdir()
                for p in (ck_dir, final_dir):
                    if p.exists():
                        os.replace(p, prev / p.name)
                say(f"checkpoints of a run with other settings or inputs moved to {prev}; starting over")
            elif final_dir.exists():
                shutil.rmtree(final_dir)  # rewritten at the end of this attempt
        if world > 1:
            dist.barrier()

        # -- data ---------------------------------------------------------------------------------
        act_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        if tc.mode == "offline":
            source = OfflineSource(store)
        elif cfg.extract.backend == "vllm":
            source = ServerSource(run).start(run, cfg, info, layers, min(tc.seq_len, tc.batch_tokens), world, say)
        else:
            say(f"loading target {info.name} for online hidden states (layers {layers})")
            target = load_target(cfg.target, device=str(device), dtype=cfg.dtype, trust_remote_code=cfg.trust_remote_code, log=say)
            source = OnlineSource(run, target, layers, tc.batch_tokens)
        lengths = source.lengths
        row_len = min(tc.seq_len, tc.batch_tokens)
        rows_per_batch = max(1, tc.batch_tokens // row_len)
        plans: dict[int, list] = {}

        def plan_of(epoch: int) -> list:
            if epoch not in plans:
                plans.clear()  # one epoch at a time is enough for a stream that only moves forward
                plans[epoch] = pack_epoch(lengths, row_len, rows_per_batch, tc.seed, epoch)
            return plans[epoch]

        per_step = world * tc.grad_accum
        if tc.max_steps is not None:
            total_steps = tc.max_steps
        else:
            full, frac = int(tc.epochs), tc.epochs - int(tc.epochs)
            n_mb = sum(len(pack_epoch(lengths, row_len, rows_per_batch, tc.seed, e)) for e in range(full))
            if frac > 0:
                n_mb += round(frac * len(pack_epoch(lengths, row_len, rows_per_batch, tc.seed, full)))
            total_steps = n_mb // per_step
            if total_steps == 0:
                raise DraftsmithError(
                    f"train.epochs: {tc.epochs} epoch(s) of {len(lengths)} samples pack into {n_mb} micro-batches, fewer than one "
                    f"optimizer step takes ({per_step} = ranks x train.grad_accum); set train.max_steps or lower train.batch_tokens")
        n_truncated = sum(1 for n in lengths if n > row_len)
        if n_truncated:
            say(f"{n_truncated} of {len(lengths)} samples are longer than a row ({row_len} tokens) and are cut to it")

        # -- the drafter ------------------------------------------------------------------------------
        embed, head, norm = read_target_weights(info, log=say)
        torch.manual_seed(tc.seed)
        drafter = Eagle3Drafter(dcfg)
        draft_ids = d2t + torch.arange(d2t.numel())
        drafter.init_from_target(embed.float(), head.float(), None if norm is None else norm.float(), draft_ids)
        target_head = head[draft_ids].float()  # W_d [Dv, H]
        del embed, head
        scale = None
        if tc.fc_input_norm:
            # from the first micro-batch of epoch 0: the same on every rank and after a resume
            scale = fc_input_scale(source.batch(plan_of(0)[0], row_len))
            say(f"fc input norm: aux-state RMS per dimension {float(1 / scale.max()):.3g} to {float(1 / scale.min()):.3g}")
        if init_layer is not None:
            # after the fc input scale: fc's block is diag(1 / scale), so it passes on (aux * scale) / scale = aux
            drafter.init_layer_from_target(init_layer, aux_index=-1, input_scale=scale)
            which = f"layer {tc.init_layer}" if tc.num_layers == 1 else f"layers {first}..{tc.init_layer}"
            say(f"decoder layers initialised from the target's {which}; fc passes aux layer {layers[-1]} through")
        if tc.freeze_lm_head:
            drafter.lm_head.weight.requires_grad_(False)  # stays the target's rows; still saved and exported
            say("draft LM head frozen at the target's rows")
        Objective = _objective_class()
        objective = Objective(drafter, target_head, tc.ttt_steps, tc.gamma, scale, tc.teacher_temperature,
                              tc.feature_noise).to(device)

        drafter_meta = {
            "format": "draftsmith-drafter", "version": TRAIN_VERSION, "config": asdict(dcfg),
            "aux_layers": layers, "target": {"name": info.name, "fingerprint": info.fingerprint},
            "vocab_fingerprint": vinfo.get("fingerprint"), "draft_vocab_size": int(d2t.numel()),
            "ttt_steps": tc.ttt_steps, "train_fingerprint": fp, "precision": precision,
            "fc_input_norm": tc.fc_input_norm, "init_layer": tc.init_layer, "freeze_lm_head": tc.freeze_lm_head,
        }

        # -- resume: weights now, optimizer/scheduler/RNG once they exist ----------------------------
        resume = _complete_checkpoints(ck_dir)
        resume_dir = resume[-1][1] if resume else None
        state: dict[str, Any] = {}
        if resume_dir is not None:
            state = _read_json(resume_dir / CKPT_STATE)
            if state.get("train_fingerprint") != fp:
                raise DraftsmithError(f"{resume_dir}: a checkpoint of other settings (fingerprint mismatch); remove it")
            sd = load_file(str(resume_dir / CKPT_WEIGHTS))
            sd.pop(FC_INPUT_SCALE, None)  # recomputed above, from the same first micro-batch
            missing, unexpected = drafter.load_state_dict(sd, strict=False)
            if set(missing) != {"embed_tokens.weight"} or unexpected:
                raise DraftsmithError(f"{resume_dir / CKPT_WEIGHTS}: tensors do not match the drafter "
                                      f"(missing {sorted(set(missing) - {'embed_tokens.weight'})[:3]}, unexpected {unexpected[:3]})")
        start_step = int(state.get("step", 0))
        if state and int(state.get("total_steps", -1)) == start_step:
            total_steps = start_step  # the run had ended there (at its last step, or by train.max_minutes' clock)
        position = (int(state.get("epoch", 0)), int(state.get("micro_batch", 0)))
        tokens_seen = int(state.get("tokens_seen", 0))
        samples_seen = int(state.get("samples_seen", 0))
        if state and state.get("world_size", world) * state.get("grad_accum", tc.grad_accum) != per_step:
            say(f"note: resuming with {world} ranks x grad_accum {tc.grad_accum} instead of "
                f"{state.get('world_size')} x {state.get('grad_accum')}: the global batch changes from here on")

        # -- distribution wrappers, optimizer, schedule --------------------------------------------------
        model = objective
        if world > 1 and tc.fsdp:
            from torch.distributed.fsdp import fully_shard

            for layer in drafter.layers:
                fully_shard(layer)
            fully_shard(objective)
        elif world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(objective, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
        params = [p for p in objective.parameters() if p.requires_grad]
        fused = device.type in ("cpu", "cuda") and not (world > 1 and tc.fsdp)
        optimizer = torch.optim.AdamW(params, lr=tc.lr, betas=ADAM_BETAS, weight_decay=tc.weight_decay, fused=fused)
        # train.max_minutes: rank 0's seconds of training so far, summed over attempts, shared with every
        # rank once per step (so all ranks take the same learning rate and stop at the same step)
        # The time share counts from the end of warm-up, as the step share does: at a steady pace that ends
        # the steps inside the budget the clock never leads, and the schedule is the step-count one.
        budget_s = None if tc.max_minutes is None else tc.max_minutes * 60.0
        train_s0 = float(state.get("train_s", 0.0))
        clock = [train_s0]

        def trained_s() -> float:
            """This rank's seconds of training steps so far, earlier attempts included (loop_t0: the loop's start)."""
            return train_s0 + time.perf_counter() - loop_t0
        warm_end = [state.get("warmup_end_s", 0.0 if tc.warmup_steps == 0 else None)]

        def time_share() -> float:
            if warm_end[0] is None:
                return 0.0
            left = budget_s - warm_end[0]
            return 1.0 if left <= 0 else (clock[0] - warm_end[0]) / left

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tc.warmup_steps, total_steps, tc.min_lr_ratio,
                                                                                None if budget_s is None else time_share))
        sd_opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if resume_dir is not None:
            saved = torch.load(resume_dir / CKPT_OPTIM, weights_only=True, map_location="cpu")
            set_optimizer_state_dict(objective, optimizer, saved["optimizer"], options=StateDictOptions(full_state_dict=True))
            scheduler.load_state_dict(saved["scheduler"])
            rng = load_file(str(resume_dir / CKPT_RNG))
            if f"cpu.rank{rank}" in rng:
                torch.set_rng_state(rng[f"cpu.rank{rank}"])
            if device.type == "cuda" and f"cuda.rank{rank}" in rng:
                torch.cuda.set_rng_state(rng[f"cuda.rank{rank}"], device)
            say(f"resumed from {resume_dir} (step {start_step}/{total_steps}, epoch {position[0]}, micro-batch {position[1]})")

        def checkpoint(dest: Path, step: int, metrics: dict | None) -> None:
            """Every rank takes part (FSDP gathers shards); rank 0 writes."""
            full = get_model_state_dict(objective, options=sd_opts)
            osd = get_optimizer_state_dict(objective, optimizer, options=sd_opts)
            rng_states = {"cpu": torch.get_rng_state()}
            if device.type == "cuda":
                rng_states["cuda"] = torch.cuda.get_rng_state(device)
            gathered = [None] * world
            if world > 1:
                dist.all_gather_object(gathered, rng_states)
            else:
                gathered = [rng_states]
            if rank == 0:
                model_sd = {k[len("drafter."):]: v for k, v in full.items()
                            if k.startswith("drafter.") and k != "drafter.embed_tokens.weight"}
                if scale is not None:
                    model_sd[FC_INPUT_SCALE] = scale.detach().cpu()  # export folds it into fc.weight
                rng = {f"{name}.rank{r}": t.cpu() for r, g in enumerate(gathered) for name, t in g.items()}
                st = {"step": step, "total_steps": total_steps, "epoch": position[0], "micro_batch": position[1],
                      "tokens_seen": tokens_seen, "samples_seen": samples_seen, "world_size": world,
                      "grad_accum": tc.grad_accum, "train_fingerprint": fp, "time": time.time(),
                      "elapsed_s": round(time.time() - started, 3), "metrics": metrics,
                      "train_s": round(trained_s(), 3), "warmup_end_s": warm_end[0]}
                write_checkpoint(dest, model_sd, {**drafter_meta, "step": step}, {"optimizer": osd, "scheduler": scheduler.state_dict()},
                                 rng, st)
                if dest.parent == ck_dir:
                    prune_checkpoints(ck_dir, tc.keep_checkpoints)
            if world > 1:
                dist.barrier()

        # -- reporting -------------------------------------------------------------------------------------
        metrics_path = d / "metrics.jsonl"
        tb = None
        if rank == 0:
            if metrics_path.exists():  # drop lines past the checkpoint we resume from
                keep = [ln for ln in metrics_path.read_text().splitlines()
                        if ln.strip() and _json_step(ln) is not None and _json_step(ln) <= start_step]
                from draftsmith.rundir import atomic_write_text

                atomic_write_text(metrics_path, "".join(ln + "\n" for ln in keep))
            if tc.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                tb = SummaryWriter(str(d / "tb"), purge_step=start_step + 1)
        budget_note = "" if budget_s is None else f" or {tc.max_minutes:g} min of steps ({train_s0 / 60:.1f} done)"
        say(f"{tc.mode} training: {len(lengths)} samples, {total_steps} steps{budget_note} of {per_step} micro-batches "
            f"({rows_per_batch} x {row_len} tokens), {tc.ttt_steps} TTT steps, {precision}, {world} rank(s) on {device}, "
            f"draft vocab {d2t.numel()}, aux layers {layers}")

        # -- the loop ------------------------------------------------------------------------------------------
        t2d_dev = drafter.t2d
        stream = micro_batch_stream(plan_of, *position)
        batches = step_batches(stream, source, rank, world, tc.grad_accum, row_len)
        data = Prefetcher(batches) if source.prefetch else batches
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
        steps_n = tc.ttt_steps
        stats_sum = torch.zeros(steps_n, 4, dtype=torch.float64, device=device)
        times = {"data": 0.0, "forward": 0.0, "backward": 0.0, "optimizer": 0.0}
        win_tokens, win_steps, win_t0 = 0, 0, time.perf_counter()
        last_log = time.time()
        grad_norm = float("nan")
        metrics: dict | None = state.get("metrics")
        step = start_step
        planned = total_steps  # what the log and status show: with a time budget, the steps it is expected to allow
        loop_t0 = time.perf_counter()
        with Progress(run, STAGE, total=total_steps, unit="steps", done=start_step, stall_after_s=cfg.stall_after_s,
                      console=False, shared=True) as prog:
            try:
                while step < total_steps:
                    t = time.perf_counter()
                    position, mbs = next(data)
                    mbs = [b.to(device, act_dtype) for b in mbs]
                    if tc.loss_on == "all":  # every token of every sample (padding excluded)
                        mbs = [replace(b, loss_mask=b.doc_ids >= 0) for b in mbs]
                    times["data"] += time.perf_counter() - t

                    # positions per TTT step over the whole step (all ranks), plus the step's tokens and
                    # samples and rank 0's "log after this step" decision, in one all-reduce
                    head = torch.stack([step_counts(b, t2d_dev, steps_n) for b in mbs]).sum(0)
                    # with a time budget, rank 0 makes this the last step when the next would not fit, by the mean step
                    # time so far (a resume whose checkpoint already spent the budget still takes one step)
                    now_s = trained_s() if rank == 0 else 0.0
                    step_s = (now_s - train_s0) / (step - start_step) if step > start_step else 0.0
                    last_by_time = rank == 0 and budget_s is not None and (now_s + 2 * step_s > budget_s or now_s >= budget_s)
                    want_log = rank == 0 and (time.time() - last_log >= tc.log_every_s or step + 1 == total_steps or last_by_time)
                    extra = torch.tensor([sum(b.tokens for b in mbs), sum(len(b.samples) for b in mbs), float(want_log),
                                          now_s, float(last_by_time)], dtype=torch.float64, device=device)
                    shared = torch.cat([head, extra])
                    if world > 1:
                        dist.all_reduce(shared)
                    shared = shared.tolist()
                    denom, step_tokens, step_samples = shared[:steps_n], int(shared[-5]), int(shared[-4])
                    do_log, clock[0], stop_now = shared[-3] > 0, shared[-2], shared[-1] > 0

                    bad: list[str] = []
                    for j, b in enumerate(mbs):
                        # gradients are reduced across ranks once per step, after the last micro-batch
                        last_mb = j == len(mbs) - 1
                        if world > 1 and tc.fsdp:
                            objective.set_requires_gradient_sync(last_mb)
                        sync = model.no_sync() if hasattr(model, "no_sync") and not last_mb else contextlib.nullcontext()
                        with sync:
                            t = time.perf_counter()
                            with autocast:
                                loss, stats = model(b.input_ids, b.loss_mask, b.doc_ids, b.position_ids,
                                                    b.aux_hidden, b.last_hidden, denom, scale=float(world))
                            if not math.isfinite(loss.item()):
                                bad += [source.name(i) for i in b.samples]
                            times["forward"] += time.perf_counter() - t
                            t = time.perf_counter()
                            loss.backward()
                            times["backward"] += time.perf_counter() - t
                        stats_sum += stats

                    t = time.perf_counter()
                    norm_t = torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
                    grad_norm = float(norm_t.full_tensor() if hasattr(norm_t, "full_tensor") else norm_t)
                    if not math.isfinite(grad_norm) or bad:
                        # NaN grads reach every rank through the all-reduce, so all ranks stop here together
                        everyone = [bad]
                        if world > 1:
                            everyone = [None] * world
                            dist.all_gather_object(everyone, bad)
                        ids = [i for r in everyone for i in r]
                        good = _complete_checkpoints(ck_dir)
                        kept = f"the last good checkpoint is {good[-1][1]}" if good else "no checkpoint was written yet"
                        what = (f"non-finite loss in the micro-batch(es) of samples {ids[:20]}" + (" ..." if len(ids) > 20 else "")
                                if ids else f"non-finite gradient norm ({grad_norm})")
                        raise DraftsmithError(f"train: {what} at step {step + 1}; stopped without updating the weights; {kept}")
                    optimizer.step()
                    if step + 1 == tc.warmup_steps:
                        warm_end[0] = clock[0]  # before the scheduler computes the first post-warm-up rate
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    times["optimizer"] += time.perf_counter() - t

                    step += 1
                    tokens_seen += step_tokens
                    samples_seen += step_samples
                    win_tokens += step_tokens
                    win_steps += 1
                    if stop_now:
                        total_steps = planned = step  # the time budget ends the run here
                        prog.set_total(step)
                    prog.advance(1)

                    if do_log:
                        if world > 1:
                            dist.all_reduce(stats_sum)
                        s = stats_sum.cpu()
                        loss_k = [float(s[k, 0] / s[k, 1]) if s[k, 1] > 0 else float("nan") for k in range(steps_n)]
                        acc_k = [float(s[k, 2] / s[k, 3]) if s[k, 3] > 0 else float("nan") for k in range(steps_n)]
                        dt = time.perf_counter() - win_t0
                        tps = win_tokens / dt if dt > 0 else 0.0
                        eta = (total_steps - step) * dt / max(1, win_steps)
                        if budget_s is not None and not stop_now:
                            left_s = max(0.0, budget_s - clock[0])
                            eta = min(eta, left_s)
                            planned = min(total_steps, step + int(left_s * win_steps / dt)) if dt > 0 else planned
                            prog.set_total(planned)
                        tau = acceptance_length([a if a == a else 0.0 for a in acc_k])
                        metrics = {
                            "step": step, "total_steps": planned, "epoch": position[0], "loss": loss_k, "acc": acc_k,
                            "acceptance_length": tau, "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                            "tokens_per_s": tps, "tokens": tokens_seen, "samples": samples_seen,
                            "elapsed_s": time.time() - started, "cpu_s": time.process_time() - cpu0,
                            "step_time_s": {k: v / max(1, win_steps) for k, v in times.items()},
                        }
                        if rank == 0:
                            append_text(metrics_path, json.dumps(metrics) + "\n")
                            if tb is not None:
                                for k in range(steps_n):
                                    tb.add_scalar(f"loss/step{k}", loss_k[k], step)
                                    tb.add_scalar(f"acc/step{k}", acc_k[k], step)
                                for key in ("acceptance_length", "lr", "grad_norm", "tokens_per_s"):
                                    tb.add_scalar(f"train/{key}", metrics[key], step)
                                tb.flush()
                            say(f"step {step}/{planned} | loss " + " ".join(f"{x:.3f}" for x in loss_k)
                                + " nats | acc " + " ".join(f"{x:.1%}" for x in acc_k) + f" | tau {tau:.2f}"
                                + f" | {tps:,.0f} tok/s | lr {metrics['lr']:.2e} | gnorm {grad_norm:.2f} | ETA {fmt_duration(eta)}")
                        stats_sum.zero_()
                        times = dict.fromkeys(times, 0.0)
                        win_tokens, win_steps, win_t0 = 0, 0, time.perf_counter()
                        last_log = time.time()

                    if stop_now:
                        break
                    if step % tc.checkpoint_every == 0 and step < total_steps:
                        checkpoint(ck_dir / f"step_{step}", step, metrics)
            finally:
                if isinstance(data, Prefetcher):
                    data.close()
                if tb is not None:
                    tb.close()

            # -- the end: last checkpoint, final/, manifest -------------------------------------------------
            if step > start_step:  # else we resumed from the checkpoint of the last step
                checkpoint(ck_dir / f"step_{step}", step, metrics)
            checkpoint(final_dir, step, metrics)
            manifest = None
            if rank == 0:
                final_metrics = metrics or {}
                counts = {"done": step, "total": total_steps, "unit": "steps", "tokens": tokens_seen, "samples": samples_seen,
                          "acceptance_length": final_metrics.get("acceptance_length"),
                          "loss": final_metrics.get("loss"), "acc": final_metrics.get("acc"),
                          "train_minutes": round(trained_s() / 60.0, 2)}
                inputs = {**{k: (m or {}).get("fingerprint") for k, m in upstream.items()},
                          "target": info.name, "target_fingerprint": info.fingerprint}
                outputs = sorted(str(p.relative_to(d)) for p in final_dir.iterdir()) + ["metrics.jsonl"]
                manifest = run.write_manifest(STAGE, fingerprint=fp, inputs=inputs, settings=settings, counts=counts,
                                              started=started, outputs=outputs,
                                              extra={"aux_layers": layers, "final": str(final_dir), "world_size": world})
            prog.end(steps=step, tokens=tokens_seen)
        if world > 1:
            dist.barrier()
        return manifest if manifest is not None else (run.read_manifest(STAGE) or {})
    finally:
        if isinstance(source, ServerSource):
            source.close()  # stops the vLLM server draftsmith started, removes its file buffer
        if own_group and dist.is_initialized():
            dist.destroy_process_group()


def _json_step(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None
