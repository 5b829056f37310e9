"""The train stage: TTT targets and masks by hand, packing, checkpoint format and exact resume after
SIGKILL, the NaN stop, DDP equivalence (torchrun on gloo), offline == online, learning a signal."""

import json
import types
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import REPO, build_tiny_target, run_cli, stop_signals_default
from draftsmith import DraftsmithError, Terminated
from draftsmith.config import load_config
from draftsmith.model.config import LOSS_CHUNK_ELEMENTS
from draftsmith.extract.stage import run_extract
from draftsmith.extract.store import ExtractStore, encode_sample
from draftsmith.model.config import DrafterConfig
from draftsmith.model.dflash import DFlashDrafter
from draftsmith.model.eagle3 import Eagle3Drafter
from draftsmith.model.init import init_from_target
from draftsmith.rundir import RunDir, atomic_write_bytes, fingerprint
from draftsmith.target import target_info
from draftsmith.train.stage import NOT_FINGERPRINTED, run_train
from draftsmith.extract.hf import plan_batches
from draftsmith.train.data import Batch, Prefetcher, pack_epoch
from draftsmith.train.dflash import Blocks, DFlashObjective, draw_blocks
from draftsmith.train import launch
from draftsmith.train.distributed import Ranks, sum_by_name
from draftsmith.train.drafter import read_target_weights
from draftsmith.train.objective import (ChainWeights, ChunkedKL, KLPlan, LossMix, TTTObjective, mix_terms, overlap,
                                       resolve_attention, ttt_masks)
from draftsmith.train.schedule import TimeBudget, ema_decay, lr_lambda
from draftsmith.vocab import run_vocab

DV = 64  # draft vocabulary of the tiny runs


# -------------------------------------------------------------------------------------------------
# Helpers: a run with prepare + vocab (+ extract) built by the real stages


pytestmark = pytest.mark.usefixtures("one_thread")


def cycle_samples(vocab_size: int, n: int, seed: int = 0, lengths=(24, 60), prompt=(3, 8)) -> list[dict]:
    """Prompts of random tokens (loss mask 0), answers that walk a fixed permutation cycle over
    40 token ids (loss mask 1): the next answer token is a function of the current one."""
    rng = random.Random(1234)
    cycle = rng.sample(range(3, vocab_size), 40)
    nxt = {cycle[j]: cycle[(j + 1) % len(cycle)] for j in range(len(cycle))}
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt))]
        a = [rng.choice(cycle)]
        for _ in range(rng.randint(*lengths) - len(p) - 1):
            a.append(nxt[a[-1]])
        out.append({"id": f"s{i}", "input_ids": p + a, "loss_mask": [0] * len(p) + [1] * len(a), "truncated": False})
    return out


def write_prepare(run: RunDir, target, samples: list[dict]) -> dict:
    info = target_info(str(target))
    d = run.ensure().stage_dir("prepare")
    text = "".join(json.dumps(s) + "\n" for s in samples)
    (d / "samples.jsonl").write_text(text)
    n = len(samples)
    return run.write_manifest(
        "prepare", fingerprint=fingerprint(text), settings={},
        inputs={"target": info.name, "target_fingerprint": info.fingerprint},
        counts={"done": n, "total": n, "unit": "samples", "masked_tokens": sum(sum(s["loss_mask"]) for s in samples)},
        started=time.time(), outputs=["samples.jsonl"])


def base_sets(target, **train) -> list[str]:
    # a bf16 store: the tests hold offline training to online training's (and the forward's) numbers
    sets = {"target": str(target), "vocab.draft_vocab_size": DV, "train.seq_len": 64, "train.batch_tokens": 128,
            "train.warmup_steps": 2, "train.lr": 3e-3, "train.log_every_s": 0.001, "train.checkpoint_every": 1000,
            "extract.store_format": "bf16",
            # every sample trains unless a test asks for validation (the default's floor would hold out a tenth)
            "train.validation": 0}
    sets.update({f"train.{k}" if "." not in k else k: v for k, v in train.items()})
    return [f"{k}={v}" for k, v in sets.items()]


def cfg_for(target, **train):
    return load_config(None, base_sets(target, **train))


def make_run(path: Path, target, samples: list[dict], extract: bool = True) -> RunDir:
    """prepare (written) + vocab (run) + extract (run) on the tiny target."""
    run = RunDir(path)
    write_prepare(run, target, samples)
    run_vocab(run, cfg_for(target))
    if extract:
        run_extract(run, cfg_for(target, **{"extract.shard_size": 16}))
    return run


def synthesize_states(run: RunDir, target, scale: float = 8.0, nan_sample: int | None = None,
                      nan_outside_loss: bool = False) -> None:
    """Replace the extracted states by a learnable signal: last_hidden[j] makes the target's
    draft-vocab distribution peak at t[j+1]; aux_hidden[j] carries t[j]'s embedding. nan_sample:
    that sample's aux state at its middle is NaN (with nan_outside_loss: its last_hidden at a
    position outside the loss mask instead, which no loss ever reads)."""
    info = target_info(str(target))
    E = read_target_weights(info)[0].float()  # [V, H], tied lm_head
    store = ExtractStore(run)
    g = torch.Generator().manual_seed(0)
    for i in range(len(store)):
        rec = store[i]
        ids = rec["input_ids"].long()
        L, H = len(ids), E.shape[1]
        nxt = torch.cat([ids[1:], ids[-1:]])
        e = E[nxt]
        last = scale * e / (e * e).sum(-1, keepdim=True)  # logit of t[j+1] = scale
        A = len(store.layers)
        aux = (E[ids] * 30).unsqueeze(1).expand(L, A, H) + 0.01 * torch.randn(L, A, H, generator=g)
        if nan_sample == i and nan_outside_loss:
            last = last.clone()
            last[int((~rec["loss_mask"].bool()).nonzero()[0])] = float("nan")
        elif nan_sample == i:
            aux = aux.clone()
            aux[L // 2] = float("nan")
        sample = {"id": store.metadata(i)["id"], "input_ids": ids.tolist(), "loss_mask": rec["loss_mask"].tolist()}
        atomic_write_bytes(store.path(i), encode_sample(i, sample, aux, last, store.layers))


def final_weights(run: RunDir) -> dict:
    return load_file(str(run.path / "train" / "final" / "model.safetensors"))


def metrics(run: RunDir) -> list[dict]:
    return [json.loads(x) for x in (run.path / "train" / "metrics.jsonl").read_text().splitlines()]


def copy_run(src: RunDir, dst: Path) -> RunDir:
    shutil.copytree(src.path, dst, ignore=shutil.ignore_patterns("train"))
    return RunDir(dst)


@pytest.fixture(scope="module")
def synth_run(tiny8, tmp_path_factory) -> RunDir:
    """A finished prepare/vocab/extract run with the learnable synthetic states (copy before use)."""
    run = make_run(tmp_path_factory.mktemp("synth") / "run", tiny8, cycle_samples(target_info(str(tiny8)).vocab_size, 48))
    synthesize_states(run, tiny8)
    return run


# -------------------------------------------------------------------------------------------------
# Targets, masks, loss: by hand on a tiny case


def micro_batch(ids, mask, doc, pos, aux, last, layout=None) -> Batch:
    """The objective's input from plain tensors ([R, T] and [R, T, 3H] / [R, T, H]), as the loop hands
    it; samples and tokens are left empty: the objective reads neither (nor does counting them here
    add a device read)."""
    return Batch(ids, mask, doc, pos, aux, last, samples=[], tokens=0, layout=layout)


def tiny_drafter(seed=0, V=20, H=16, draft_ids=(0, 2, 3, 5, 7, 11, 13, 17)):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=V, draft_vocab_size=len(draft_ids))
    d = Eagle3Drafter(cfg)
    W = torch.randn(V, H)
    init_from_target(d, torch.randn(V, H), W, None, torch.tensor(draft_ids))
    return d, W[torch.tensor(draft_ids)]


def tiny_dflash(d):
    """A DFlash drafter (block_size 3) on the draft vocabulary of tiny_drafter `d`."""
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=20, draft_vocab_size=8, mask_token_id=1, block_size=3, kind="dflash")
    dd = DFlashDrafter(cfg)
    dd.d2t.copy_(d.d2t)
    dd.t2d.copy_(d.t2d)
    return dd


# one row: document 0 (5 tokens), document 1 (3 tokens), one padding position
IDS = torch.tensor([[2, 3, 5, 19, 7, 11, 13, 4, 0]])
MASK = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool)
DOC = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, -1]])
POS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0]])


def test_masks_respect_documents_loss_mask_and_draft_vocab():
    d, _ = tiny_drafter()
    masks = ttt_masks(IDS, MASK, DOC, d.t2d, 3)
    got = [(m[0].nonzero().flatten().tolist(), v[0].nonzero().flatten().tolist()) for m, v in masks]
    # k=0, i -> t[i+2]: i=0 (5, ok), 1 (19 not in draft vocab: a miss, not trained), 2 (7, ok),
    # 3 and 4 cross into document 1, 5 (4 not in draft vocab), 6 reaches the padding
    assert got[0] == ([0, 1, 2, 5], [0, 2])
    # k=1, i -> t[i+3]: 0 (19: miss), 1 (7), 2.. cross the document or run off it
    assert got[1] == ([0, 1], [1])
    # k=2, i -> t[i+4]: only i=0 (7) stays in document 0
    assert got[2] == ([0], [0])
    # a step that runs past the row has no position at all
    assert not any(m.any() or v.any() for m, v in ttt_masks(IDS[:, :4], MASK[:, :4], DOC[:, :4], d.t2d, 3)[2:])


def test_dflash_anchors_respect_documents_and_loss_mask_and_the_host_draw_is_the_loops():
    """DFlash's anchors (train.method=dflash): only positions with context whose next token is trained; a slot is
    trained only inside its anchor's document, on the loss mask and in the draft vocabulary. The draw the loop makes
    in its data thread (layouts, on the host) is the one forward would make, and gives the same loss."""
    d, W_d = tiny_drafter()
    t2d = d.t2d
    every = draw_blocks(IDS, MASK, DOC, t2d, block_size=3, max_anchors=9)
    anchors = every.anchors[0][every.anchor_ok[0]].tolist()
    # a in 1..T-2 with MASK[a+1] and a, a+1 in one document (and a-1 too: a has context)
    assert anchors == [1, 2, 3, 6]
    slots = {a: every.masked[0, i].tolist() for i, a in enumerate(every.anchors[0].tolist()) if a in anchors}
    # slot k predicts t[a+k]: 3 -> t4 (doc 0, trained), t5 (doc 1): not; 6 -> t7, then the padding
    assert slots == {1: [True, True], 2: [True, True], 3: [True, False], 6: [True, False]}
    v = every.valid[0][every.anchor_ok[0]]
    assert v.tolist() == [[True, False], [False, True], [True, False], [False, False]]  # 19, 4 not drafted
    few = draw_blocks(IDS, MASK, DOC, t2d, block_size=3, max_anchors=2)
    assert few.anchor_ok.all() and set(few.anchors[0].tolist()) <= set(anchors)
    again = draw_blocks(IDS, MASK, DOC, t2d, block_size=3, max_anchors=2)
    assert torch.equal(few.anchors, again.anchors)  # seeded by the tokens: the same draw after a resume

    dd = tiny_dflash(d)
    obj = DFlashObjective(dd, W_d, 0.8, max_anchors=3)
    aux, last = torch.randn(1, 9, 48), torch.randn(1, 9, 16)
    host = obj.layouts()(IDS, MASK, DOC)
    assert isinstance(host, Blocks)
    drawn = micro_batch(IDS, MASK, DOC, POS, aux, last)
    given = micro_batch(IDS, MASK, DOC, POS, aux, last, layout=host)
    assert torch.equal(obj.counts(drawn), obj.counts(given)) and obj.counts(given).sum() > 0
    denom = obj.counts(given).tolist()
    (l1, s1), (l2, s2) = obj(drawn, denom), obj(given, denom)
    assert torch.equal(l1, l2) and torch.equal(s1, s2) and l1 > 0


