"""The host side of a training step (issue 23 item 5): no device->host read per micro-batch (the
step's one read is the gradient norm with the losses' finiteness), the sizes of the loss read on
the host in the data thread, and on CUDA batches pinned and copied on a side stream (the CUDA calls
patched: these tests run on the CPU)."""

import collections
import contextlib
import threading
from dataclasses import replace
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import draftsmith.train.stage as train_mod
from draftsmith.model.ttt import FlexShape, FlexTTTMask, TTTMask, first_positions, key_floors
from draftsmith.train.stage import run_train
from draftsmith.store_format import BF16, FP8
from draftsmith.target import target_info
from draftsmith.extract.codecs import codec_of, dequantize_fp8, quantize_fp8
from draftsmith.train.data import Batch, DeviceFeeder, HostArena, HostArenas, Prefetcher, pack_rows, packed_bytes
from draftsmith.train.objective import TTTObjective, fixed_positions, ttt_layout
from test_train import cfg_for, copy_run, cycle_samples, make_run, micro_batch, synthesize_states, tiny_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def synth_run(tiny8, tmp_path_factory):
    """A finished prepare/vocab/extract run with test_train's learnable synthetic states (copy before use)."""
    run = make_run(tmp_path_factory.mktemp("synth") / "run", tiny8, cycle_samples(target_info(str(tiny8)).vocab_size, 48))
    synthesize_states(run, tiny8)
    return run

aten = torch.ops.aten
# ops whose result (a Python number, or a shape) depends on the tensor's values: on CUDA each
# waits for the device to finish the queued work
DATA_DEPENDENT = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.nonzero_numpy.default,
                  aten.argwhere.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
                  aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
                  aten.repeat_interleave.Tensor, aten.equal.default, aten.is_nonzero.default, aten.allclose.default}
BOOL_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostReads(TorchDispatchMode):
    """Counts, in this thread, the ops that read a tensor's values back to the host: the
    data-dependent ops above, indexing by a boolean mask (a nonzero() inside), and the Python-level
    reads that do not dispatch an op on the CPU (Tensor.tolist / .numpy)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self._patches = contextlib.ExitStack()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DATA_DEPENDENT:
            self.ops[str(func)] += 1
        elif func in BOOL_INDEXED and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                          for i in (args[1] or [])):
            self.ops[f"{func} (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))

    def _python_read(self, name):
        real = getattr(torch.Tensor, name)
        owner = threading.get_ident()

        def counted(t, *a, **k):
            if threading.get_ident() == owner:
                self.ops[f"Tensor.{name}"] += 1
            return real(t, *a, **k)
        return counted

    def __enter__(self):
        for name in ("tolist", "numpy"):
            self._patches.enter_context(mock.patch.object(torch.Tensor, name, self._python_read(name)))
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._patches.close()

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def packed_batch(T=600, R=2, seed=0):
    """Two rows of packed documents spanning three 256-query attention blocks (one with padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (R, T), generator=g)
    lm = torch.rand(R, T, generator=g) > 0.2
    doc = torch.tensor([[0] * 200 + [1] * 300 + [2] * (T - 500), [0] * (T - 50) + [-1] * 50])
    pos = torch.stack([torch.cat([torch.arange(200), torch.arange(300), torch.arange(T - 500)]), torch.arange(T)])
    return ids, lm, doc, pos, torch.randn(R, T, 48, generator=g), torch.randn(R, T, 16, generator=g)


def forward_backward(obj, batch, layout, autocast=False):
    obj.drafter.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, stats = obj(micro_batch(*batch, layout=layout), [300.0, 250.0, 200.0], scale=2.0)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in obj.drafter.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk,autocast,chain", [(64, False, False), (None, True, False), (0, False, False),
                                                  (64, False, True), (0, False, True)])
