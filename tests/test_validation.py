"""The validation split and the chain acceptance: the number training predicts served acceptance by.

By hand: the chain counts of TTT and DFlash against a position-by-position computation, chain_acceptance's
arithmetic. The split: stable under order, growth and resampled answers. Through run_train: held-out samples
never reach a training forward (checked by sample index), each kind validates at its interval and at the end,
the figures ride in checkpoints, the manifest and `status`, and a resumed run validates to the same numbers."""

import json

import pytest
import torch

from draftsmith.config import load_config
from draftsmith.export import run_export
from draftsmith.model.config import DrafterConfig
from draftsmith.model.dflash import DFlashDrafter
from draftsmith.model.init import init_from_target
from draftsmith.status import run_status
from draftsmith.train.dflash import DFlashObjective, draw_blocks
from draftsmith.train.objective import TTTObjective, chain_acceptance, ttt_masks
from draftsmith.train.stage import run_train
from draftsmith.heldout import group_of, rank_of, split
from draftsmith.prompts import load_prompts
from test_train import (DOC, IDS, MASK, POS, _resumed_from_step_10, base_sets, cfg_for, copy_run, metrics, micro_batch,  # noqa: F401
                        synth_run,
                        tiny_drafter)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_chain_acceptance_is_the_mean_run_of_consecutive_right_drafts():
    # four chains start; runs of right drafts from each: 0, 1, 3, 2 (capped at K = 3)
    runs = [0, 1, 3, 2]
    chain = [sum(r > k for r in runs) for k in range(3)]  # [3, 2, 1]
    tau, per_pos = chain_acceptance(chain, len(runs))
    assert per_pos == [0.75, 0.5, 0.25]
    assert tau == pytest.approx(1 + sum(runs) / len(runs))  # 2.5
    # the old estimate multiplied marginal accuracies as if independent: not what a verifier counts
    acc = [3 / 4, 2 / 4, 2 / 4]  # marginal: step 2 right at the run-3 position and at a position whose step 0 failed
    assert 1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2] != pytest.approx(tau)
    assert chain_acceptance([0, 0, 0], 0) == (None, [None, None, None])


def test_ttt_chain_counts_match_a_position_by_position_computation():
    d, W_d = tiny_drafter()
    d.eval()
    aux = torch.randn(1, 9, 48)
    last = torch.randn(1, 9, 16)
    obj = TTTObjective(d, W_d, 3, 0.5)
    with torch.no_grad():
        _, stats = obj(micro_batch(IDS, MASK, DOC, POS, aux, last), [1.0, 1.0, 1.0])
        logits = d.ttt_forward(IDS, aux, 3, position_ids=POS, doc_ids=DOC)  # [R, T, Dv] per step
    masks = ttt_masks(IDS, MASK, DOC, d.t2d, 3)
    draft_ids = d.draft_ids()
    T = IDS.shape[1]
    starts, chain = 0, [0, 0, 0]
    for i in range(T):
        if not masks[0][0][0, i]:
            continue
        starts += 1
        for k in range(3):  # a draft counts only while every earlier one at i was right
            if not masks[k][1][0, i] or draft_ids[logits[k][0, i].argmax()] != IDS[0, i + 2 + k]:
                break
            chain[k] += 1
    assert starts == stats[0, 3].item() > 0
    assert stats[:, 4].tolist() == chain
    assert all(stats[k, 4] <= stats[k, 2] for k in range(3))  # a chain count never exceeds the marginal one


