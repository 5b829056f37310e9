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