def test_loss_targets_and_accuracy_match_a_hand_computation():
    d, W_d = tiny_drafter()
    d.eval()
    aux = torch.randn(1, 9, 48)
    last = torch.randn(1, 9, 16)
    gamma = 0.5
    valid = {0: [0, 2], 1: [1], 2: [0]}
    masked = {0: 4, 1: 2, 2: 1}
    logits = d.ttt_forward(IDS, aux, 3, position_ids=POS, doc_ids=DOC)  # the plain path: full logits
    draft_ids = d.draft_ids()
    expected_loss, kl, correct = 0.0, {}, {}
    for k in range(3):
        kl[k] = 0.0
        correct[k] = 0
        for i in valid[k]:
            p = torch.softmax(W_d @ last[0, i + 1 + k], -1)  # target distribution for token i+2+k
            logq = torch.log_softmax(logits[k][0, i], -1)
            kl[k] += float((p * (p.log() - logq)).sum().detach())
            correct[k] += int(draft_ids[logits[k][0, i].argmax()] == IDS[0, i + 2 + k])
        expected_loss += gamma ** k * kl[k] / len(valid[k])
    obj = TTTObjective(d, W_d, 3, gamma)
    denom = [float(len(valid[k])) for k in range(3)]
    loss, stats = obj(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    assert loss.item() == pytest.approx(expected_loss, rel=1e-5)
    for k in range(3):
        assert stats[k, 0].item() == pytest.approx(kl[k], rel=1e-5)
        assert stats[k, 1].item() == len(valid[k])
        assert stats[k, 2].item() == correct[k]
        assert stats[k, 3].item() == masked[k]
    # the gradient reaches every trainable parameter (one step's term alone included)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in d.parameters() if p.requires_grad)


def test_teacher_temperature_sharpens_the_target_distribution():
    d, W_d = tiny_drafter()
    d.eval()
    aux, last = torch.randn(1, 9, 48), torch.randn(1, 9, 16)
    valid = {0: [0, 2], 1: [1], 2: [0]}
    logits = d.ttt_forward(IDS, aux, 3, position_ids=POS, doc_ids=DOC)
    T = 0.25
    expected = 0.0
    for k in range(3):
        kl = 0.0
        for i in valid[k]:
            p = torch.softmax(W_d @ last[0, i + 1 + k] / T, -1)
            kl += float((p * (p.log() - torch.log_softmax(logits[k][0, i], -1))).sum().detach())
        expected += kl / len(valid[k])
    denom = [float(len(valid[k])) for k in range(3)]
    loss, _ = TTTObjective(d, W_d, 3, 1.0, teacher_temperature=T)(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    plain, _ = TTTObjective(d, W_d, 3, 1.0)(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    assert abs(plain.item() - expected) > 1e-3  # the temperature is not a no-op


def test_feature_noise_perturbs_training_only():
    d, W_d = tiny_drafter()
    d.eval()
    aux, last = torch.randn(1, 9, 48), torch.randn(1, 9, 16)
    denom = [2.0, 1.0, 1.0]
    plain, _ = TTTObjective(d, W_d, 3, 1.0)(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    noisy = TTTObjective(d, W_d, 3, 1.0, feature_noise=0.5)
    torch.manual_seed(0)
    a, _ = noisy(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    torch.manual_seed(1)
    b, _ = noisy(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    assert a.item() != pytest.approx(plain.item(), rel=1e-4) and a.item() != pytest.approx(b.item(), rel=1e-4)
    noisy.eval()  # not while evaluating: the states are what serving will see
    c, _ = noisy(micro_batch(IDS, MASK, DOC, POS, aux, last), denom)
    assert c.item() == pytest.approx(plain.item(), rel=1e-6)


def test_return_hidden_gives_the_states_behind_the_logits():
    d, _ = tiny_drafter()
    aux = torch.randn(2, 9, 48)
    ids = IDS.expand(2, 9)
    logits = d.ttt_forward(ids, aux, 3, position_ids=POS.expand(2, 9), doc_ids=DOC.expand(2, 9))
    states = d.ttt_forward(ids, aux, 3, position_ids=POS.expand(2, 9), doc_ids=DOC.expand(2, 9), return_hidden=True)
    for lg, h in zip(logits, states):
        assert h.shape == (2, 9, 16)
        torch.testing.assert_close(d.lm_head(d.norm(h)), lg)


@pytest.mark.parametrize("block", [1, 7, 16, 64])
def test_block_sparse_ttt_attention_equals_the_dense_mask(block):
    d, _ = tiny_drafter(seed=1)
    g = torch.Generator().manual_seed(0)
    B, L = 2, 40
    ids = torch.randint(0, 20, (B, L), generator=g)
    aux = torch.randn(B, L, 48, generator=g)
    # row 0: packed documents and padding; row 1: a document that comes back after another
    doc = torch.tensor([[0] * 9 + [1] * 17 + [2] * 10 + [-1] * 4, [0] * 12 + [1] * 8 + [0] * 20])
    pos = torch.cat([torch.arange(9), torch.arange(17), torch.arange(10), torch.zeros(4, dtype=torch.long)]).expand(B, L)
    outs = {}
    for name, blk in (("dense", None), ("blocked", block)):
        d.zero_grad()
        states = d.ttt_forward(ids, aux, 3, position_ids=pos, doc_ids=doc, return_hidden=True, attn_block=blk)
        sum((st * torch.randn(st.shape, generator=torch.Generator().manual_seed(k))).sum() for k, st in enumerate(states)).backward()
        outs[name] = ([st.detach() for st in states], {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None})
    for a, b in zip(outs["dense"][0], outs["blocked"][0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert outs["dense"][1].keys() == outs["blocked"][1].keys() and "fc.weight" in outs["dense"][1]
    for n in outs["dense"][1]:
        torch.testing.assert_close(outs["dense"][1][n], outs["blocked"][1][n], rtol=1e-4, atol=1e-5)


def _packed_case(seed=0, R=2, T=50):
    """Two rows of packed documents (one with padding), ids half in the tiny draft vocabulary."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 20, (R, T), generator=g)
    lm = torch.rand(R, T, generator=g) > 0.2
    doc = torch.tensor([[0] * 20 + [1] * 30, [0] * 45 + [-1] * 5])
    pos = torch.stack([torch.cat([torch.arange(20), torch.arange(30)]), torch.arange(T)])
    return ids, lm, doc, pos, torch.randn(R, T, 48, generator=g), torch.randn(R, T, 16, generator=g)


def _loss_and_grads(d, W_d, chunk, batch, autocast=False, temperature=1.0, mix=LossMix()):
    d.zero_grad()
    obj = TTTObjective(d, W_d, 3, 0.8, teacher_temperature=temperature, chunk_tokens=chunk, mix=mix)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, stats = obj(micro_batch(*batch), [30.0, 25.0, 20.0], scale=2.0)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk", [1, 3, None])
def test_chunked_loss_equals_the_whole_batch_loss_and_its_gradients(chunk):
    """The loss a chunk of teacher positions at a time (ChunkedKL) against the loss over the whole
    micro-batch (chunk_tokens=0, the loss as it was): loss, statistics and every gradient to 1e-5
    in float32. Under bf16 autocast the same bf16 values reach every layer (equal gradients); the
    LM head's gradient is accumulated in float32 instead of one bf16 product (bf16 rounding apart)."""
    d, W_d = tiny_drafter(seed=2)
    batch = _packed_case()
    ref = _loss_and_grads(d, W_d, 0, batch, temperature=0.7)
    got = _loss_and_grads(d, W_d, chunk, batch, temperature=0.7)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
    assert got[2].keys() == ref[2].keys() and "lm_head.weight" in ref[2] and "fc.weight" in ref[2]
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=1e-5, atol=1e-6, msg=n)
    ref, got = (_loss_and_grads(d, W_d, c, batch, autocast=True) for c in (0, chunk))
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for n in ref[2]:
        tol = dict(rtol=2e-2, atol=1e-2 * float(ref[2][n].abs().max())) if n == "lm_head.weight" else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[2][n], ref[2][n], **tol, msg=n)


def test_the_chunked_loss_under_bf16_makes_no_float32_copy_of_the_heads_gradient(monkeypatch):
    """Issue 71: under autocast each chunk's bf16 [Dv, H] product is added into the float32 gradient element by
    element; a float32 copy of it per chunk (0.9 GB at Kimi's widths) is not made: the one float32 [Dv, H] tensor
    ChunkedKL makes is the gradient itself, whatever the number of chunks. The values are those of the copy's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    made: list[tuple] = []

    class Outputs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.overloadpacket.__name__.endswith("_"):  # a new tensor, not one changed in place
                for t in out if isinstance(out, (tuple, list)) else [out]:
                    if isinstance(t, torch.Tensor) and not t._is_view():  # new memory, not a view of a tensor
                        made.append((tuple(t.shape), t.dtype))
            return out

    forward = ChunkedKL.forward

    def watched(ctx, plan, weight, *rest):
        with Outputs():
            return forward(ctx, plan, weight, *rest)
    monkeypatch.setattr(ChunkedKL, "forward", staticmethod(watched))
    d, W_d = tiny_drafter(seed=2)
    got = _loss_and_grads(d, W_d, 1, _packed_case(), autocast=True)  # a chunk per teacher row: many chunks
    head = tuple(d.lm_head.weight.shape)
    assert made.count((head, torch.bfloat16)) > 2  # the chunks' bf16 products
    assert made.count((head, torch.float32)) == 1  # the gradient, and no copy
    monkeypatch.setattr(ChunkedKL, "forward", staticmethod(forward))
    assert torch.equal(_loss_and_grads(d, W_d, 1, _packed_case(), autocast=True)[2]["lm_head.weight"],
                       got[2]["lm_head.weight"])


MIXES = [LossMix(kl=0.5, top1=0.5), LossMix(kl=0.0, tv=1.0), LossMix(kl=0.3, rkl=0.7), LossMix(kl=0.0, rkl=0.2, tv=0.3, top1=1.5)]


@pytest.mark.parametrize("mix", MIXES, ids=lambda m: f"kl{m.kl}-rkl{m.rkl}-tv{m.tv}-top1{m.top1}")
def test_loss_mixes_chunked_equal_the_whole_batch_and_their_gradients_are_autograds(mix):
    """Each LossMix: the chunked loss's hand-written gradient (mix_grad) against autograd through the
    whole-batch loss (mix_terms), loss and every gradient to 1e-5; the statistics still report the
    forward KL, the same as under the pure KL loss."""
    d, W_d = tiny_drafter(seed=3)
    batch = _packed_case(seed=1)
    ref = _loss_and_grads(d, W_d, 0, batch, temperature=0.8, mix=mix)
    kl_only = _loss_and_grads(d, W_d, 0, batch, temperature=0.8)
    torch.testing.assert_close(ref[1], kl_only[1])  # the logged KL does not depend on the mix
    assert not torch.allclose(ref[0], kl_only[0])  # ... but the loss does
    for chunk in (1, 4, None):
        got = _loss_and_grads(d, W_d, chunk, batch, temperature=0.8, mix=mix)
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-5)
        assert got[2].keys() == ref[2].keys()
        for n in ref[2]:  # float32 rounding of sums over the vocabulary: relative to the gradient's size
            atol = 1e-6 * max(1.0, float(ref[2][n].abs().max()))
            torch.testing.assert_close(got[2][n], ref[2][n], rtol=1e-5, atol=atol, msg=n)


def _chain_loss_and_grads(d, W_d, chunk, batch, mix=LossMix(), chain=True):
    """_loss_and_grads with train.loss_chain's weighting (TTTObjective's chain_weights)."""
    d.zero_grad()
    obj = TTTObjective(d, W_d, 3, 0.8, teacher_temperature=0.8, chunk_tokens=chunk, mix=mix, chain_weights=chain)
    loss, stats = obj(micro_batch(*batch), [30.0, 25.0, 20.0], scale=2.0)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mix", [LossMix(), MIXES[3]], ids=["kl", "mix"])
def test_chain_loss_off_or_at_weight_one_is_the_loss_before_it(mix, monkeypatch):
    """train.loss_chain off leaves the loss as it was (the pre-change code gave the same bits, checked once with
    HEAD's objective.py at the change); on, with every weight forced to 1, it is that loss again: bit for bit where
    the loss is summed per position anyway (a mix), to rounding under pure KL (whose chunk sum is one dot product)."""
    d, W_d = tiny_drafter(seed=3)
    batch = _packed_case(seed=1)
    monkeypatch.setattr(ChainWeights, "take", lambda self, k, alpha, s=0, e=None: torch.ones_like(alpha))
    for chunk in (0, 4, None):
        off = _chain_loss_and_grads(d, W_d, chunk, batch, mix, chain=False)
        ones = _chain_loss_and_grads(d, W_d, chunk, batch, mix, chain=True)
        assert off[2].keys() == ones[2].keys() and "lm_head.weight" in off[2]
        if not mix.pure_kl or chunk == 0:
            assert torch.equal(off[0], ones[0]) and torch.equal(off[1], ones[1]), chunk
            assert all(torch.equal(off[2][n], ones[2][n]) for n in off[2]), chunk
        else:
            torch.testing.assert_close(ones[0], off[0], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ones[1], off[1], rtol=1e-6, atol=1e-6)
            for n in off[2]:
                torch.testing.assert_close(ones[2][n], off[2][n], rtol=1e-5, atol=1e-7, msg=n)


def test_chain_weights_by_hand_scale_step_ones_gradient_by_one_minus_step_zeros_tv():
    """ChunkedKL on distributions made by hand (identity heads: the logits are the states): step 0 at position 0 has
    p = (.4, .4, .1, .1), q = (.5, .3, .1, .1), TV 0.1, so step 1's gradient at position 0 is 0.9 x its unweighted
    one; position 2, whose step-0 target is outside the draft vocabulary (not a step-0 position), contributes
    nothing at step 1; step 0's gradient is unweighted."""
    p0, q0 = torch.tensor([0.4, 0.4, 0.1, 0.1]), torch.tensor([0.5, 0.3, 0.1, 0.1])
    assert overlap(p0[None], q0[None]).item() == pytest.approx(0.9)  # 1 - TV
    eye = torch.eye(4)
    # teacher rows: positions 1, 2, 4 (step 0 at positions 0, 1 reads rows of 1, 2; step 1 at 0, 2 those of 2, 4)
    teacher = torch.tensor([p0.tolist(), [0.1, 0.2, 0.3, 0.4], [0.7, 0.1, 0.1, 0.1]]).log()
    g = torch.Generator().manual_seed(0)
    x0 = torch.stack([q0.log(), torch.randn(4, generator=g)])  # step 0's states at positions 0, 1
    x1 = torch.randn(2, 4, generator=g)  # step 1's at positions 0, 2
    positions = [torch.tensor([0, 1]), torch.tensor([0, 2])]

    def grads(chain):
        xs = [x0.clone().requires_grad_(), x1.clone().requires_grad_()]
        plan = KLPlan(rows=[torch.tensor([0, 1]), torch.tensor([1, 2])],
                      targets=[torch.zeros(2, dtype=torch.long)] * 2, weights=[1.0, 0.5], bounds=[[0, 2], [0, 2]],
                      d2t=torch.zeros(4, dtype=torch.long), temperature=1.0, chunk=8, grad_weight=False, grad_states=True,
                      chain=ChainWeights(positions, 4, "cpu") if chain else None)
        loss, kl, *_ = ChunkedKL.apply(plan, eye, eye, teacher, *xs)
        loss.backward()
        return loss.detach(), kl, [x.grad for x in xs]

    (loss, kl, (g0, g1)), (plain, kl_plain, (u0, u1)) = grads(True), grads(False)
    # the reported KL is unweighted (summed per position or as one dot product: float32 rounding apart)
    torch.testing.assert_close(kl, kl_plain, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(g0, u0, rtol=0, atol=0)
    torch.testing.assert_close(g1[0], 0.9 * u1[0], rtol=1e-6, atol=1e-7)
    assert u1[1].abs().sum() > 0 and torch.equal(g1[1], torch.zeros(4))
    # the loss: step 0 whole, step 1 at position 0 only, at 0.9
    step1 = float((teacher[1].exp() * (teacher[1] - torch.log_softmax(x1[0], -1))).sum())
    assert loss.item() == pytest.approx(kl[0].item() + 0.5 * 0.9 * step1, rel=1e-5)


def _naive_chain_loss(d, W_d, batch, mix, gamma=0.8, temperature=0.8, denom=(30.0, 25.0, 20.0), scale=2.0):
    """train.loss_chain's loss as written: full logits per step ([R, T, Dv]), step k's per-position loss weighted by
    the product over j < k of where(valid_j, 1 - TV_j, 0), detached, and divided by the valid positions' count."""
    ids, lm, doc, pos, aux, last = batch
    R, T = ids.shape
    masks = ttt_masks(ids, lm, doc, d.t2d, 3)
    logits = d.ttt_forward(ids, aux, 3, position_ids=pos, doc_ids=doc)  # 3 x [R, T, Dv]
    w, loss = torch.ones(R, T), 0.0
    for k in range(3):
        nxt = torch.zeros_like(last)
        nxt[:, :T - 1 - k] = last[:, 1 + k:]  # step k at i: the target's state at i+1+k
        logp = torch.log_softmax((nxt @ W_d.t()) / temperature, -1)
        logq = torch.log_softmax(logits[k], -1)
        p, valid = logp.exp(), masks[k][1]
        per_pos = mix.kl * (p * (logp - logq)).sum(-1) + mix_terms(mix, p.flatten(0, 1), logp.flatten(0, 1),
                                                                   logq.flatten(0, 1)).view(R, T)
        loss = loss + scale * gamma ** k / denom[k] * (per_pos * w * valid).sum()
        w = w * torch.where(valid, torch.minimum(p, logq.detach().exp()).sum(-1), 0.0)
    return loss


@pytest.mark.parametrize("mix", [LossMix(), MIXES[3]], ids=["kl", "mix"])
def test_chain_loss_and_its_hand_written_gradient_equal_autograd_on_the_loss_as_written(mix):
    """train.loss_chain: the chunked loss (ChunkedKL's backward scaling each position's row by its weight) and the
    whole-batch one against autograd through the weighted loss written out plainly, loss and every gradient to
    float32 rounding; the weights change the loss, not the logged KL."""
    d, W_d = tiny_drafter(seed=3)
    batch = _packed_case(seed=1)
    d.zero_grad()
    ref_loss = _naive_chain_loss(d, W_d, batch, mix)
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in d.named_parameters() if p.grad is not None}
    off = _chain_loss_and_grads(d, W_d, 0, batch, mix, chain=False)
    assert ref_loss.item() < off[0].item()  # later steps' terms shrink by weights <= 1
    for chunk in (0, 1, 4, None):
        got = _chain_loss_and_grads(d, W_d, chunk, batch, mix)
        torch.testing.assert_close(got[0], ref_loss.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], off[1], rtol=1e-5, atol=1e-5)
        assert got[2].keys() == ref.keys()
        for n in ref:
            atol = 1e-6 * max(1.0, float(ref[n].abs().max()))
            torch.testing.assert_close(got[2][n], ref[n], rtol=1e-5, atol=atol, msg=n)


def test_dflash_chain_loss_weights_a_blocks_slots_by_the_slots_before():
    """DFlashObjective with chain_weights: slot 2's loss at an anchor weighted by 1 - TV of slot 1 there (0 where
    slot 1 is not trained), against the same weighting written per anchor; the logged KL unchanged."""
    d, W_d = tiny_drafter()
    dd = tiny_dflash(d)
    ids = torch.tensor([[2, 3, 5, 7, 11, 13, 19, 17, 0, 2, 3, 5]])
    mask, doc, pos = torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids), torch.arange(12)[None]
    aux, last = torch.randn(1, 12, 48), torch.randn(1, 12, 16)
    on, off = (DFlashObjective(dd, W_d, 0.8, max_anchors=12, chain_weights=c) for c in (True, False))
    batch = micro_batch(ids, mask, doc, pos, aux, last)
    denom = on.counts(batch).tolist()
    (l_on, s_on), (l_off, s_off) = on(batch, denom), off(batch, denom)
    assert torch.equal(s_on, s_off) and l_on < l_off
    blocks = draw_blocks(ids, mask, doc, dd.t2d, 3, 12)
    assert not blocks.valid[0, :, 0].all() and (blocks.valid[0, :, 1] & ~blocks.valid[0, :, 0]).any()
    with torch.no_grad():
        states = dd.block_forward(ids, aux, blocks.anchors, pos, doc)  # [1, M, 3, H]
        want = 0.0
        for m, a in enumerate(blocks.anchors[0].tolist()):
            w = 1.0
            for j in range(2):
                if not blocks.valid[0, m, j]:
                    w = 0.0
                    continue
                logp = torch.log_softmax(W_d @ last[0, a + j], -1)
                logq = torch.log_softmax(dd.lm_head(dd.norm(states[0, m, j + 1])), -1)
                want += w * 0.8 ** j / denom[j] * float((logp.exp() * (logp - logq)).sum())
                w *= float(torch.minimum(logp.exp(), logq.exp()).sum())
    assert l_on.item() == pytest.approx(want, rel=1e-5)


def test_loss_positions_follow_loss_on_and_skip_each_samples_first_tokens():
    from draftsmith.train.stage import loss_positions

    assert loss_positions(MASK, DOC, POS, "assistant", 0).tolist() == MASK.tolist()
    assert loss_positions(MASK, DOC, POS, "all", 0).tolist() == [[True] * 8 + [False]]
    # the first two tokens of each document (positions 0, 1) are left out, in both modes
    assert loss_positions(MASK, DOC, POS, "all", 2).tolist() == [[False, False, True, True, True, False, False, True, False]]
    assert loss_positions(MASK, DOC, POS, "assistant", 2).tolist() == [[False, False, True, True, True, False, False, True, False]]
    assert loss_positions(MASK, DOC, POS, "assistant", 4).tolist() == [[False] * 4 + [True] + [False] * 4]


def test_loss_mix_terms_by_hand():
    """mix_terms on one position against the textbook formulas."""
    logits_p, logits_q = torch.tensor([[2.0, 0.5, -1.0, 0.0]]), torch.tensor([[0.0, 1.5, 0.2, -0.3]])
    p, logq = torch.softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    q = logq.exp()
    assert mix_terms(LossMix(kl=0, rkl=1), p, p.log(), logq).item() == pytest.approx(float((q * (q.log() - p.log())).sum()))
    assert mix_terms(LossMix(kl=0, tv=1), p, None, logq).item() == pytest.approx(float(0.5 * (p - q).abs().sum()))
    assert mix_terms(LossMix(kl=0, top1=1), p, None, logq).item() == pytest.approx(-float(logq[0, 0]))  # argmax p = 0
    assert LossMix().pure_kl and not LossMix(kl=0.5).pure_kl and not LossMix(top1=0.1).pure_kl
    with pytest.raises(DraftsmithError, match="at least one weight"):
        load_config(None, ["train.loss_kl=0"])
    for bad in ("train.loss_tv=-1", "train.gamma=5"):
        with pytest.raises(DraftsmithError, match=bad.split("=")[0]):
            load_config(None, [bad])
    assert load_config(None, ["train.gamma=1.5", "train.loss_top1=0.5"]).train.loss_top1 == 0.5


class _VocabBlocks(TorchDispatchMode):
    """The most rows of any [rows, Dv] floating-point tensor an op allocates (views aside)."""

    def __init__(self, dv):
        super().__init__()
        self.dv, self.rows = dv, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in ([] if func.is_view else out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2 and t.shape[1] == self.dv:
                self.rows = max(self.rows, t.shape[0])
        return out


def test_chunked_loss_keeps_no_vocabulary_block_of_the_whole_micro_batch():
    """No [positions, Dv] block larger than a chunk is made, forward or backward (the whole-batch
    loss makes them for all of its ~60 teacher positions); the default chunk follows Dv."""
    d, W_d = tiny_drafter(seed=2, draft_ids=(0, 2, 3, 5, 7, 9, 11, 13, 15, 17, 19))  # Dv 11: no other width
    batch = _packed_case()
    teacher_rows = int(torch.stack([v for _, v in ttt_masks(batch[0], batch[1], batch[2], d.t2d, 3)]).any(0).sum())
    for chunk, most in ((0, teacher_rows), (4, 4)):
        with _VocabBlocks(W_d.shape[0]) as seen:
            _loss_and_grads(d, W_d, chunk, batch)
        assert 0 < seen.rows <= most and (chunk > 0 or seen.rows > 20), (chunk, seen.rows)
    with _VocabBlocks(W_d.shape[0]) as seen:  # train.loss_chain: its weights are [positions] per step, no wider
        _chain_loss_and_grads(d, W_d, 4, batch)
    assert 0 < seen.rows <= 4, seen.rows
    assert TTTObjective(d, W_d, 3, 0.8).chunk_tokens == LOSS_CHUNK_ELEMENTS // W_d.shape[0]
    assert TTTObjective(d, torch.zeros(32000, 16), 3, 0.8).chunk_tokens == 524


def test_attention_auto_is_flex_on_cuda_sdpa_on_the_cpu_and_flex_cannot_train_on_the_cpu():
    assert resolve_attention("auto", torch.device("cpu")) == "sdpa"
    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_attention("sdpa", torch.device("cuda")) == "sdpa"
    assert resolve_attention("flex", torch.device("cuda")) == "flex"
    with pytest.raises(DraftsmithError, match="train.attention: flex cannot train on the CPU"):
        resolve_attention("flex", torch.device("cpu"))
    for bad in ("train.attention=xformers", "train.loss_chunk_tokens=-1"):
        with pytest.raises(DraftsmithError, match=bad.split("=")[0]):
            load_config(None, [bad])
    assert {"attention", "loss_chunk_tokens"} <= set(NOT_FINGERPRINTED)


def test_schedule():
    f = lr_lambda(warmup=4, total=20, min_ratio=0.1)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1) and f(12) == pytest.approx(0.55)
    # with a time budget the cosine follows whichever of steps and time is further along; warm-up stays in steps
    share = [0.0]
    g = lr_lambda(warmup=4, total=1000, min_ratio=0.1, time_share=lambda: share[0])
    assert g(1) == 0.5 and g(4) == pytest.approx(1.0)
    share[0] = 0.5
    assert g(1) == 0.5 and g(10) == pytest.approx(0.55) and g(998) == pytest.approx(0.1, abs=1e-4)
    share[0] = 1.3
    assert g(10) == pytest.approx(0.1)
    # wsd: flat after warm-up, then linear to the floor over the last cooldown share (of steps or time)
    w = lr_lambda(warmup=4, total=104, min_ratio=0.1, schedule="wsd", cooldown=0.2)
    assert [w(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert w(4) == 1.0 and w(84) == 1.0 and w(94) == pytest.approx(0.55) and w(104) == pytest.approx(0.1)
    share[0] = 0.9
    wt = lr_lambda(warmup=4, total=1000, min_ratio=0.1, time_share=lambda: share[0], schedule="wsd", cooldown=0.2)
    assert wt(10) == pytest.approx(0.55)
    constant = lr_lambda(warmup=0, total=10, min_ratio=0.1, schedule="wsd", cooldown=0.0)
    assert [constant(s) for s in (0, 5, 10)] == [1.0, 1.0, 1.0]
    assert load_config(None, ["train.lr_schedule=wsd"]).train.cooldown_share == 0.2
    with pytest.raises(DraftsmithError, match="train.lr_schedule"):
        load_config(None, ["train.lr_schedule=linear"])


def test_prefetcher_hands_on_items_and_errors_and_its_thread_ends_on_close():
    def items(fail_at=None):
        for i in range(100):
            if i == fail_at:
                raise ValueError(f"bad item {i}")
            yield i

    p = Prefetcher(items(fail_at=3), depth=2)
    assert [next(p) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad item 3"):
        next(p)
    p.close()
    assert not p._thread.is_alive()
    # closed while the worker waits on a full queue: it stops instead of outliving the run
    p = Prefetcher(items(), depth=2)
    assert next(p) == 0
    time.sleep(0.3)
    p.close()
    assert not p._thread.is_alive()


def test_packing_places_every_sample_once_within_rows():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(300)] + [250, 0]
    plan = pack_epoch(lengths, row_len=128, rows_per_batch=3, seed=7, epoch=0)
    seen = [i for mb in plan for row in mb for i in row]
    assert sorted(seen) == [i for i in range(len(lengths)) if lengths[i] > 0]  # the empty one is skipped
    assert all(len(mb) <= 3 for mb in plan)
    assert all(sum(min(lengths[i], 128) for i in row) <= 128 for mb in plan for row in mb)
    used = sum(min(n, 128) for n in lengths)
    rows = sum(len(mb) for mb in plan)
    assert used / (rows * 128) > 0.95  # best-fit decreasing leaves little padding
    assert plan == pack_epoch(lengths, 128, 3, seed=7, epoch=0)  # every rank / resume agrees
    assert plan != pack_epoch(lengths, 128, 3, seed=7, epoch=1)  # a new order per epoch


def test_online_groups_sum_by_name_and_the_time_budget_rule():
    # online forwards group like extraction (one grouper): samples cut to the row, longest first,
    # (group size x its longest) <= extract.batch_tokens
    lengths = [10, 50, 30, 200, 30, 5]
    assert plan_batches(list(range(6)), [min(n, 64) for n in lengths], 100) == [[3], [1, 2], [4, 0, 5]]
    # one rank: named values come back by name, tensors as lists
    ranks = Ranks(rank=0, world=1, device=torch.device("cpu"))
    assert sum_by_name({"denom": torch.tensor([1.0, 2.0], dtype=torch.float64), "tokens": 3, "stop": 0.0}, ranks) == {
        "denom": [1.0, 2.0], "tokens": 3.0, "stop": 0.0}
    # the step before the budget runs out is the last, by the mean step time of this attempt
    budget = TimeBudget(budget_s=10.0)
    assert not budget.should_stop(5.0, 2) and budget.should_stop(6.0, 2) and budget.should_stop(11.0, 0)
    assert not TimeBudget(budget_s=None).should_stop(1e9, 1)


# -------------------------------------------------------------------------------------------------
# The stage end to end (in-process)


def test_training_learns_a_synthetic_signal_and_writes_the_documented_files(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    m = run_train(run, cfg_for(tiny8, max_steps=80, checkpoint_every=30, keep_checkpoints=2, tensorboard="true"))
    assert m["counts"]["done"] == 80 and m["counts"]["unit"] == "steps"
    rows = metrics(run)
    first, last = rows[0], rows[-1]
    assert last["step"] == 80
    assert last["loss"][0] < 0.3 * first["loss"][0]
    assert last["acc"][0] > 0.8 and last["acc"][2] > 0.5
    assert last["acceptance_length"] > 2.5
    assert {"lr", "grad_norm", "tokens_per_s", "elapsed_s", "step_time_s"} <= set(last)
    assert set(last["step_time_s"]) == {"data", "forward", "backward", "optimizer"}

    d = run.path / "train"
    steps = sorted(p.name for p in (d / "checkpoints").iterdir())
    assert steps == ["step_60", "step_80"]  # keep_checkpoints=2
    assert list(d.glob("tb/events.*"))
    for folder in (d / "checkpoints" / "step_80", d / "final"):
        assert sorted(p.name for p in folder.iterdir()) == ["drafter.json", "model.safetensors", "optimizer.pt",
                                                           "rng.safetensors", "state.json"]
        sd = load_file(str(folder / "model.safetensors"))
        assert "embed_tokens.weight" not in sd and sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
        assert sd["lm_head.weight"].shape == (DV, 64) and int(sd["t2d"].sum()) == DV
        meta = json.loads((folder / "drafter.json").read_text())
        assert meta["aux_layers"] == [2, 4, 5] and meta["ttt_steps"] == 3 and meta["draft_vocab_size"] == DV
        assert meta["target"]["fingerprint"] == target_info(str(tiny8)).fingerprint
        assert meta["config"]["hidden_size"] == 64 and meta["vocab_fingerprint"]
        state = json.loads((folder / "state.json").read_text())
        assert state["step"] == 80 and state["metrics"]["step"] == 80
        opt = torch.load(folder / "optimizer.pt", weights_only=True)
        assert {"optimizer", "scheduler"} <= set(opt)
    assert torch.equal(final_weights(run)["fc.weight"], load_file(str(d / "checkpoints/step_80/model.safetensors"))["fc.weight"])

    # export reads it; status counts it; a rerun with the same settings does nothing
    from draftsmith.export import drafter_config_from_meta, find_checkpoint
    assert find_checkpoint(run) == (d / "final").resolve()
    assert drafter_config_from_meta(json.loads((d / "final/drafter.json").read_text()), "x").draft_vocab_size == DV
    from draftsmith.status import run_status
    st = {s["name"]: s for s in run_status(run.path)["stages"]}["train"]
    assert st["state"] == "done" and st["on_disk"] == 80 and st["done"] == 80
    t0 = time.time()
    assert run_train(run, cfg_for(tiny8, max_steps=80, checkpoint_every=30, keep_checkpoints=2))["finished"] == m["finished"]
    assert time.time() - t0 < 5


@pytest.mark.parametrize("method,norms", [("peagle", {"fc_norm": True}),
                                          ("eagle3", {"norm_before_fc": True, "norm_output": True}),
                                          ("dflash", {})])
def test_each_drafter_kind_learns_and_exports_what_it_trained(synth_run, tiny8, tmp_path, method, norms):
    """train.method=peagle (all drafts in one pass), EAGLE-3.1's norms and train.method=dflash (a block in one
    pass): the run learns the synthetic signal at every draft position, and export writes the speculators form of
    its kind, which load_exported reads back to the checkpoint's weights (mask_hidden and the norms included)."""
    from draftsmith.export import load_exported, run_export

    run = copy_run(synth_run, tmp_path / "run")
    cfg = cfg_for(tiny8, max_steps=80, checkpoint_every=1000, method=method, **norms)
    run_train(run, cfg)
    first, last = metrics(run)[0], metrics(run)[-1]
    if method == "dflash":  # slot 1 reads the anchor only through attention: it learns slower in 80 steps
        assert last["acc"][0] > 0.2 and last["loss"][0] < 0.5 * first["loss"][0], (first, last)
    else:
        assert last["acc"][0] > 0.8 and last["acc"][2] > 0.5, last["acc"]
    meta = json.loads((run.path / "train/final/drafter.json").read_text())
    assert meta["method"] == method and all(meta["config"][k] is v for k, v in norms.items())
    sd = final_weights(run)
    assert ("mask_hidden" in sd) == (method == "peagle")
    assert ("fc_norm.0.weight" in sd) == norms.get("fc_norm", False)
    assert ("input_norm.weight" in sd) == norms.get("norm_before_fc", False)
    run_export(run, load_config(None, base_sets(tiny8) + ["export.dtype=float32"]))
    cj = json.loads((run.path / "export/config.json").read_text())
    assert cj["speculators_model_type"] == method and cj["speculators_config"]["algorithm"] == method
    if method == "peagle":
        assert cj["mask_token_id"] == meta["config"]["mask_token_id"]
        assert cj["transformer_layer_config"]["fc_norm"] is True  # where vLLM's peagle reads it
    elif method == "dflash":
        assert cj["architectures"] == ["DFlashDraftModel"] and cj["block_size"] == 4 and cj["mask_token_id"] >= 0
        assert cj["aux_hidden_state_layer_ids"] == [2, 4, 5] and cj["transformer_layer_config"]["model_type"] == "qwen3"
        assert cj["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        assert "layers.0.self_attn.q_norm.weight" in sd and "hidden_norm.weight" in sd
    else:
        assert cj["norm_before_fc"] is True and cj["norm_output"] is True and cj["fc_norm"] is False
    model, info = load_exported(run.path / "export")
    assert type(model).__name__ == {"peagle": "PEagleDrafter", "dflash": "DFlashDrafter"}.get(method, "Eagle3Drafter")
    got = model.state_dict()
    for name, t in sd.items():
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_chain_loss_trains_to_a_finite_loss_and_enters_trains_fingerprint(synth_run, tiny8, tmp_path, method):
    """train.loss_chain on: a short run of a chain kind and of a block kind ends with a finite loss; the setting is in
    train's fingerprinted settings when on, and left out at its default (runs made before it stay current)."""
    from draftsmith.train.stage import _settings

    run = copy_run(synth_run, tmp_path / "run")
    m = run_train(run, cfg_for(tiny8, max_steps=6, checkpoint_every=1000, method=method, loss_chain="true"))
    last = metrics(run)[-1]
    assert m["counts"]["done"] == 6 and last["step"] == 6 and torch.isfinite(torch.tensor(last["loss"])).all()
    assert m["settings"]["train"]["loss_chain"] is True
    assert "loss_chain" not in _settings(cfg_for(tiny8, method=method), [2, 4, 5], "fp32")["train"]


def test_max_minutes_ends_the_run_at_the_time_budget_and_counts_time_across_resumes(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    budget_s = 5.0
    sets = dict(max_steps=100000, max_minutes=budget_s / 60, checkpoint_every=5, keep_checkpoints=100000)
    m = run_train(run, cfg_for(tiny8, **sets))
    done = m["counts"]["done"]
    assert 5 < done < 100000 and m["counts"]["total"] == done  # stopped by the clock, reported as complete
    d = run.path / "train"
    final = json.loads((d / "final" / "state.json").read_text())
    assert final["step"] == done and final["total_steps"] == done
    assert 0 < final["warmup_end_s"] < final["train_s"]  # the time share counts from the end of warm-up
    assert 0.5 * budget_s < final["train_s"] < budget_s + 30 and m["counts"]["train_minutes"] * 60 >= 0.5 * budget_s
    last = metrics(run)[-1]
    assert last["step"] == done and last["total_steps"] == done
    assert last["lr"] < 0.25 * 3e-3  # the cosine reached (near) its floor of 0.1 x lr with the time, not the step cap
    ck = sorted(((int(p.name[5:]), json.loads((p / "state.json").read_text())["train_s"])
                 for p in (d / "checkpoints").iterdir()))
    assert [t for _, t in ck] == sorted(t for _, t in ck)

    # cut after the last step's checkpoint: the rerun ends there, whatever time that checkpoint recorded
    shutil.rmtree(d / "final")
    (d / "manifest.json").unlink()
    assert run_train(run, cfg_for(tiny8, **sets))["counts"]["done"] == done

    # resume from an early checkpoint whose recorded time is the whole budget: one more step, then done
    k = ck[0][0]
    shutil.rmtree(d / "final")
    for n, _ in ck[1:]:
        shutil.rmtree(d / "checkpoints" / f"step_{n}")
    state_path = d / "checkpoints" / f"step_{k}" / "state.json"
    state = json.loads(state_path.read_text())
    state_path.write_text(json.dumps({**state, "train_s": budget_s}))
    m2 = run_train(run, cfg_for(tiny8, **sets))
    assert m2["counts"]["done"] == k + 1 == m2["counts"]["total"]
    assert json.loads((d / "final" / "state.json").read_text())["train_s"] >= budget_s


def test_fc_input_norm_is_folded_into_fc_at_export_and_resumes_exactly(synth_run, tiny8, tmp_path):
    from draftsmith.export import load_exported, run_export

    run = copy_run(synth_run, tmp_path / "run")
    sets = dict(max_steps=20, checkpoint_every=10, fc_input_norm="true")
    cfg = cfg_for(tiny8, **sets, **{"export.dtype": "float32"})
    run_train(run, cfg)
    d = run.path / "train"
    sd = final_weights(run)
    scale = sd["fc_input_scale"]
    # 1 / RMS per dimension, measured without each document's first token
    store = ExtractStore(run)
    x = torch.cat([store[i]["aux_hidden"].float()[1:].reshape(-1, scale.numel()) for i in range(len(store))])
    rms = x.pow(2).mean(0).sqrt()
    assert scale.shape == (3 * 64,) and ((scale * rms - 1).abs() < 0.3).all()

    # export folds it: the exported drafter on raw states computes what training computed on scaled ones
    run_export(run, cfg)
    info = target_info(str(tiny8))
    exported, _ = load_exported(run.path / "export", target_info=info, embed_weight=read_target_weights(info)[0].float(),
                                dtype=torch.float32)
    trained = Eagle3Drafter(exported.config)
    trained.load_state_dict({**exported.state_dict(), **{k: v for k, v in sd.items() if k != "fc_input_scale"}})
    rec = store[0]
    ids, aux = rec["input_ids"].long()[None], rec["aux_hidden"].float().reshape(1, len(rec["input_ids"]), -1)
    with torch.no_grad():
        for a, b in zip(exported.ttt_forward(ids, aux, 3), trained.ttt_forward(ids, aux * scale, 3)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.equal(exported.fc.weight, trained.fc.weight)

    # a checkpoint whose factor has the wrong shape is refused, naming the file and the tensor
    bad = tmp_path / "bad_ckpt"
    shutil.copytree(d / "final", bad)
    from safetensors.torch import save_file
    save_file({**sd, "fc_input_scale": scale[:-1].contiguous()}, str(bad / "model.safetensors"))
    with pytest.raises(DraftsmithError, match=r"bad_ckpt/model.safetensors: tensor 'fc_input_scale' has shape \[191\], expected \[192\]"):
        run_export(run, cfg, checkpoint=str(bad))

    # a resumed run recomputes the same factor and ends with the same weights
    shutil.rmtree(d / "final")
    shutil.rmtree(d / "checkpoints" / "step_20")
    (d / "manifest.json").unlink()
    run_train(run, cfg)
    again = final_weights(run)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


def test_ema_final_holds_the_average_and_a_resume_restores_it(synth_run, tiny8, tmp_path):
    """train.ema: final/ holds the moving average (not the last step's weights, which the last
    checkpoint keeps), the average follows ema_decay's ramp, and a run resumed from a checkpoint
    ends with the same average as one never interrupted (it rides in the optimizer state)."""
    run = copy_run(synth_run, tmp_path / "run")
    cfg = cfg_for(tiny8, max_steps=20, checkpoint_every=10, ema=0.9)
    run_train(run, cfg)
    d = run.path / "train"
    avg, raw = final_weights(run), load_file(str(d / "checkpoints" / "step_20" / "model.safetensors"))
    assert avg.keys() == raw.keys() and any(not torch.equal(avg[k], raw[k]) for k in avg)
    saved = torch.load(d / "checkpoints" / "step_20" / "optimizer.pt", weights_only=True)["optimizer"]["state"]
    assert all("ema" in st for st in saved.values())
    assert ema_decay(0.9, 1) == pytest.approx(2 / 11) and ema_decay(0.9, 1000) == 0.9
    # without the average the run ends at the raw weights
    plain = copy_run(synth_run, tmp_path / "plain")
    run_train(plain, cfg_for(tiny8, max_steps=20, checkpoint_every=10))
    w = final_weights(plain)
    assert all(torch.equal(w[k], raw[k]) for k in w)

    assert _bit_equal(_resumed_from_step_10(run, cfg), avg)


def _resumed_from_step_10(run, cfg) -> "dict[str, torch.Tensor]":
    """The final weights of `run` trained again from its step_10 checkpoint (the later ones and the end removed),
    each the tensor of the same name an uninterrupted run ends with, or not."""
    d = run.path / "train"
    shutil.rmtree(d / "final")
    shutil.rmtree(d / "checkpoints" / "step_20")
    (d / "manifest.json").unlink()
    run_train(run, cfg)  # from step_10
    return final_weights(run)


def _bit_equal(a: "dict[str, torch.Tensor]", b: "dict[str, torch.Tensor]") -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_muon_updates_the_matrices_adamw_the_rest_and_a_resume_ends_at_the_same_weights(synth_run, tiny8, tmp_path):
    """train.optimizer=muon: torch's Muon holds a momentum buffer for each drafter matrix (fc, attention, MLP),
    AdamW its moments for the norms and the LM head; the run trains somewhere else than AdamW's, and one resumed
    from a checkpoint ends with the same weights as one never interrupted."""
    run = copy_run(synth_run, tmp_path / "run")
    cfg = cfg_for(tiny8, max_steps=20, checkpoint_every=10, optimizer="muon")
    run_train(run, cfg)
    d = run.path / "train"
    saved = torch.load(d / "checkpoints" / "step_20" / "optimizer.pt", weights_only=True)["optimizer"]
    by_algo = {g["algo"]: set(g["params"]) for g in saved["param_groups"]}
    muon_names, adam_names = by_algo["muon"], by_algo["adamw"]
    assert "drafter.fc.weight" in muon_names and "drafter.layers.0.mlp.down_proj.weight" in muon_names
    assert "drafter.lm_head.weight" in adam_names and "drafter.norm.weight" in adam_names
    assert all(set(saved["state"][n]) == {"momentum_buffer"} for n in muon_names)
    assert all({"exp_avg", "exp_avg_sq"} <= set(saved["state"][n]) for n in adam_names)
    muon = final_weights(run)
    plain = copy_run(synth_run, tmp_path / "plain")
    run_train(plain, cfg_for(tiny8, max_steps=20, checkpoint_every=10))
    assert not torch.equal(final_weights(plain)["fc.weight"], muon["fc.weight"])

    assert _bit_equal(_resumed_from_step_10(run, cfg), muon)


def test_init_layer_starts_from_the_target_layer_and_a_bad_value_keeps_the_run(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    m = run_train(run, cfg_for(tiny8, max_steps=2, checkpoint_every=2, lr=1e-12, init_layer=7))
    assert json.loads((run.path / "train/final/drafter.json").read_text())["init_layer"] == 7
    w = final_weights(run)  # lr ~0: the weights are still the initialisation
    target = load_file(str(tiny8 / "model.safetensors"))
    H = 64
    torch.testing.assert_close(w["layers.0.mlp.down_proj.weight"], target["model.layers.7.mlp.down_proj.weight"].float())
    torch.testing.assert_close(w["layers.0.self_attn.q_proj.weight"][:, H:], target["model.layers.7.self_attn.q_proj.weight"].float())
    torch.testing.assert_close(w["layers.0.hidden_norm.weight"], target["model.layers.7.input_layernorm.weight"].float())
    torch.testing.assert_close(w["fc.weight"][:, 2 * H:], torch.eye(H))
    assert float(w["fc.weight"][:, :2 * H].abs().max()) < 1e-9  # zero, but for two Adam steps of ~1e-12

    # a layer the target does not have: one line, and the finished run is left as it was
    r = run_cli(*cli_args(run, tiny8, max_steps=2, checkpoint_every=2, lr=1e-12, init_layer=8), env=THREADS)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "train.init_layer: 8 is not a layer of the target (0..7)" in r.stderr
    assert run.read_manifest("train") == m and (run.path / "train/final/model.safetensors").is_file()
    assert not (run.path / "train/previous").exists()


def test_two_layers_start_from_the_target_layers_before_init_layer(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    run_train(run, cfg_for(tiny8, max_steps=2, checkpoint_every=2, lr=1e-12, init_layer=7, num_layers=2))
    meta = json.loads((run.path / "train/final/drafter.json").read_text())
    assert meta["config"]["num_hidden_layers"] == 2
    w = final_weights(run)
    target = {k: v.float() for k, v in load_file(str(tiny8 / "model.safetensors")).items()}
    H = 64
    # drafter layer 0 <- target layer 6 (its hidden half), layer 1 <- target layer 7, whole
    torch.testing.assert_close(w["layers.0.self_attn.q_proj.weight"][:, H:], target["model.layers.6.self_attn.q_proj.weight"])
    torch.testing.assert_close(w["layers.0.mlp.up_proj.weight"], target["model.layers.6.mlp.up_proj.weight"])
    for name in ("self_attn.k_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
        torch.testing.assert_close(w[f"layers.1.{name}"], target[f"model.layers.7.{name}"])
    assert "layers.1.hidden_norm.weight" not in w

    r = run_cli(*cli_args(run, tiny8, max_steps=2, checkpoint_every=2, init_layer=0, num_layers=2), env=THREADS)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0
    assert "train.init_layer: 0 with train.num_layers 2 needs target layers -1..0" in r.stderr


def test_freeze_lm_head_keeps_the_target_rows_and_trains_the_rest(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    m0 = run_train(run, cfg_for(tiny8, max_steps=3, checkpoint_every=3, lr=1e-2))
    free = final_weights(run)
    m1 = run_train(run, cfg_for(tiny8, max_steps=3, checkpoint_every=3, lr=1e-2, freeze_lm_head=True))
    assert m1["fingerprint"] != m0["fingerprint"]  # another setting: trained afresh
    w = final_weights(run)
    from draftsmith.vocab import load_vocab

    d2t, _, _ = load_vocab(run)
    target = load_file(str(tiny8 / "model.safetensors"))
    head = target.get("lm_head.weight", target["model.embed_tokens.weight"]).float()  # tied in the tiny target
    torch.testing.assert_close(w["lm_head.weight"], head[d2t + torch.arange(d2t.numel())], rtol=0, atol=0)
    assert not torch.equal(free["lm_head.weight"], w["lm_head.weight"])  # unfrozen, the same steps move it
    assert not torch.equal(free["fc.weight"], w["fc.weight"])  # the rest trains either way
    assert json.loads((run.path / "train/final/drafter.json").read_text())["freeze_lm_head"] is True
    # at its default the knob is left out of the fingerprinted settings: runs made before it existed stay current
    assert "freeze_lm_head" not in m0["settings"]["train"] and m1["settings"]["train"]["freeze_lm_head"] is True


def test_read_target_layer_takes_the_text_models_layers_only(tmp_path):
    from safetensors.torch import save_file

    from draftsmith.target.layout import Layout
    from draftsmith.train.drafter import read_target_layer

    save_file({"model.language_model.embed_tokens.weight": torch.zeros(4, 2),
               "model.language_model.layers.2.mlp.up_proj.weight": torch.ones(3, 2),
               "model.language_model.layers.27.mlp.up_proj.weight": torch.zeros(3, 2),
               "model.vision_tower.encoder.layers.2.mlp.up_proj.weight": torch.zeros(3, 2),
               "mtp.layers.2.mlp.up_proj.weight": torch.zeros(3, 2)}, str(tmp_path / "model.safetensors"))
    info = types.SimpleNamespace(path=str(tmp_path), num_layers=28, architecture="Gemma3ForConditionalGeneration",
                                 tie_word_embeddings=True, layout=Layout(),  # Llama's layout, as Gemma 3's
                                 identity=types.SimpleNamespace(text={}))
    got = read_target_layer(info, 2)
    assert list(got) == ["mlp.up_proj.weight"] and bool(got["mlp.up_proj.weight"].eq(1).all())
    with pytest.raises(DraftsmithError, match=r"no tensors named model\.language_model\.layers\.5\."):
        read_target_layer(info, 5)
    (tmp_path / "bare").mkdir()
    with pytest.raises(DraftsmithError, match="has no safetensors weights to read layer 2 from"):
        read_target_layer(types.SimpleNamespace(path=str(tmp_path / "bare"), num_layers=28, architecture="X",
                                                tie_word_embeddings=True, layout=Layout(),
                                                identity=types.SimpleNamespace(text={})), 2)


@pytest.mark.parametrize("outside_loss", [False, True], ids=["in-the-loss", "outside-the-loss"])
def test_a_non_finite_stored_state_names_its_file_and_the_verify_command(synth_run, tiny8, tmp_path, outside_loss):
    """NaN in a stored state, where the loss reads it or where nothing does: the step stops before
    any update, naming the store file, `extract --verify` (which finds and redoes it) and the last
    good checkpoint; it never trains on to exit 0."""
    run = copy_run(synth_run, tmp_path / "run")
    store = ExtractStore(run)
    # the sample that the 4th micro-batch (= optimizer step 4) of epoch 0 packs first
    plan = pack_epoch(store.lengths, 64, 2, seed=0, epoch=0)
    bad = plan[3][0][0]
    synthesize_states(run, tiny8, nan_sample=bad, nan_outside_loss=outside_loss)
    with pytest.raises(DraftsmithError) as e:
        run_train(run, cfg_for(tiny8, max_steps=20, checkpoint_every=1, keep_checkpoints=2))
    msg = str(e.value)
    assert msg.startswith(f"{store.path(bad)}: the stored hidden states of sample 's{bad}' hold non-finite values")
    assert f"`draftsmith extract --run {run.path} --verify`" in msg and "step 4" in msg
    assert "train/checkpoints/step_3" in msg
    d = run.path / "train"
    assert sorted(p.name for p in (d / "checkpoints").iterdir()) == ["step_2", "step_3"]
    w = load_file(str(d / "checkpoints/step_3/model.safetensors"))
    assert all(torch.isfinite(t).all() for t in w.values() if t.is_floating_point())
    assert not (d / "final").exists() and not (d / "manifest.json").exists()
    journal = (d / "progress.jsonl").read_text().splitlines()
    assert json.loads(journal[-1])["ev"] == "error"


def test_online_mode_trains_on_the_same_numbers_as_offline(tiny8, tmp_path):
    samples = cycle_samples(target_info(str(tiny8)).vocab_size, 16, seed=3)
    off = make_run(tmp_path / "off", tiny8, samples, extract=True)
    on = make_run(tmp_path / "on", tiny8, samples, extract=False)
    sets = dict(max_steps=6, precision="fp32")
    m_off = run_train(off, cfg_for(tiny8, mode="offline", **sets))
    m = run_train(on, cfg_for(tiny8, mode="online", **sets))
    assert m["inputs"]["prepare"] and "extract" not in m["inputs"]
    # the tokens the model card calls trained: the online source's masks count what the store's prepared file does
    assert m["counts"]["trained_tokens"] == m_off["counts"]["trained_tokens"] > 0
    assert sorted(p.name for p in (on.path).iterdir()) == [".locks", "prepare", "run.json", "train", "vocab"]  # nothing else written (.locks: the stage locks)
    a, b = final_weights(off), final_weights(on)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_refuses_mismatched_or_missing_upstream(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    with pytest.raises(DraftsmithError, match=r"extract\.layers: \[1, 3, 5\] differs from the layers \[2, 4, 5\]"):
        run_train(run, cfg_for(tiny8, max_steps=2, **{"extract.layers": "[1,3,5]"}))
    with pytest.raises(DraftsmithError, match="vocab.draft_vocab_size"):
        run_train(run, cfg_for(tiny8, max_steps=2, **{"vocab.draft_vocab_size": 32}))
    other = build_tiny_target(tmp_path / "other", num_layers=8, vocab_size=300)
    with pytest.raises(DraftsmithError, match="another target"):
        run_train(run, cfg_for(other, max_steps=2))
    bare = RunDir(tmp_path / "bare")
    write_prepare(bare, tiny8, cycle_samples(target_info(str(tiny8)).vocab_size, 4))
    with pytest.raises(DraftsmithError, match="draftsmith extract"):
        run_train(bare, cfg_for(tiny8, max_steps=2))
    with pytest.raises(DraftsmithError, match="draftsmith vocab"):
        run_train(bare, cfg_for(tiny8, max_steps=2, mode="online"))
    # nothing written but the journals of the failures (status shows them failed)
    assert {p.name for p in (run.path / "train").iterdir()} <= {"progress.jsonl", "progress.prev.jsonl", "stage.log"}


def test_changed_settings_restart_and_cosmetic_ones_resume(synth_run, tiny8, tmp_path):
    run = copy_run(synth_run, tmp_path / "run")
    run_train(run, cfg_for(tiny8, max_steps=4, checkpoint_every=2, precision="bf16"))  # bf16 autocast runs too
    first = final_weights(run)
    assert json.loads((run.path / "train/final/drafter.json").read_text())["precision"] == "bf16"
    # only cosmetic settings changed: same fingerprint, nothing to do
    assert {"log_every_s", "checkpoint_every"} <= set(NOT_FINGERPRINTED)
    m = run_train(run, cfg_for(tiny8, max_steps=4, checkpoint_every=3, log_every_s=5, precision="bf16",
                               attention="sdpa", loss_chunk_tokens=0))
    assert m["counts"]["done"] == 4
    # another learning rate: the old checkpoints move to train/previous and training starts over
    run_train(run, cfg_for(tiny8, max_steps=4, checkpoint_every=2, lr=1e-3, precision="bf16"))
    d = run.path / "train"
    assert (d / "previous" / "final").is_dir() and (d / "previous" / "checkpoints" / "step_4").is_dir()
    assert not torch.equal(first["fc.weight"], final_weights(run)["fc.weight"])


# -------------------------------------------------------------------------------------------------
# Subprocesses: SIGKILL + resume, torchrun DDP


def cli_args(run: RunDir, target, **train) -> list[str]:
    out = ["train", "--run", str(run.path)]
    for s in base_sets(target, **train):
        out += ["--set", s]
    return out


THREADS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def test_resume_after_sigkill_ends_with_the_same_weights(synth_run, tiny8, tmp_path):
    sets = dict(max_steps=100, checkpoint_every=10, keep_checkpoints=2, log_every_s=0.2)
    ref = copy_run(synth_run, tmp_path / "ref")
    run_train(ref, cfg_for(tiny8, **sets))  # uninterrupted, in-process (one thread, like the CLI runs below)

    run = copy_run(synth_run, tmp_path / "killed")
    env = {**os.environ, **THREADS}
    p = subprocess.Popen([sys.executable, "-m", "draftsmith", *cli_args(run, tiny8, **sets)], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ck = run.path / "train" / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ck / "step_20" / "state.json").exists():
        time.sleep(0.005)
    time.sleep(0.03)  # land between checkpoints, mid-step
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL
    assert not (run.path / "train" / "final").exists(), "the run finished before it could be killed"
    killed_at = max(int(x.name[5:]) for x in ck.iterdir() if x.name.startswith("step_"))
    assert 20 <= killed_at < 100

    r = run_cli(*cli_args(run, tiny8, **sets), env=THREADS, check=True)
    assert f"resumed from {ck / f'step_{killed_at}'}" in r.stdout
    a, b = final_weights(ref), final_weights(run)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # metrics past the resumed checkpoint were dropped, so steps are increasing and unique
    steps = [x["step"] for x in metrics(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 100


@pytest.mark.parametrize("damaged", ["optimizer.pt", "state.json", "model.safetensors"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(synth_run, tiny8, tmp_path, damaged, capsys):
    """A cut or overwritten file in the newest checkpoint: one line naming it, training resumes from
    the checkpoint before and ends with the weights of a run never interrupted."""
    sets = dict(max_steps=12, checkpoint_every=4, keep_checkpoints=3)
    ref = copy_run(synth_run, tmp_path / "ref")
    run_train(ref, cfg_for(tiny8, **sets))
    run = copy_run(synth_run, tmp_path / "run")
    run_train(run, cfg_for(tiny8, **sets))
    d = run.path / "train"
    shutil.rmtree(d / "final")
    shutil.rmtree(d / "checkpoints" / "step_12")
    (d / "manifest.json").unlink()  # as if killed right after step 8's checkpoint
    bad = d / "checkpoints" / "step_8" / damaged
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])
    capsys.readouterr()
    run_train(run, cfg_for(tiny8, **sets))
    out = capsys.readouterr().out
    assert f"{bad}: " in out and "resuming from the checkpoint before it" in out
    assert f"resumed from {d / 'checkpoints' / 'step_4'}" in out
    a, b = final_weights(ref), final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)
    if damaged == "optimizer.pt":  # every checkpoint damaged: an error, never a silent start from step 0
        shutil.rmtree(d / "final")
        (d / "manifest.json").unlink()
        for ck in (d / "checkpoints").iterdir():
            (ck / damaged).write_bytes(b"not a checkpoint")
        with pytest.raises(DraftsmithError, match=r"none of its \d checkpoint\(s\) can be read"):
            run_train(run, cfg_for(tiny8, **sets))


def torchrun(run: RunDir, target, nproc: int, **train) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port", str(29500 + random.randint(1, 2000)),
           "-m", "draftsmith", "--", *cli_args(run, target, **train)]
    p = subprocess.run(cmd, cwd=REPO, env={**os.environ, **THREADS}, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_two_ranks_match_one_rank_at_double_batch_with_ddp_and_fsdp(tiny8, tmp_path):
    # every sample exactly one row long, so batch 2b packs the same rows as two batches of b
    samples = cycle_samples(target_info(str(tiny8)).vocab_size, 24, seed=5, lengths=(64, 64))
    base = make_run(tmp_path / "base", tiny8, samples)
    synthesize_states(base, tiny8)
    # with the weights' average on: it is kept per parameter in the optimizer state, sharded by FSDP; and a
    # validation split, which every world size draws alike and measures to the same figures
    sets = dict(max_steps=4, precision="fp32", lr=1e-3, checkpoint_every=2, ema=0.5, validation=5)

    one = copy_run(base, tmp_path / "one")  # 1 rank, batch 2b
    run_train(one, cfg_for(tiny8, batch_tokens=128, **sets))
    accum = copy_run(base, tmp_path / "accum")  # 1 rank, batch b, 2 micro-batches per step
    run_train(accum, cfg_for(tiny8, batch_tokens=64, grad_accum=2, **sets))
    ddp = copy_run(base, tmp_path / "ddp")  # 2 ranks, batch b
    p = torchrun(ddp, tiny8, 2, batch_tokens=64, **sets)
    assert p.stdout.count("step 4/4 |") == 1  # rank 0 logs, rank 1 does not
    assert "Warning" not in p.stdout + p.stderr, p.stderr[-2000:]  # e.g. DDP's deprecated broadcast_buffers
    assert sorted(x.name for x in (ddp.path / "train").glob("progress*.jsonl")) == ["progress.rank0.jsonl", "progress.rank1.jsonl"]
    fsdp = copy_run(base, tmp_path / "fsdp")
    torchrun(fsdp, tiny8, 2, batch_tokens=64, fsdp="true", **sets)
    # train.processes=2 outside torchrun launches the two ranks itself and returns their manifest
    launched = copy_run(base, tmp_path / "launched")
    m = run_train(launched, cfg_for(tiny8, batch_tokens=64, processes=2, **sets))
    assert m["counts"]["done"] == 4 and m == launched.read_manifest("train")
    assert not list(launched.path.glob(".train-ranks-*")), "the ranks' config file is left behind"
    # a rank's one-line error is the launcher's error; nothing of the launch is left behind
    bad = copy_run(base, tmp_path / "bad")
    with pytest.raises(DraftsmithError, match=r"^train\.init_layer: 99 is not a layer"):
        run_train(bad, cfg_for(tiny8, batch_tokens=64, processes=2, init_layer=99, **sets))
    assert not list(bad.path.glob(".train-ranks-*"))

    ref = final_weights(one)
    for other in (accum, ddp, fsdp, launched):
        w = final_weights(other)
        assert w.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(w[k], ref[k], rtol=1e-4, atol=1e-6)
    train_rows = [[r for r in metrics(x) if r.get("split") is None] for x in (one, ddp)]
    assert train_rows[1][-1]["tokens"] == train_rows[0][-1]["tokens"] == 4 * 2 * 64
    val = [[r for r in metrics(x) if r.get("split") == "validation"][-1] for x in (one, accum, ddp, fsdp, launched)]
    for v in val:
        assert (v["step"], v["samples"], v["positions"]) == (4, 5, val[0]["positions"]) and v["positions"] > 0
        assert v["acceptance_per_position"] == pytest.approx(val[0]["acceptance_per_position"], abs=1e-9)
        assert v["loss"] == pytest.approx(val[0]["loss"], rel=1e-4)
    # the sharded run checkpoints full tensors too
    assert load_file(str(fsdp.path / "train/checkpoints/step_2/model.safetensors")).keys() == ref.keys()


def test_two_ranks_stop_together_at_the_time_budget(synth_run, tiny8, tmp_path):
    # rank 0's clock decides for both; a rank that stopped alone would leave the other in an all-reduce
    run = copy_run(synth_run, tmp_path / "run")
    p = torchrun(run, tiny8, 2, max_steps=100000, max_minutes=0.05, checkpoint_every=100000)
    m = json.loads((run.path / "train" / "manifest.json").read_text())
    done = m["counts"]["done"]
    assert 0 < done < 100000 and m["counts"]["total"] == done and m["world_size"] == 2
    assert f"step {done}/{done} " in p.stdout + p.stderr



# -------------------------------------------------------------------------------------------------
# The real target


@pytest.mark.integration
def test_online_training_on_smollm2_lowers_the_loss(smol_target, tmp_path):
    from draftsmith.target import load_tokenizer

    info = target_info(smol_target)
    tok = load_tokenizer(info)
    texts = ["The quick brown fox jumps over the lazy dog. " * 3,
             "Speculative decoding drafts tokens with a small model and verifies them with the target model.",
             "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n",
             "Hello! How can I help you today? I am a helpful assistant and I like to answer questions.",
             "Write a short poem about the sea and the sky, the waves and the wind, the sun and the moon.",
             "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20, numbers counted one by one."]
    samples = []
    for i, t in enumerate(texts):
        ids = tok(t)["input_ids"]
        samples.append({"id": f"t{i}", "input_ids": ids, "loss_mask": [0] * 4 + [1] * (len(ids) - 4), "truncated": False})
    run = RunDir(tmp_path / "run")
    write_prepare(run, smol_target, samples)
    sets = dict(mode="online", max_steps=12, lr=2e-3, warmup_steps=1, seq_len=256, batch_tokens=256,
                **{"vocab.draft_vocab_size": 512})
    run_vocab(run, cfg_for(smol_target, **sets))
    t0 = time.time()
    m = run_train(run, cfg_for(smol_target, **sets))
    assert m["counts"]["done"] == 12
    rows = metrics(run)
    assert rows[-1]["loss"][0] < 0.7 * rows[0]["loss"][0]
    assert time.time() - t0 < 60


def test_fsdp_mixed_precision_and_frozen_tensors_outside_the_shards(tmp_path):
    """train.fsdp under bf16: parameters gathered in bf16 and gradients reduced in float32; the frozen
    embedding is kept whole (no shard, no all-gather each forward) and in bf16, the target head a bf16
    buffer. On gloo, as FSDP runs here."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from draftsmith.train.distributed import distribute
    from draftsmith.train.objective import TTTObjective

    drafter, head = tiny_drafter()
    objective = TTTObjective(drafter, head, steps=2, gamma=0.8)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        distribute(objective, Ranks(rank=0, world=2, device=torch.device("cpu")), fsdp=True, precision="bf16")
        layer = objective.drafter.layers[0]
        policy = layer._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)
        embed = objective.drafter.embed_tokens.weight
        assert not embed.requires_grad and not isinstance(embed, DTensor) and embed.dtype == torch.bfloat16
        trainable = [p for p in objective.parameters() if p.requires_grad]
        assert trainable and all(isinstance(p, DTensor) and p.dtype == torch.float32 for p in trainable)
        # the teacher's head: a bf16 buffer, never sharded; the root's policy is the layers'
        head = objective.target_head
        assert head.dtype == torch.bfloat16 and not isinstance(head, DTensor) and "target_head" in dict(objective.named_buffers())
        root = objective._get_fsdp_state()._mp_policy
        assert (root.param_dtype, root.reduce_dtype) == (torch.bfloat16, torch.float32)
    finally:
        dist.destroy_process_group()


def _stop_mid_run(cmd: list[str], run: RunDir, sig: int, after_step: int) -> tuple[subprocess.Popen, str]:
    """Start `cmd`, send `sig` once the journal counts `after_step` steps; (the process, its stderr)."""
    p = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **THREADS}, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=stop_signals_default)
    deadline = time.time() + 300
    while time.time() < deadline and p.poll() is None:
        journals = [j for j in (run.path / "train").glob("progress*.jsonl") if ".prev." not in j.name]  # rank 0's too
        done = [json.loads(x).get("done") or 0 for j in journals for x in j.read_text().splitlines() if x.endswith("}")]
        if max(done, default=0) >= after_step:
            break
        time.sleep(0.01)
    assert p.poll() is None, p.communicate()
    p.send_signal(sig)
    _, err = p.communicate(timeout=300)
    return p, err


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_mid_run_checkpoints_that_step_and_the_rerun_continues_from_it(synth_run, tiny8, tmp_path,
                                                                                     sig, code):
    """A preemption's SIGTERM (or Ctrl-C) between checkpoints loses no step: the step in progress
    ends, is checkpointed, the command exits 143 (130) with one line, and the rerun resumes from that
    step and ends with the weights of a run never interrupted."""
    sets = dict(max_steps=300, checkpoint_every=500, keep_checkpoints=2, log_every_s=0.2)
    ref = copy_run(synth_run, tmp_path / "ref")
    run_train(ref, cfg_for(tiny8, **sets))
    run = copy_run(synth_run, tmp_path / "stopped")
    p, err = _stop_mid_run([sys.executable, "-m", "draftsmith", *cli_args(run, tiny8, **sets)], run, sig, 7)
    assert p.returncode == code and len(err.strip().splitlines()) == 1, err
    ck = run.path / "train" / "checkpoints"
    steps = sorted(int(x.name[5:]) for x in ck.iterdir() if x.name.startswith("step_") and (x / "state.json").exists())
    assert steps and 7 <= steps[-1] < 300 and steps[-1] % 500, steps  # the step it stopped at, not a multiple of 500
    log = (run.path / "train" / "stage.log").read_text()
    assert f"checkpoint of step {steps[-1]} written" in log
    r = run_cli(*cli_args(run, tiny8, **sets), env=THREADS, check=True)
    assert f"resumed from {ck / f'step_{steps[-1]}'}" in r.stdout
    a, b = final_weights(ref), final_weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL-of-the-launcher"])
def test_a_stop_of_two_ranks_checkpoints_the_same_step_on_both(synth_run, tiny8, tmp_path, sig):
    """train.processes=2: the SIGTERM reaches the launcher, torchrun passes it on; both ranks agree on the step in
    the step's all-reduce, save it together and exit; the rerun resumes from it. The launcher SIGKILLed: torchrun
    dies with it (its SIGTERM goes on to the ranks), and the ranks, whose output pipe is gone, still write the
    checkpoint they announce; `status` says interrupted, and the ranks' config file the kill left behind is gone
    after the rerun."""
    sets = dict(max_steps=300, checkpoint_every=500, log_every_s=0.2, processes=2)
    run = copy_run(synth_run, tmp_path / "run")
    p, err = _stop_mid_run([sys.executable, "-m", "draftsmith", *cli_args(run, tiny8, **sets)], run, sig, 5)
    assert p.returncode == (143 if sig == signal.SIGTERM else -signal.SIGKILL) and "Traceback" not in err, err
    ck = run.path / "train" / "checkpoints"
    if sig == signal.SIGKILL:  # the ranks go on a little after their launcher: until `status` has them stopped
        deadline = time.time() + 120
        while time.time() < deadline and run_cli("status", str(run.path), "--json").stdout.count('"running"'):
            time.sleep(0.5)
        row = {s["name"]: s for s in json.loads(run_cli("status", str(run.path), "--json").stdout)["stages"]}
        assert row["train"]["state"] == "interrupted", row["train"]
    log = run.path / "train" / "stage.log"
    assert ck.is_dir(), (err, log.read_text()[-3000:] if log.exists() else "no stage.log")
    said = log.read_text()  # each rank says it got the signal, once; rank 1's line tagged as its own
    assert said.count("] SIGTERM: stopping after this step") == 1, said[-3000:]
    assert said.count("] rank 1: SIGTERM: stopping after this step") == 1, said[-3000:]
    steps = sorted(int(x.name[5:]) for x in ck.iterdir() if x.name.startswith("step_") and (x / "state.json").exists())
    assert steps and 5 <= steps[-1] < 300 and steps[-1] % 500, steps
    r = run_cli(*cli_args(run, tiny8, **sets), env=THREADS, check=True)
    assert f"resumed from {ck / f'step_{steps[-1]}'}" in r.stdout
    assert not list(run.path.glob(".train-ranks-*")), "a launcher's config file is left behind"


class _StoppedTorchrun:
    """torchrun as launch_ranks sees it: a stop signal lands while the launcher reads its first line; the ranks'
    lines after it (their checkpoint's) come once it has passed the signal on."""

    def __init__(self, cmd, env, **kwargs):
        self.args, self.env, self.terminated, self.stdout = cmd, env, False, self
        self.left = ["checkpoint of step 7 written: the same command resumes from it\n"]
        _StoppedTorchrun.last = self

    def __iter__(self):
        return self

    def __next__(self) -> str:
        if not self.terminated:
            raise Terminated()  # the signal, as the launcher waits for a line
        if self.left:
            return self.left.pop(0)
        raise StopIteration

    def terminate(self):
        self.terminated = True

    def kill(self):
        self.killed = True

    def wait(self, timeout=None):
        return 143


def test_a_stopped_launcher_gives_its_ranks_the_time_to_checkpoint(synth_run, tiny8, tmp_path, monkeypatch, capsys):
    """A stop signal at the launcher: torchrun gets it and passes it on, and the ranks end their step and write its
    checkpoint. torchrun's own grace before its SIGKILL is 30 s, short of a step and an ~11 GB checkpoint at
    Kimi-K2.5's widths: the ranks get the collectives' timeout instead, and the launcher keeps forwarding their
    lines while it waits (a full pipe would block them)."""
    run = copy_run(synth_run, tmp_path / "run")
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setattr(launch.subprocess, "Popen", _StoppedTorchrun)
    with pytest.raises(Terminated):
        launch.launch_ranks(run, cfg_for(tiny8, processes=2), "train")
    proc = _StoppedTorchrun.last
    assert proc.terminated and int(proc.env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= 30 * 60
    assert "checkpoint of step 7 written" in capsys.readouterr().out


def test_ranks_past_the_grace_are_killed(synth_run, tiny8, tmp_path, monkeypatch):
    """Ranks still talking when the grace is over: the launcher kills torchrun (which takes its ranks with it) and
    still stops as the signal asked, not with a second error."""
    run = copy_run(synth_run, tmp_path / "run")
    monkeypatch.setattr(launch, "STOP_GRACE_S", -60)  # the grace over at once
    monkeypatch.setattr(launch.subprocess, "Popen", _StoppedTorchrun)
    with pytest.raises(Terminated):
        launch.launch_ranks(run, cfg_for(tiny8, processes=2), "train")
    proc = _StoppedTorchrun.last
    assert proc.terminated and getattr(proc, "killed", False)


def test_a_longer_run_continues_from_the_last_checkpoint_and_nothing_finished_is_deleted(synth_run, tiny8, tmp_path,
                                                                                        capsys):
    """Raising train.max_steps after a finished run continues from its last checkpoint (the
    schedule re-planned over the new length), the finished drafter kept aside; a second change
    keeps the first one's too (previous/, previous-2/), and a change of what a step computes still
    starts over without deleting anything."""
    sets = dict(max_steps=6, checkpoint_every=3, keep_checkpoints=5)
    run = copy_run(synth_run, tmp_path / "run")
    run_train(run, cfg_for(tiny8, **sets))
    d = run.path / "train"
    first = final_weights(run)
    capsys.readouterr()

    m = run_train(run, cfg_for(tiny8, **{**sets, "max_steps": 9}))
    out = capsys.readouterr().out
    assert m["counts"]["done"] == 9
    assert "continuing from step 6 to 9" in out and f"resumed from {d / 'checkpoints' / 'step_6'}" in out
    assert [x["step"] for x in metrics(run)] == sorted(set(x["step"] for x in metrics(run)))  # no step twice
    kept = load_file(str(d / "previous" / "final" / "model.safetensors"))
    assert all(torch.equal(kept[k], first[k]) for k in first)  # the 6-step drafter, as it was

    m = run_train(run, cfg_for(tiny8, **{**sets, "max_steps": 12}))
    assert m["counts"]["done"] == 12 and "continuing from step 9 to 12" in capsys.readouterr().out
    assert (d / "previous" / "final").is_dir() and (d / "previous-2" / "final").is_dir()

    run_train(run, cfg_for(tiny8, **{**sets, "max_steps": 12, "lr": 1e-4}))  # another run: starts over
    assert (d / "previous-3" / "checkpoints" / "step_12").is_dir() and (d / "previous-3" / "final").is_dir()
    assert (d / "previous" / "final").is_dir() and (d / "previous-2" / "final").is_dir()
    assert "resumed from" not in run_cli(*cli_args(run, tiny8, **{**sets, "max_steps": 12, "lr": 1e-4}),
                                         env=THREADS, check=True).stdout  # up to date now


def test_each_kind_takes_the_targets_shape_and_refuses_what_vllm_cannot_serve(tmp_path, tiny8):
    """train.method sizes the drafter from the target like EAGLE-3 (DFlash: block ttt_steps + 1, Qwen3 attention;
    the mask token from the target config's pad/eos) and refuses, in one line, what vLLM 0.32 has no server for:
    P-EAGLE or EAGLE-3.1's norms beside an MLA drafter, DFlash with EAGLE-3.1's norms."""
    from families import make_tiny

    from draftsmith.train.drafter import drafter_config

    info = target_info(str(tiny8))
    dcfg = drafter_config(info, cfg_for(tiny8, method="dflash", ttt_steps=5), 64, 3)
    assert dcfg.block_size == 6 and dcfg.attention == "gqa" and dcfg.mask_token_id is not None
    assert drafter_config(info, cfg_for(tiny8, method="peagle", mask_token_id=9), 64, 3).mask_token_id == 9
    with pytest.raises(DraftsmithError, match="dflash: the EAGLE-3.1 norms"):
        drafter_config(info, cfg_for(tiny8, method="dflash", norm_output="true"), 64, 3)
    ds = make_tiny("deepseek_v3", tmp_path / "ds")
    ds_info = target_info(str(ds))
    assert drafter_config(ds_info, cfg_for(ds), 64, 3).attention == "mla"
    for sets in ({"method": "peagle"}, {"norm_before_fc": "true"}):
        with pytest.raises(DraftsmithError, match="vLLM 0.32 serves .* with no MLA drafter; set "
                                                  "train.drafter_attention=gqa") as e:
            drafter_config(ds_info, cfg_for(ds, **sets), 64, 3)
        assert "\n" not in str(e.value)
    assert drafter_config(ds_info, cfg_for(ds, method="peagle", drafter_attention="gqa"), 64, 3).attention == "gqa"
    assert drafter_config(ds_info, cfg_for(ds, method="dflash"), 64, 3).attention == "gqa"


def test_an_export_format_that_cannot_hold_the_drafter_is_refused_before_training(synth_run, tiny8, tmp_path):
    """export.format=eagle3 holds one decoder layer: a two-layer drafter is refused as train starts, in one line
    naming the field, not after the hours of training at export."""
    run = copy_run(synth_run, tmp_path / "run")
    cfg = cfg_for(tiny8, max_steps=2, num_layers=2, **{"export.format": "eagle3"})
    with pytest.raises(DraftsmithError, match=r"^export.format: eagle3 cannot hold this drafter: the drafter has 2 "
                                              r"decoder layers"):
        run_train(run, cfg)
    assert not (run.path / "train" / "checkpoints").exists() and run.read_manifest("train") is None