def test_dflash_chain_counts_match_a_block_by_block_computation():
    torch.manual_seed(0)
    V, H = 20, 16
    cfg = DrafterConfig(hidden_size=H, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=V, draft_vocab_size=8, block_size=4, mask_token_id=1, kind="dflash")
    d = DFlashDrafter(cfg)
    W = torch.randn(V, H)
    draft = torch.tensor((0, 2, 3, 5, 7, 11, 13, 17))
    init_from_target(d, torch.randn(V, H), W, None, draft)
    d.eval()
    aux, last = torch.randn(1, 9, 48), torch.randn(1, 9, H)
    obj = DFlashObjective(d, W[draft], 0.8, 8)
    with torch.no_grad():
        _, stats = obj(micro_batch(IDS, MASK, DOC, POS, aux, last), [1.0, 1.0, 1.0])
        blocks = draw_blocks(IDS, MASK, DOC, d.t2d, 4, 8)
        states = d.block_forward(IDS, aux, blocks.anchors, POS, DOC)  # [R, M, S, H]
    draft_ids = d.draft_ids()
    chain = [0, 0, 0]
    for m in range(blocks.anchors.shape[1]):
        if not blocks.masked[0, m, 0]:
            continue
        a = int(blocks.anchors[0, m])
        for j in range(3):
            if not blocks.valid[0, m, j]:
                break
            pred = draft_ids[d.lm_head(d.norm(states[0, m, j + 1])).argmax()]
            if pred != IDS[0, a + j + 1]:
                break
            chain[j] += 1
    assert stats[0, 3].item() == int(blocks.masked[0, :, 0].sum()) > 0
    assert stats[:, 4].tolist() == chain


def test_the_split_depends_on_groups_alone():
    ids = [f"p{i}" for i in range(5000)]
    held = split(ids, 0.02, 64, 256)
    # a share: exactly the groups whose hash falls under it (about 2 % of 5,000)
    assert held.decided_by == "share" and all(rank_of(ids[i]) < 0.02 for i in held.indices)
    assert all(rank_of(x) >= 0.02 for i, x in enumerate(ids) if i not in set(held.indices))
    assert 70 < len(held.indices) < 130
    # the same samples in another order (another packing, a reshuffled file): the same held-out ids
    rev = list(reversed(ids))
    assert sorted(rev[i] for i in split(rev, 0.02, 64, 256).indices) == sorted(ids[i] for i in held.indices)
    # a count, the cap, off, never more than half the samples (0.999 of 4 samples held out 3)
    assert len(split(ids, 7, 64, 256).indices) == 7 and len(split(ids, 0.5, 64, 40).indices) == 40
    assert split(ids, 0, 64, 256).indices == []
    assert len(split(ids[:3], 50, 64, 256).indices) == 1
    assert len(split(ids[:4], 0.999, 64, 256).indices) == len(split(ids[:4], 3, 64, 256).indices) == 2
    # the floor: a share of a small store is raised to the minimum greedy answers, but never past a tenth
    small = split(ids[:1000], 0.02, 64, 256)
    assert small.decided_by == "floor" and small.greedy == 64 and len(small.indices) == 64
    tiny = split(ids[:200], 0.02, 64, 256)
    assert tiny.decided_by == "floor" and len(tiny.indices) == 20  # a tenth of 200 groups
    # resampled answers stay with their prompt: a prompt is held out with all of its answers or not at all
    many = [x for i in range(200) for x in (f"q{i}", f"q{i}#2@T1", f"q{i}#3@T1")]
    s = split(many, 10, 64, 256)
    keys = set(s.groups)
    assert keys and sum(group_of(x) in keys for x in many) == 3 * len(keys) == len(s.indices)
    assert s.greedy == len(keys)  # only the greedy answers are measured
    assert group_of("a#b#3@T0.7") == "a#b"


def test_no_held_out_group_shares_a_conversation_with_training():
    # ShareGPT's segments of one conversation, renamed duplicates and resampled answers are one group each
    assert group_of("wNBG8Gp_0") == group_of("wNBG8Gp_15") == group_of("wNBG8Gp_80#2") == "wNBG8Gp"
    assert group_of("wNBG8Gp_15#2@T0.7") == "wNBG8Gp" and group_of("CipTWlm_9#3") == "CipTWlm"
    assert group_of("sample_3") == "sample_3" and group_of("my-data-12") == "my-data-12"  # not ShareGPT's shape
    # the packaged ShareGPT prompts: no held-out conversation has a segment in training
    prompts = load_prompts("sharegpt", limit=2000, skip_invalid=True)
    ids = [p.id for p in prompts]
    s = split(ids, 0.05, 64, 256)
    held_groups = {group_of(ids[i]) for i in s.indices}
    trained_groups = {group_of(x) for i, x in enumerate(ids) if i not in set(s.indices)}
    assert held_groups and not held_groups & trained_groups
    assert any(len(m) > 1 for m in s.groups.values())  # some held-out conversation does have several segments
    # the old rule (a hash of each segment's id) split conversations: the ruler this replaces
    by_segment = {x for x in ids if rank_of(x) < 0.05}
    assert {group_of(x) for x in by_segment} & {group_of(x) for x in ids if x not in by_segment}
    # a user-named group (generate.group_by) wins over the id
    groups = {x: "topic-" + str(int(x[1:]) % 10) for x in [f"p{i}" for i in range(400)]}
    g = split(list(groups), 0.02, 64, 256, groups)
    held_topics = set(g.groups)
    assert held_topics and held_topics <= set(groups.values())  # the floor: one topic of ten (a tenth)
    assert all((groups[x] in held_topics) == (j in set(g.indices)) for j, x in enumerate(groups))