def test_a_micro_batch_with_its_layout_reads_nothing_back_from_the_device(chunk, autocast, chain):
    """Forward and backward of the objective (SDPA over several query blocks, the chunked loss and
    the whole-batch one) with the layout the data thread computes: not one host read. Without it,
    the objective reads the sizes itself (as it did for every micro-batch before issue 23: 3
    per-block int(min()), 4 nonzero() and, chunked, a tolist() per step: 10); with it the results
    are the same bits. train.loss_chain's weights (chain) are built by scatters and gathers: no read either."""
    d, W_d = tiny_drafter(seed=2)
    obj = TTTObjective(d, W_d, 3, 0.8, chunk_tokens=chunk, chain_weights=chain)
    batch = packed_batch()
    layout = obj.layouts()(*batch[:3])  # on the host, as in the data thread
    with HostReads() as reads:
        got = forward_backward(obj, batch, layout, autocast)
    assert reads.total == 0, dict(reads.ops)
    with HostReads() as reads:
        ref = forward_backward(obj, batch, None, autocast)
    assert reads.total > 0  # the counter sees the reads the layout spares
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[2].keys() == ref[2].keys()
    for n in ref[2]:
        assert torch.equal(got[2][n], ref[2][n]), n


def test_the_layout_and_fixed_shape_gathers_equal_the_host_reads_they_replace():
    d, _ = tiny_drafter(seed=1)
    ids, lm, doc, pos, _, _ = packed_batch(seed=4)
    mask = torch.rand(1000, generator=torch.Generator().manual_seed(0)) > 0.6
    n = int(mask.sum())
    with HostReads() as reads:
        got = fixed_positions(mask, n)  # the count passed in, not read
    assert reads.total == 0 and torch.equal(got, mask.nonzero().squeeze(1))
    # TTTMask's key blocks from the host equal those it reads from the mask; any document ids
    for docs in (doc, torch.tensor([[5, 5, 9, 9, 9, 5, 2, 2] * 40])):
        L = docs.shape[1]
        idx = torch.arange(L)
        step0 = ((idx[None, :] <= idx[:, None]) & (docs[:, :, None] == docs[:, None, :])).unsqueeze(1)
        assert torch.equal(first_positions(docs), step0[:, 0].to(torch.uint8).argmax(-1))
        for block in (7, 64, 256):
            assert TTTMask(step0, block, key_floors(docs, block)).spans == TTTMask(step0, block).spans
    layout = ttt_layout(ids, lm, doc, d.t2d, 3, 16, "sdpa")
    assert layout.teacher > 0 and len(layout.counts) == 3 and all(b[-1] == n for b, n in zip(layout.bounds, layout.counts))
    assert ttt_layout(ids, lm, doc, d.t2d, 3, 16, "flex").key_floors is None


def test_the_flex_block_mask_is_built_without_host_reads():
    """FlexTTTMask numbers the documents by their first position (no torch.unique, no max read)."""
    doc = torch.tensor([[0] * 100 + [1] * 150 + [2] * 6 + [-1] * 44, [3] * 300])
    with HostReads() as reads:
        mask = FlexTTTMask(doc, FlexShape(2, 300, 3))
        mask.block_mask(2)
    assert reads.total == 0, dict(reads.ops)
    same = mask.doc[:, :300, None] == mask.doc[:, None, :300]
    assert torch.equal(same, doc[:, :, None] == doc[:, None, :])


def test_a_training_step_reads_the_device_once_whatever_its_micro_batches(synth_run, tiny8, tmp_path):
    """The real loop (offline, the batches prepared in the data thread): _optimizer_step makes as
    many host reads with 3 micro-batches as with 1; before issue 23 each micro-batch added its
    loss.item() and the objective's reads."""
    per_call = {}
    real = train_mod._optimizer_step

    def counted(ts, micro_batches, denom, window):
        with HostReads() as reads:
            out = real(ts, micro_batches, denom, window)
        per_call.setdefault(len(micro_batches), []).append(dict(reads.ops))
        return out

    with mock.patch.object(train_mod, "_optimizer_step", counted):
        for accum in (1, 3):
            run_train(copy_run(synth_run, tmp_path / f"run{accum}"), cfg_for(tiny8, max_steps=2, grad_accum=accum))
    one, three = per_call[1], per_call[3]
    assert len(one) == len(three) == 2
    # one read per step: the gradient norm with the losses' finiteness (before issue 23: 1 + 9 per
    # micro-batch on this tiny run, 10 with one micro-batch and 28 with three)
    assert one == three == [{"Tensor.tolist": 1}] * 2, (one, three)


