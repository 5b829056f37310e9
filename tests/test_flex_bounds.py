"""Flex attention compiles a bounded set of graphs (model/ttt.py FlexShape): rows padded to the micro-batch's
rows, lengths to buckets; Dynamo's recompile limit is that bound, and hitting it, or flex running unfused, stops
with one line (issue 55, item 1). On the CPU flex runs forward only (torch has no CPU backward for it), so the
compile counts here are under no_grad; each compile takes ~20 s, so the tests compile as few graphs as they can."""

from types import SimpleNamespace

import pytest
import torch

from draftsmith import DraftsmithError
from draftsmith.extract.codecs import codec_of
from draftsmith.model import ttt
from draftsmith.model.ttt import FLEX_BLOCK, FlexShape
from draftsmith.store_format import BF16
from draftsmith.train import stage
from draftsmith.train.data import pack_epoch, pack_rows
from draftsmith.train.objective import TTTObjective, flex_shape
from test_train import tiny_drafter


def test_length_buckets_are_two_per_octave_capped_at_the_row():
    """2, 3, 4, 6, 8, 12, ... tiles (at most 1.5x a row's own tiles), the last one the row length's; the bound
    counts each bucket once per TTT step and grad mode."""
    kimi = FlexShape(rows=2, row_len=8192, steps=7)
    assert kimi.buckets() == [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
    assert kimi.graph_bound == 11 * 7 * 2
    for n in range(1, 8193):
        t = kimi.tiles(n)
        assert t in kimi.buckets() and t * FLEX_BLOCK >= n
        assert t <= max(2, 1.5 * -(-n // FLEX_BLOCK)), n
    odd = FlexShape(rows=1, row_len=5000, steps=3)  # 40 tiles: the cap is a bucket of its own
    assert odd.buckets()[-3:] == [24, 32, 40] and odd.tiles(4500) == 40 and odd.tiles(3000) == 24
    assert FlexShape(4, 100, 1).buckets() == [2]  # one tile would be a graph of its own: two at least
    for bad in (0, 5001):
        with pytest.raises(ValueError, match="outside 1..5000"):
            odd.tiles(bad)
    with pytest.raises(ValueError, match="steps >= 1"):
        FlexShape(2, 512, 0)


def _samples(lengths: list[int], H: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    # the states as a bf16 store holds them: each one part
    return [{"input_ids": torch.randint(0, 20, (n,), generator=g), "loss_mask": torch.rand(n, generator=g) > 0.2,
             "aux_hidden": (torch.randn(n, 3 * H, generator=g).bfloat16(),),
             "last_hidden": (torch.randn(n, H, generator=g).bfloat16(),), "index": i} for i, n in enumerate(lengths)]


@torch.no_grad()
def test_flex_compiles_a_bounded_set_over_varying_lengths_and_a_one_row_tail():
    """The real packing (pack_epoch, pack_rows: each micro-batch as long as its longest row) over samples of
    many lengths, 2 rows a micro-batch and a 1-row tail, through the objective with flex: the loss of every
    micro-batch is the SDPA path's, and the whole epoch compiles at most 2 graphs (step 0's keys as long as
    its queries, and the later steps'), within the run's bound. Before FlexShape every new row count, one-tile
    length and view of the keys compiled another graph, up to Dynamo's limit of 8 and then ran unfused."""
    tc = SimpleNamespace(seq_len=512, batch_tokens=1024, ttt_steps=3)
    shape = flex_shape(tc)
    assert (shape.rows, shape.row_len, shape.steps, shape.graph_bound) == (2, 512, 3, 18)
    d, W_d = tiny_drafter(seed=3)
    flex, sdpa = (TTTObjective(d, W_d, 3, 0.8, attention=a, flex_shape=shape if a == "flex" else None)
                  for a in ("flex", "sdpa"))
    # rows over 256 tokens pack one a row: 5 rows, a 1-row tail; then a 1-row micro-batch of one tile
    lengths = [500, 450, 300, 280, 270, 100]
    samples = _samples(lengths, d.config.hidden_size)
    plan = pack_epoch(lengths[:5], shape.row_len, shape.rows, seed=0, epoch=0) + [[[5]]]
    torch._dynamo.reset()
    before = len(ttt.FLEX_GRAPHS)
    seen = set()
    for rows in plan:
        batch = pack_rows([[samples[i] for i in row] for row in rows], codec=codec_of(BF16)).to(
            torch.device("cpu"), torch.float32)
        seen.add(tuple(batch.input_ids.shape))
        denom = [float(n) for n in sdpa.counts(batch)]
        got, want = flex(batch, denom), sdpa(batch, denom)
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert any(R == 1 for R, _ in seen) and len({T for _, T in seen}) >= 3, seen  # 1-row tails, varied lengths
    assert {shape.tiles(T) for _, T in seen} == {2, 3, 4}, seen
    graphs = ttt.FLEX_GRAPHS[before:]
    assert 1 <= len(graphs) <= 2 <= shape.graph_bound, graphs
    assert all(g.startswith("rows 2, ") and g.endswith("without grad") for g in graphs), graphs


@pytest.fixture
def fresh_dynamo():
    """Dynamo without compiled graphs, before (the limit counts from none) and after (no state of a hit limit
    or a disabled call left for later tests)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@torch.no_grad()
def test_past_the_bound_flex_stops_with_one_line(monkeypatch, fresh_dynamo):
    """A graph more than the bound (forced to 1 here) is an error naming the limit and what to do, one line;
    never torch's fallback to unfused flex."""
    d, _ = tiny_drafter(seed=4)
    ids, aux = torch.randint(0, 20, (1, 200)), torch.randn(1, 200, 3 * d.config.hidden_size)
    monkeypatch.setattr(FlexShape, "graph_bound", property(lambda self: 1))  # no graph yet: the first fits it
    with pytest.raises(DraftsmithError) as err:
        # steps 0 and 1 take two graphs (keys as long as the queries, then twice): the second is past the bound
        d.ttt_forward(ids, aux, 2, attention="flex")
    msg = str(err.value)
    assert "\n" not in msg and "bound of 1 (Dynamo's recompile limit)" in msg and "train.attention: sdpa" in msg, msg
    assert "failed guard: " in msg and "not logged" not in msg, msg  # Dynamo's own notice, folded into the line


@torch.no_grad()
def test_flex_run_unfused_stops_with_one_line(fresh_dynamo):
    """Dynamo disabled (TORCHDYNAMO_DISABLE, say): flex would take its unfused path (all [B, H, L, (k+1)L]
    scores) behind one UserWarning; it stops instead, in one line."""
    d, _ = tiny_drafter(seed=5)
    ids, aux = torch.randint(0, 20, (1, 200)), torch.randn(1, 200, 3 * d.config.hidden_size)
    with torch._dynamo.config.patch(disable=True), pytest.raises(DraftsmithError) as err:
        d.ttt_forward(ids, aux, 1, attention="flex")
    msg = str(err.value)
    assert "\n" not in msg and "without compiling it" in msg and "train.attention: sdpa" in msg, msg


def test_the_train_stage_logs_each_flex_graph_and_the_count(monkeypatch):
    """A line per graph compiled since the last note, numbered within the run and with its bound; nothing for
    the SDPA path."""
    lines = []
    monkeypatch.setattr(stage, "say", lines.append)
    monkeypatch.setattr(stage, "FLEX_GRAPHS", ["from before the run", "rows 2, length 384, keys 384"])
    ts = SimpleNamespace(flex_bound=18, flex_before=1, flex_noted=1)
    stage._note_flex(ts)
    stage.FLEX_GRAPHS.append("rows 2, length 384, keys 768")
    stage._note_flex(ts)
    stage._note_flex(ts)
    assert lines == ["flex attention: compiled graph 1 (rows 2, length 384, keys 384); at most 18 in this run",
                     "flex attention: compiled graph 2 (rows 2, length 384, keys 768); at most 18 in this run"]
    stage._note_flex(SimpleNamespace(flex_bound=None, flex_before=0, flex_noted=0))
    assert len(lines) == 2