def test_the_split_survives_growth_of_the_store():
    ids = [f"c{i:05d}_{k}" for i in range(3000) for k in range(2)]  # not ShareGPT's shape: each its own group
    small, large = ids[:2000], ids  # a store, then the same store grown by more data
    for share in (0.02, 30):  # the floor decides the small one at 2 %; a count in both
        a, b = split(small, share, 64, 256), split(large, share, 64, 256)
        trained_small = {small[i] for i in range(len(small)) if i not in set(a.indices)}
        # no group trained on in the smaller store is held out in the larger one
        assert not trained_small & {large[i] for i in b.indices}
    # while the share alone decides, the held-out groups are exactly the same
    a, b = split(ids[:4000], 0.02, 64, 256), split(ids, 0.02, 64, 256)
    assert a.decided_by == b.decided_by == "share"
    assert {ids[i] for i in a.indices} == {ids[i] for i in b.indices if i < 4000}


def _recording(monkeypatch, cls) -> list[tuple[bool, list[int]]]:
    """(training mode, sample indices) of every forward of objective class `cls`."""
    seen, forward = [], cls.forward

    def wrapped(self, batch, denom, scale=1.0):
        seen.append((self.training, list(batch.samples)))
        return forward(self, batch, denom, scale)
    monkeypatch.setattr(cls, "forward", wrapped)
    return seen