# -------------------------------------------------------------------------------------------------
# The device feed: CUDA calls patched


class _Log(list):
    def add(self, *event):
        self.append((threading.current_thread().name,) + event)


def _fake_cuda(log: _Log):
    """torch.cuda's stream, event and pinning calls, recording their order; Batch.to records
    the stream it copies on and returns the batch as it is (no GPU here)."""
    current = {"stream": "main"}

    class Stream:
        def __init__(self, device=None):
            self.name = "side"
            log.add("stream", str(device))

        def wait_event(self, event):
            log.add("wait_event", self.name, event.n)

    class Main(Stream):
        def __init__(self):
            self.name = "main"

    main = Main()

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.n = Event.count

        def record(self, stream):
            log.add("record_event", stream.name, self.n)

    @contextlib.contextmanager
    def on_stream(stream):
        log.add("enter_stream", stream.name)
        current["stream"] = stream.name
        yield
        current["stream"] = "main"

    def pin(t):
        log.add("pin", id(t))
        return t

    def to(b, device, dtype, non_blocking=None):
        log.add("copy", current["stream"], non_blocking, id(b.input_ids))
        return b

    def record_stream(t, stream):
        log.add("record_stream", stream.name, id(t))

    return [mock.patch.object(torch.cuda, "Stream", Stream), mock.patch.object(torch.cuda, "Event", Event),
            mock.patch.object(torch.cuda, "stream", on_stream), mock.patch.object(torch.cuda, "device", lambda d: contextlib.nullcontext()),
            mock.patch.object(torch.cuda, "current_stream", lambda device=None: main),
            mock.patch.object(torch.cuda, "current_device", lambda: 0),
            mock.patch.object(torch.Tensor, "pin_memory", pin), mock.patch.object(torch.Tensor, "record_stream", record_stream),
            mock.patch.object(Batch, "to", to)]


def _batch(i):
    ids = torch.full((1, 4), i)
    return Batch(ids, ids > 0, torch.zeros_like(ids), torch.arange(4)[None], torch.zeros(1, 4, 6), torch.zeros(1, 4, 2), [i], 4)


def test_on_cuda_the_data_thread_pins_and_copies_on_a_side_stream_and_the_loop_waits_on_the_gpu():
    log = _Log()
    with contextlib.ExitStack() as stack:
        for p in _fake_cuda(log):
            stack.enter_context(p)
        feeder = DeviceFeeder(torch.device("cuda", 0), torch.bfloat16)
        steps = (((0, s), [_batch(10 * s + j) for j in range(2)]) for s in range(3))
        p = Prefetcher(steps, feeder=feeder)
        got = [next(p) for _ in range(3)]
        p.close()
    assert [pos for pos, _ in got] == [(0, 0), (0, 1), (0, 2)]
    assert log[0][1:] == ("stream", "cuda:0")  # one side stream, made by the training thread on its device
    worker = [e[1:] for e in log if e[0] == "train-data"]
    main = [e[1:] for e in log[1:] if e[0] != "train-data"]
    assert {e[0] for e in log[1:]} == {"train-data", "MainThread"}
    # the data thread, per step: on the side stream, each batch's six host tensors pinned, then its
    # non-blocking copy; then the event that marks the step's copies recorded on the side stream
    batch = [("pin",)] * 6 + [("copy", "side", True)]
    assert [e[:3] if e[0] == "copy" else e[:1] if e[0] == "pin" else e for e in worker] == [
        x for s in range(3) for x in [("enter_stream", "side")] + batch * 2 + [("record_event", "side", s + 1)]]
    # the training thread, per step: its current stream waits on that event (the GPU waits, not the
    # host), then every tensor of the step is recorded on the current stream; nothing pinned or copied
    assert [e[:2] if e[0] == "record_stream" else e for e in main] == [
        x for s in range(3) for x in [("wait_event", "main", s + 1)] + [("record_stream", "main")] * 12]


