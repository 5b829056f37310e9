"""The vocab stage: top-k selection, tie-break, fill, coverage, and refusal of mismatched vocabularies."""

import json
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import build_tiny_target
from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.heldout import split
from draftsmith.prepare import run_prepare
from draftsmith.rundir import RunDir
from draftsmith.target import target_info
from draftsmith.vocab import load_vocab, run_vocab, select_draft_vocab

ANSWERS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello! How can I help you today? I am a helpful assistant.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10, numbers and letters: a b c d e f g",
    "The sea and the sky. The sea and the sky.",
]


def make_run(path: Path, target: Path, n: int = 10, records: list[dict] | None = None) -> RunDir:
    """A run whose generate stage completed with `n` small conversations (or these `records`)."""
    run = RunDir(path).ensure()
    records = records or [{"id": f"s{i}", "messages": [{"role": "user", "content": f"Question {i}?"},
                                                       {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)]}]}
                          for i in range(n)]
    n = len(records)
    (run.stage_dir("generate") / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run.write_manifest("generate", fingerprint=f"gen-{n}", inputs={"target_fingerprint": target_info(str(target)).fingerprint},
                       settings={}, counts={"done": n, "total": n, "unit": "samples"}, started=time.time())
    return run


def cfg_for(target, *sets: str):
    return load_config(None, [f"target={target}", *sets])


# -------------------------------------------------------------------------------------------------
# Selection


def test_top_k_with_ties_to_the_smaller_id():
    counts = np.array([5, 3, 3, 0, 7, 3, 1])
    d2t, t2d = select_draft_vocab(counts, 3)
    # 4 (7), 0 (5), then the tie among 1, 2, 5 (3 each) goes to 1.
    assert np.flatnonzero(t2d).tolist() == [0, 1, 4]
    assert d2t.dtype == np.int64 and t2d.dtype == bool
    assert (np.arange(3) + d2t).tolist() == [0, 1, 4]
    assert d2t.tolist() == [0, 0, 2]


def test_fewer_distinct_tokens_fill_with_lowest_unused_ids():
    counts = np.zeros(10, dtype=np.int64)
    counts[[7, 3]] = [4, 9]
    d2t, t2d = select_draft_vocab(counts, 5)
    assert np.flatnonzero(t2d).tolist() == [0, 1, 2, 3, 7]
    assert select_draft_vocab(counts, 5)[0].tolist() == d2t.tolist()  # deterministic


def test_size_larger_than_target_vocab_is_an_error(tiny_target, tmp_path):
    with pytest.raises(DraftsmithError, match="vocab.draft_vocab_size: 11 is larger than the target vocabulary"):
        select_draft_vocab(np.ones(10), 11)
    run = make_run(tmp_path / "run", tiny_target)
    run_prepare(run, cfg_for(tiny_target))
    v = target_info(str(tiny_target)).vocab_size
    with pytest.raises(DraftsmithError, match=f"vocab.draft_vocab_size: {v + 1} is larger than the vocabulary of target"):
        run_vocab(run, cfg_for(tiny_target, f"vocab.draft_vocab_size={v + 1}"))
    assert run.read_manifest("vocab") is None
    assert run_vocab(run, cfg_for(tiny_target, f"vocab.draft_vocab_size={v}"))["counts"]["coverage"] == 1.0


# -------------------------------------------------------------------------------------------------
# The stage


def test_counts_and_coverage_match_a_hand_computation(tiny_target, tmp_path, capsys):
    run = make_run(tmp_path / "run", tiny_target)
    run_prepare(run, cfg_for(tiny_target))
    size = 20
    m = run_vocab(run, cfg_for(tiny_target, f"vocab.draft_vocab_size={size}"))

    freq = Counter()
    lines = [json.loads(x) for x in (run.path / "prepare" / "samples.jsonl").read_text().splitlines()]
    held = {lines[i]["id"] for i in split([r["id"] for r in lines], 0.02).indices}  # the default train.validation
    assert len(held) == 1  # the floor: a tenth of 10 groups
    for r in lines:
        if r["id"] not in held:
            freq.update(t for t, k in zip(r["input_ids"], r["loss_mask"]) if k)
    top = sorted(freq, key=lambda t: (-freq[t], t))[:size]
    expected = sum(freq[t] for t in top) / sum(freq.values())
    assert len(freq) > size and expected < 1.0  # the test means something: not everything fits

    info = json.loads((run.path / "vocab" / "vocab.json").read_text())
    assert info["coverage"] == pytest.approx(expected) == m["counts"]["coverage"] == m["coverage"]
    assert info["tokens_counted"] == sum(freq.values()) and info["distinct_tokens"] == len(freq)
    assert info["target_fingerprint"] == target_info(str(tiny_target)).fingerprint
    t = load_file(str(run.path / "vocab" / "vocab.safetensors"))
    V = target_info(str(tiny_target)).vocab_size
    assert t["counts"].shape == (V,) and t["t2d"].shape == (V,) and t["d2t"].shape == (size,)
    assert {i: int(c) for i, c in enumerate(t["counts"]) if c} == dict(freq)
    assert np.flatnonzero(t["t2d"]).tolist() == sorted(top)
    assert (np.arange(size) + t["d2t"]).tolist() == sorted(top)
    out = capsys.readouterr().out
    assert f"draft vocab {size} of {V} covers {expected:.1%} of {sum(freq.values())} loss-masked tokens" in out
    # Rerun with the same inputs: nothing redone.
    assert run_vocab(run, cfg_for(tiny_target, f"vocab.draft_vocab_size={size}"))["finished"] == m["finished"]


WORDS = ["Zanzibar", "quokka", "Reykjavik", "xylophone", "Tbilisi", "axolotl", "Ouagadougou", "narwhal", "Kyzyl",
         "pangolin", "Wagga", "ocelot"]


def test_the_vocabulary_counts_no_held_out_token(tiny_target, tmp_path, capsys):
    """Validation's held-out samples (draftsmith/heldout.py) are left out of the counts: a token only they hold is
    never counted, so a validation answer misses for an out-of-vocabulary token as a fresh prompt's would."""
    records = [{"id": f"conv{i:02d}", "messages": [{"role": "user", "content": f"Tell me about {w}."},
                                                   {"role": "assistant", "content": f"{w} {w} {w}."}]}
               for i, w in enumerate(WORDS)]
    run = make_run(tmp_path / "run", tiny_target, records=records)
    run_prepare(run, cfg_for(tiny_target))
    cfg = cfg_for(tiny_target, "vocab.draft_vocab_size=8", "train.validation=4")
    run_vocab(run, cfg)
    lines = [json.loads(x) for x in (run.path / "prepare" / "samples.jsonl").read_text().splitlines()]
    held = {lines[i]["id"] for i in split([r["id"] for r in lines], 4).indices}
    assert len(held) == 4
    masked = {r["id"]: {t for t, k in zip(r["input_ids"], r["loss_mask"]) if k} for r in lines}
    only_held = set().union(*(masked[i] for i in held)) - set().union(*(masked[i] for i in masked if i not in held))
    assert only_held  # the test means something: some token occurs in held-out answers alone
    counts = load_file(str(run.path / "vocab" / "vocab.safetensors"))["counts"]
    assert all(counts[t] == 0 for t in only_held)
    info = json.loads((run.path / "vocab" / "vocab.json").read_text())
    assert info["held_out_samples"] == 4 and info["samples_counted"] == len(lines) - 4
    assert "the 4 samples validation holds out not counted" in capsys.readouterr().out
    # validation off: every sample counted, and the vocabulary is rebuilt (its settings changed)
    run_vocab(run, cfg_for(tiny_target, "vocab.draft_vocab_size=8", "train.validation=0"))
    counts = load_file(str(run.path / "vocab" / "vocab.safetensors"))["counts"]
    assert all(counts[t] > 0 for t in only_held)


def test_load_vocab_refuses_mismatches(tiny_target, tmp_path):
    run = make_run(tmp_path / "run", tiny_target)
    run_prepare(run, cfg_for(tiny_target))
    fp = target_info(str(tiny_target)).fingerprint
    with pytest.raises(DraftsmithError, match="stage 'vocab' has not completed"):
        load_vocab(run)
    run_vocab(run, cfg_for(tiny_target, "vocab.draft_vocab_size=32"))
    d2t, t2d, info = load_vocab(run, expect_target_fingerprint=fp, expect_size=32)
    assert d2t.dtype.is_floating_point is False and d2t.shape == (32,) and int(t2d.sum()) == 32
    assert info["draft_vocab_size"] == 32

    with pytest.raises(DraftsmithError, match=r"vocab/vocab.json: built for another target"):
        load_vocab(run, expect_target_fingerprint="0123456789abcdef")
    with pytest.raises(DraftsmithError, match=r"vocab/vocab.json: draft vocabulary of 32 tokens, but vocab.draft_vocab_size is 64"):
        load_vocab(run, expect_size=64)

    # Prepared data rebuilt with other settings: the old vocabulary no longer matches it.
    run_prepare(run, cfg_for(tiny_target, "prepare.max_length=32"))
    with pytest.raises(DraftsmithError, match=r"vocab/vocab.json: built from other prepared data"):
        load_vocab(run, expect_target_fingerprint=fp, expect_size=32)
    # ... and the vocab stage rebuilds it instead of skipping.
    m = run_vocab(run, cfg_for(tiny_target, "vocab.draft_vocab_size=32"))
    assert m["inputs"]["prepare"] == run.read_manifest("prepare")["fingerprint"]
    load_vocab(run, expect_target_fingerprint=fp, expect_size=32)

    # A safetensors file from another build next to this vocab.json is caught too.
    other = make_run(tmp_path / "other", tiny_target, n=3)
    run_prepare(other, cfg_for(tiny_target))
    run_vocab(other, cfg_for(tiny_target, "vocab.draft_vocab_size=32"))
    (run.path / "vocab" / "vocab.safetensors").write_bytes((other.path / "vocab" / "vocab.safetensors").read_bytes())
    with pytest.raises(DraftsmithError, match=r"vocab.safetensors: does not belong to"):
        load_vocab(run)


def test_vocab_refuses_prepared_data_of_another_target(tiny_target, tmp_path):
    run = make_run(tmp_path / "run", tiny_target)
    run_prepare(run, cfg_for(tiny_target))
    other = build_tiny_target(tmp_path / "other-target", num_layers=2)
    with pytest.raises(DraftsmithError, match=r"prepare/manifest.json: built for another target"):
        run_vocab(run, cfg_for(other, "vocab.draft_vocab_size=32"))


def test_vocab_detects_prepared_file_changed_after_completion(tiny_target, tmp_path):
    run = make_run(tmp_path / "run", tiny_target)
    run_prepare(run, cfg_for(tiny_target))
    path = run.path / "prepare" / "samples.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]))
    with pytest.raises(DraftsmithError, match=r"samples.jsonl: \d+ bytes, written with \d+ \(changed since prepare finished"):
        run_vocab(run, cfg_for(tiny_target, "vocab.draft_vocab_size=32"))