@pytest.mark.parametrize("method", ["eagle3", "peagle", "dflash"])
def test_held_out_samples_never_train_and_every_kind_validates(synth_run, tiny8, tmp_path, monkeypatch, capsys,
                                                               method):
    run = copy_run(synth_run, tmp_path / "run")
    seen = _recording(monkeypatch, DFlashObjective if method == "dflash" else TTTObjective)
    cfg = cfg_for(tiny8, method=method, max_steps=20, checkpoint_every=10, validation=6, validate_every=8)
    m = run_train(run, cfg)
    trained = {i for training, s in seen if training for i in s}
    validated = {i for training, s in seen if not training for i in s}
    store_ids = json.loads((run.path / "extract" / "meta.json").read_text())["ids"]
    assert validated == set(split(store_ids, 6, 64, 256).indices) and len(validated) == 6
    assert trained and not trained & validated
    rows = [r for r in metrics(run) if r.get("split") == "validation"]
    assert [r["step"] for r in rows] == [8, 16, 20]
    last = rows[-1]
    assert last["samples"] == 6 and last["positions"] > 0 and len(last["acceptance_per_position"]) == 3
    assert last["acceptance_length"] == pytest.approx(1 + sum(last["acceptance_per_position"]))
    train_rows = [r for r in metrics(run) if r.get("split") is None]
    assert train_rows[-1]["acceptance_length"] == pytest.approx(1 + sum(train_rows[-1]["acceptance_per_position"]))
    for folder in ("final", "checkpoints/step_20"):
        state = json.loads((run.path / "train" / folder / "state.json").read_text())
        assert state["validation"] == {k: v for k, v in last.items() if k != "split"}
    assert m["counts"]["validation"]["acceptance_length"] == last["acceptance_length"]
    st = {s["name"]: s for s in run_status(run.path)["stages"]}["train"]
    assert st["validation"]["acceptance_length"] == last["acceptance_length"] and st["validation"]["step"] == 20
    log = (run.path / "train" / "stage.log").read_text()
    assert "validation at step 20: tau" in log and ", val " in log
    assert "validation: 6 groups (6 samples) held out" in capsys.readouterr().out
    # every tau with its error; the split written for anyone to check
    assert isinstance(last["acceptance_length_se"], float) and 0 < last["acceptance_length_se"] < 1
    assert st["validation"]["acceptance_length_se"] == last["acceptance_length_se"]
    written = json.loads((run.path / "train" / "validation.json").read_text())
    assert written["samples"] == 6 and written["settings"]["validation"] == 6
    assert {x for g in written["held_out"].values() for x in g["ids"]} == {store_ids[i] for i in validated}
    # train/best: the pass with the highest tau (the first of equal ones), with the count of passes it beat
    top = max(rows, key=lambda r: (r["acceptance_length"], -r["step"]))
    best_state = json.loads((run.path / "train" / "best" / "state.json").read_text())
    assert best_state["step"] == top["step"] and best_state["validation_passes"] == rows.index(top) + 1
    assert best_state["validation"] == {k: v for k, v in top.items() if k != "split"}
    assert m["counts"]["best_validation"]["step"] == top["step"] and m["counts"]["validation_passes"] == 3
    assert "best/model.safetensors" in m["files"]
    if method == "eagle3":
        # resumed from step 10: the same weights, so the same validation figures at 16 and 20, and the same best
        _resumed_from_step_10(run, cfg)
        again = [r for r in metrics(run) if r.get("split") == "validation"]
        assert [r["step"] for r in again] == [8, 16, 20]
        for a, b in zip(rows, again):
            assert a["acceptance_per_position"] == b["acceptance_per_position"] and a["loss"] == b["loss"]
        assert json.loads((run.path / "train" / "best" / "state.json").read_text())["step"] == top["step"]
        # export.checkpoint=best exports it, and the card says what its validation figure is of
        run_export(run, load_config(None, [*base_sets(tiny8), "export.checkpoint=best"]))
        exported = json.loads((run.path / "export" / "config.json").read_text())["draftsmith"]
        assert exported["checkpoint"] == "train/best" and exported["step"] == top["step"]
        assert exported["validation"]["acceptance_length"] == top["acceptance_length"]
        card = (run.path / "export" / "README.md").read_text()
        assert f"picked as the best of {exported['validation_passes']} validation passes" in card
        run_export(run, load_config(None, [*base_sets(tiny8), "export.checkpoint=final"]))
        exported = json.loads((run.path / "export" / "config.json").read_text())["draftsmith"]
        assert exported["checkpoint"] == "train/final" and exported["step"] == 20
        assert "picked as the best" not in (run.path / "export" / "README.md").read_text()


def test_the_serving_walk_counts_as_a_greedy_verifier_does():
    from draftsmith.train.objective import serving_walk

    # one answer whose chains start at positions 2..9 (8 tokens: the first comes from the prefill, never drafted)
    starts = torch.zeros(1, 12, dtype=torch.bool)
    starts[0, 2:10] = True
    runs = torch.tensor([[0, 0, 3, 0, 3, 0, 0, 2, 1, 0, 0, 0]])
    # served: from 3 (run 0: emit 1, next 4), from 4 (run 3: emit 4, next 8), from 8 (run 1: emit 2, next 10, past
    # the answer): 3 drafts, 4 accepted; the mean over every position would count the run of 3 at position 2 too
    drafts, accepted, *per_pos = serving_walk(starts, runs, 3)
    assert (drafts, accepted, per_pos) == (3, 4, [2, 1, 1])
    # two rows, a second answer span in the first row (a multi-turn sample): each span skips its own first start
    starts = torch.zeros(2, 12, dtype=torch.bool)
    starts[0, 1:4] = starts[0, 7:10] = starts[1, 0:3] = True
    runs = torch.tensor([[0, 9, 2, 2, 0, 0, 0, 9, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]])
    assert serving_walk(starts, runs, 3)[:2] == [1 + 2 + 1, 2 + 0 + 0 + 1]  # runs capped at K = 3


