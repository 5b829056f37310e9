"""The recipes in configs/: each one loads (every key known, every value valid), and the ones
trained on this machine never see an evaluation prompt."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from draftsmith.config import load_config
from draftsmith.prompts import load_prompts

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))


def _norm(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads(path):
    cfg = load_config(path)
    assert cfg.generate.limit is not None, "a recipe says how many prompts it uses (estimate needs it)"


@pytest.mark.parametrize("path", [p for p in RECIPES if load_config(p).target == "smollm2-135m"], ids=lambda p: p.name)
def test_no_evaluation_prompt_in_training_data(path):
    """Every training prompt of the recipe, as generate selects them, against every MT-bench and
    HumanEval question: no equal text, and no question (of 40+ characters) inside a prompt; with
    backend `dataset` the file's replies are training text too, and are checked the same way."""
    cfg = load_config(path)
    g = cfg.generate
    dataset = g.backend == "dataset"
    train = load_prompts(g.prompts, limit=g.limit, seed=g.seed, offset=g.offset, skip_invalid=g.skip_invalid,
                         first_turn_only=g.first_turn_only, min_chars=g.min_chars, max_chars=g.max_chars,
                         require_answers=dataset)
    assert len(train) == g.limit
    evals = {_norm(t) for src in ("mt-bench", "humaneval") for p in load_prompts(src) for t in p.turns}
    assert len(evals) > 300  # 160 MT-bench turns + 164 HumanEval prompts
    long_evals = [e for e in evals if len(e) >= 40]
    for p in train:
        for turn in p.turns + (p.answers if dataset else []):
            t = _norm(turn)
            assert t not in evals, f"{path.name}: training prompt {p.id} is an evaluation prompt"
            hit = next((e for e in long_evals if e in t), None)
            assert hit is None, f"{path.name}: training prompt {p.id} contains an evaluation prompt: {hit[:60]}"


def _compare_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("compare", CONFIGS.parent / "bench" / "peer" / "compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return compare


def test_peer_comparison_fits_training_into_the_peers_end_to_end_time(tmp_path):
    """compare.py --train-minutes fit: draftsmith trains for the peer's end-to-end seconds less its
    own stages before training (their manifests' wall time) and the loading/export allowance; with
    no time left it stops in one line."""
    import json

    compare = _compare_module()
    for stage, wall in (("generate", 400.0), ("prepare", 2.0), ("vocab", 1.0), ("extract", 197.0)):
        (tmp_path / stage).mkdir()
        (tmp_path / stage / "manifest.json").write_text(json.dumps({"started": 1000.0, "finished": 1000.0 + wall}))
    assert compare.fitted_train_minutes(tmp_path, 3600.0) == pytest.approx((3600 - 600 - compare.FIT_OVERHEAD_S) / 60)
    with pytest.raises(SystemExit, match="no time is left to train"):
        compare.fitted_train_minutes(tmp_path, 650.0)


def test_peer_comparison_prompt_sets_are_disjoint_and_unseen(tmp_path):
    """bench/peer/compare.py's four evaluation sets for the 400-prompt recipe: 40 prompts each,
    MT-bench 81-120 (test) and 121-160 (validation), and two ShareGPT slices after the training
    prompts; no two sets share a text and none is a training prompt's (ShareGPT repeats short
    first turns such as "continue", which are skipped)."""
    import json

    compare = _compare_module()
    cfg = load_config(CONFIGS / "smollm2-cpu-400.yaml")
    files = compare.prompt_sets(cfg, tmp_path)
    texts = {}
    for name, f in files.items():
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        assert len(rows) == 40, name
        texts[name] = {r["messages"][-1]["content"].strip() for r in rows}
        assert len(texts[name]) == 40, name
    ids = [json.loads(line)["id"] for line in files["test-mtbench"].read_text().splitlines()]
    assert ids[0] == "mt-bench-81" and ids[-1] == "mt-bench-120"
    assert json.loads(files["val-mtbench"].read_text().splitlines()[0])["id"] == "mt-bench-121"
    names = sorted(texts)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not texts[a] & texts[b], (a, b)
    g = cfg.generate
    train = {p.turns[0].strip() for p in load_prompts(g.prompts, limit=g.limit, skip_invalid=g.skip_invalid, first_turn_only=True,
                                                      min_chars=g.min_chars, max_chars=g.max_chars)}
    for name in ("test-sharegpt", "val-sharegpt"):
        assert not texts[name] & train, name
