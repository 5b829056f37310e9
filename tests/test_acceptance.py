"""The acceptance length's standard error (draftsmith/acceptance.py) on hand-made cases, against a bootstrap over
prompts, and the tolerance that follows from two of them."""

import math
import random

import pytest

from draftsmith.acceptance import CALIBRATED_GAP, acceptance, difference, fmt, tolerance


def test_the_error_of_a_hand_made_case():
    # three prompts: (drafts, accepted) = (10, 5), (10, 15), (20, 10); tau = 1 + 30/40 = 1.75, r = 0.75
    tau, se = acceptance([(10, 5), (10, 15), (20, 10)])
    assert tau == pytest.approx(1.75)
    # residuals a - r d: 5 - 7.5, 15 - 7.5, 10 - 15 = -2.5, 7.5, -5; n/(n-1) = 1.5; D = 40
    assert se == pytest.approx(math.sqrt(1.5 * (2.5 ** 2 + 7.5 ** 2 + 5 ** 2)) / 40)
    # every prompt at the same rate: no spread, no error
    assert acceptance([(10, 4), (20, 8), (5, 2)]) == (pytest.approx(1.4), pytest.approx(0.0))
    # too few prompts for an error; none that drafted, no figure
    assert acceptance([(10, 4)]) == (pytest.approx(1.4), None)
    assert acceptance([(0, 0)]) == (None, None) and acceptance([]) == (None, None)


def test_the_error_matches_a_bootstrap_over_prompts():
    rng = random.Random(0)
    rows = [(d, sum(rng.random() < 0.3 + 0.4 * (i % 3) / 2 for _ in range(d)))
            for i, d in enumerate(rng.randint(20, 120) for _ in range(64))]
    _, se = acceptance(rows)
    boots = []
    for _ in range(2000):
        draw = [rows[rng.randrange(len(rows))] for _ in rows]
        boots.append(acceptance(draw)[0])
    mean = sum(boots) / len(boots)
    boot_se = math.sqrt(sum((b - mean) ** 2 for b in boots) / (len(boots) - 1))
    assert se == pytest.approx(boot_se, rel=0.1)


def test_the_tolerance_follows_from_the_errors():
    gap, se = difference(1.50, 0.03, 1.40, 0.04)
    assert gap == pytest.approx(0.10) and se == pytest.approx(0.05)
    assert tolerance(se) == pytest.approx(0.10)  # two combined standard errors
    assert tolerance(0.01) == CALIBRATED_GAP  # never below the calibrated gap
    assert tolerance(None) == CALIBRATED_GAP and difference(1.5, None, 1.4, 0.1)[1] is None
    assert fmt(1.374, 0.0451) == "1.37 ± 0.05" and fmt(1.374, None) == "1.37" and fmt(None, 0.1) == "n/a"
    assert fmt(0.1, 0.05, "+.3f") == "+0.100 ± 0.050"