def test_the_validation_line_says_what_is_held_out_or_that_none_is(tmp_path, monkeypatch):
    """train/stage.py's _validation: with held-out samples one line of how many, measured over how many tokens and
    how often; with train.validation set but nothing held out, one line that it is off and what the train line's tau
    then means; with validation 0, nothing."""
    from types import SimpleNamespace

    from draftsmith.config import load_config
    from draftsmith.rundir import RunDir
    from draftsmith.train import stage as train_stage

    said: list[str] = []
    monkeypatch.setattr(train_stage, "say", said.append)
    run, one = RunDir(tmp_path / "run"), SimpleNamespace(rank=0, world=1)
    packing = SimpleNamespace(row_len=64, rows_per_batch=2)
    ids, lengths = ["a", "b", "c", "d"], [10, 100, 30, 40]
    cfg = load_config(None, ["train.validation=2", "train.validate_every=25"])
    v = train_stage._validation(run, cfg, split(ids, 2), ids, lengths, packing, one)
    assert v is not None and len(v.measured) == 2 and v.tokens == sum(min(lengths[i], 64) for i in v.measured)
    assert said[0].startswith("validation: 2 groups (2 samples) held out by a hash of their group")
    assert said[0].endswith(f"2 measured ({v.tokens} tokens) every 25 steps and after the last, on the answers' "
                            "tokens")
    # fewer than validation_min_samples: a line that says the error is larger and what to do
    assert said[1].startswith("validation: 2 greedy answers measured, fewer than train.validation_min_samples (64")
    assert said[1].endswith("raise train.validation to hold out more")
    assert json.loads((run.path / "train" / "validation.json").read_text())["samples"] == 2
    said.clear()
    cfg = load_config(None, ["train.validation=0.1"])
    assert train_stage._validation(run, cfg, split([], 0.1), ids, lengths, packing, one) is None
    assert len(said) == 1 and said[0].startswith("validation: off (train.validation=0.1 of 4 samples holds out none)")
    assert not (run.path / "train" / "validation.json").exists()  # no stale split beside a run without one
    said.clear()
    assert train_stage._validation(run, load_config(None, ["train.validation=0"]), split(ids, 0), ids, lengths,
                                   packing, one) is None
    assert said == []


def test_a_grouping_column_holds_out_whole_groups_through_the_pipeline(tmp_path, tiny_target):
    """generate.group_by names a record field: generate and prepare carry it, and vocab (like train) holds out
    whole groups by it; a record without the field is refused in one line naming the file and line."""
    from draftsmith.config import load_config
    from draftsmith.pipeline import run_pipeline
    from draftsmith.prepared_format import prepared_groups
    from draftsmith.rundir import RunDir

    prompts = tmp_path / "p.jsonl"
    # 40 prompts in 8 topics; the ids say nothing of the topic (p0 and p8 share one)
    rows = [{"id": f"p{i}", "topic": f"t{i % 8}", "messages": [{"role": "user", "content": f"about {i}"},
                                                               {"role": "assistant", "content": f"answer {i}"}]}
            for i in range(40)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = [f"target={tiny_target}", f"generate.prompts={prompts}", "generate.backend=dataset",
            "generate.group_by=topic", "vocab.draft_vocab_size=32", "train.validation=10"]
    run = RunDir(tmp_path / "run")
    run_pipeline(run, load_config(None, sets), until_stage="vocab")
    groups = prepared_groups(run)
    assert groups == {r["id"]: r["topic"] for r in rows}
    ids = [r["id"] for r in rows]
    s = split(ids, 10, 64, 256, groups)
    held_topics = set(s.groups)
    assert held_topics and all((groups[x] in held_topics) == (j in set(s.indices)) for j, x in enumerate(ids))
    vocab = json.loads((run.path / "vocab" / "vocab.json").read_text())
    assert vocab["held_out_samples"] == len(s.indices) == 5 * len(held_topics)
    # a record without the named field: one line naming it, the file and the line
    rows[3].pop("topic")
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(Exception, match=r"p\.jsonl:4: field 'topic' \(generate\.group_by\) must be"):
        load_prompts(str(prompts), group_by="topic")