def test_on_the_cpu_batches_are_moved_as_before_without_pinning_or_streams():
    with mock.patch.object(torch.Tensor, "pin_memory", side_effect=AssertionError("pinned on the CPU")), \
         mock.patch.object(torch.cuda, "Stream", side_effect=AssertionError("a CUDA stream on the CPU")):
        feeder = DeviceFeeder(torch.device("cpu"), torch.float32)
        p = Prefetcher(iter([((0, 1), [_batch(1)])]), feeder=feeder)
        pos, (b,) = next(p)
        p.close()
    assert pos == (0, 1) and b.aux_hidden.dtype == torch.float32 and b.samples == [1]
    assert feeder.stream is None and p._slots is None


def _codec(fp8: bool):
    return codec_of(FP8 if fp8 else BF16)


def _stored_rows(fp8: bool, lengths=((5, 3), (7,)), A=3, H=8, seed=0):
    """Rows of samples as OfflineSource.sample gives them: from an fp8 store (float8 states and
    their scales: the parts of _codec(True)) or dequantised on the host to bf16 (what the loop got
    before), same values."""
    g = torch.Generator().manual_seed(seed)
    rows, index = [], 0
    for row in lengths:
        rows.append([])
        for n in row:
            qa, sa = quantize_fp8(torch.randn(n, A, H, generator=g) * 5)
            ql, sl = quantize_fp8(torch.randn(n, H, generator=g))
            s = {"input_ids": torch.randint(0, 50, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.3,
                 "index": index}
            if fp8:
                s.update(aux_hidden=(qa, sa), last_hidden=(ql, sl))
            else:
                s.update(aux_hidden=(dequantize_fp8(qa, sa),), last_hidden=(dequantize_fp8(ql, sl),))
            rows[-1].append(s)
            index += 1
    return rows


def test_fp8_states_travel_as_stored_and_are_dequantised_on_the_device_to_what_the_host_gave():
    fp8 = pack_rows(_stored_rows(True), codec=_codec(True))
    (aux, aux_scale), (last, last_scale) = fp8.aux_hidden, fp8.last_hidden
    assert aux.dtype == torch.float8_e4m3fn and aux.shape == (2, 8, 3, 8)
    assert aux_scale.shape == (2, 8, 3) and last_scale.shape == (2, 8) and last.shape == (2, 8, 8)
    # a quarter of bf16's bytes... plus a float32 scale per token and layer: 1 + 4/8 bytes per value here
    assert aux.element_size() == 1
    host = pack_rows(_stored_rows(False), codec=_codec(False))
    on_device, before = fp8.to(torch.device("cpu"), torch.bfloat16), host.to(torch.device("cpu"), torch.bfloat16)
    for k in ("input_ids", "loss_mask", "doc_ids", "position_ids", "aux_hidden", "last_hidden"):
        assert torch.equal(getattr(on_device, k), getattr(before, k)), k
    assert on_device.codec is None and on_device.aux_hidden.dtype == torch.bfloat16
    assert on_device.aux_hidden[1, 7:].abs().sum() == 0  # padding: zero states
    f32 = fp8.to(torch.device("cpu"), torch.float32)  # no bf16 rounding on the way: within bf16's step of it
    assert torch.allclose(f32.aux_hidden, before.aux_hidden.float(), rtol=2 ** -8, atol=0)


@pytest.mark.parametrize("fp8", [True, False])
def test_a_micro_batch_packed_into_a_reused_arena_equals_a_freshly_allocated_one(fp8):
    rows = _stored_rows(fp8)
    fresh = pack_rows(rows, codec=_codec(fp8))
    arena = HostArena(packed_bytes(2, 8, rows[0][0]), pin=False)
    arena.block.fill_(0xFF)  # what an earlier micro-batch left there: NaN states, garbage ids
    packed = pack_rows(rows, arena.reset(), codec=_codec(fp8))
    assert packed.host is arena
    lo, hi = arena.block.data_ptr(), arena.block.data_ptr() + arena.block.numel()
    names = ("ids", "mask", "doc", "pos", "aux", "aux_scale", "last", "last_scale") if fp8 else \
        ("ids", "mask", "doc", "pos", "aux", "last")
    assert len(packed.tensors()) == len(fresh.tensors()) == len(names)
    for name, a, b in zip(names, packed.tensors(), fresh.tensors()):
        assert lo <= a.data_ptr() < hi and a.is_contiguous(), name  # a view of the block, copied in one piece
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert (packed.samples, packed.tokens) == (fresh.samples, fresh.tokens)


def test_host_arenas_are_reused_round_robin_only_after_their_copy_has_ended():
    waited = []

    class Done:
        def __init__(self, n):
            self.n = n

        def synchronize(self):
            waited.append(self.n)

    arenas = HostArenas(2, pin=False)
    a, b = arenas.take(1000), arenas.take(1000)
    assert a is not b and waited == []
    a.done, b.done = Done(1), Done(2)
    assert arenas.take(800) is a and waited == [1] and a.done is None  # the oldest, after its copy
    assert arenas.take(1000) is b and waited == [1, 2]
    bigger = arenas.take(5000)  # a larger micro-batch than the arena was sized for: a new block in its place
    assert bigger is not a and bigger.block.numel() == 5000 and arenas.arenas == [bigger, b]
    with pytest.raises(ValueError, match="cannot hold"):
        b.reset().alloc((2000,), torch.float32)


def test_on_cuda_an_arena_is_marked_with_the_event_its_copy_ends_with():
    log = _Log()
    with contextlib.ExitStack() as stack:
        for p in _fake_cuda(log):
            stack.enter_context(p)
        feeder = DeviceFeeder(torch.device("cuda", 0), torch.bfloat16, accum=3)
        assert feeder.arenas.count == 6 and feeder.arenas.pin
        arena = HostArena(packed_bytes(2, 8, _stored_rows(True)[0][0]), pin=False)
        p = Prefetcher(iter([((0, 1), [pack_rows(_stored_rows(True), arena, codec=_codec(True))])]), feeder=feeder)
        next(p)
        p.close()
    recorded = [e for e in log if e[1] == "record_event"]
    assert len(recorded) == 1 and arena.done.n == recorded[0][3]


def test_the_fc_input_scale_of_an_fp8_first_batch_is_taken_from_its_dequantised_states():
    """train.fc_input_norm reads the first micro-batch on the host: from an fp8 store that batch holds float8
    codes until it is moved, so training moves it to the CPU in float32 first (train/stage.py)."""
    from draftsmith.train.objective import fc_input_scale

    fp8 = pack_rows(_stored_rows(True), codec=_codec(True)).to(torch.device("cpu"), torch.float32)
    host = pack_rows(_stored_rows(False), codec=_codec(False)).to(torch.device("cpu"), torch.float32)
    assert torch.allclose(fc_input_scale(fp8), fc_input_scale(host), rtol=1e-2)
    packed = pack_rows(_stored_rows(True), codec=_codec(True))
    codes = replace(packed, aux_hidden=packed.aux_hidden[0].flatten(2).float(), codec=None)
    assert not torch.allclose(fc_input_scale(codes), fc_input_scale(host), rtol=1e-2)  # the codes alone are not it
