"""K chosen by speed: the speedup speculative decoding would give at each K from 1 to the K an eval served, from
what that eval measured. No torch; one rule for eval's report, the model card, the demo and `status`.

An eval at K measures, on its prompts and engine:
  p_i       the share of drafting steps whose i-th draft was accepted (report's acceptance_per_position; at
            temperature 0 a chain drafter's first k drafts are the same whatever K it is served with, so the
            first k shares are what serving at k would accept)
  C(K)      the cost of one drafting step (K draft passes + one verification of K+1 tokens) in plain decoding
            steps: tau / speedup (tokens/s = tau / step time; plain decoding makes one token per plain step)

    tokens(k) = 1 + p_1 + ... + p_k          speedup(k) = tokens(k) / C(k)

and C(k) for k < K by one of two rules, by what the engine measured:
  - it timed its draft passes (the local engine: d, one pass in plain steps): C(k) = C(K) - (K - k) d, each
    draft fewer saves its pass and nothing else (the verification and the step's fixed costs stay; at least 1);
  - it did not (vLLM's /metrics do not split the step): C(k) = 1 + k (C(K) - 1) / K, linear from plain
    decoding (k = 0) to the measured step. Exact where the whole step grows with the drafts; optimistic where
    much of it does not (vLLM-CPU: a step cost 1.29, 1.26 and 1.28 plain steps at K = 1, 2, 3,
    docs/experiments/peer-and-levers.md "K from 1 to 5"; the rule, from K = 3, says 1.09 at K = 1, so it
    predicts 1.23x where 1.04x was measured).
The measured K's row is the measurement. A prediction is a choice to confirm, not a figure: `draftsmith run` and
the demo (eval.num_speculative_tokens: auto) serve the K predicted fastest again and report what that measured;
`chosen` then takes each measured K at its measurement and draws the costs between measured ones.

tokens(k)'s standard error is the acceptance length's at k drafts (draftsmith/acceptance.py: the first k
positions' accepted drafts over the prompts); C(K)'s own noise is left out (one measured ratio for all k).

A block drafter (one forward drafts the whole block) is served at block_size - 1 only: its table is that one row.
"""

from __future__ import annotations

from typing import Iterable

from draftsmith.acceptance import acceptance


def step_cost(tau: float | None, speedup: float | None) -> float | None:
    """C(K): a drafting step's cost in plain decoding steps, from an eval's tau and measured speedup."""
    if not (isinstance(tau, (int, float)) and isinstance(speedup, (int, float)) and speedup > 0):
        return None
    return tau / speedup


def k_table(per_position: list[float | None], tau: float | None, speedup: float | None,
            per_prompt: Iterable[tuple[int, list[int]]] = (), block: bool = False,
            draft_pass: float | None = None) -> list[dict]:
    """[{k, tokens_per_step, tokens_per_step_se, step_cost, speedup}] for k = 1 .. K (K = len(per_position)),
    or [] without a measured speedup. per_prompt: (drafting steps, accepted drafts per position) of each prompt,
    for tokens(k)'s standard error. block: the kind drafts whole blocks (only k = K is served). draft_pass: one
    draft pass in plain steps, when the engine timed it (module doc)."""
    K = len(per_position)
    cost_K = step_cost(tau, speedup)
    if cost_K is None or K == 0 or any(p is None for p in per_position):
        return []
    return _table(per_position, {K: cost_K}, list(per_prompt), [K] if block else range(1, K + 1), draft_pass)


def step_costs(costs: dict[int, float], ks: Iterable[int], draft_pass: float | None) -> dict[int, float]:
    """C(k) at each k of `ks` from the measured `costs` (k > 0 -> C(k)): a measured k as measured, one between two
    measured ones linear between them, one below all of them by the module doc's rules (draft_pass, else linear
    from plain decoding's 1.0 at k = 0)."""
    points = sorted(costs.items())
    out = {}
    for k in ks:
        lo = max((p for p in points if p[0] <= k), default=None)
        hi = min((p for p in points if p[0] >= k), default=points[-1])
        if lo is None and draft_pass is not None:
            out[k] = max(1.0, hi[1] - (hi[0] - k) * draft_pass)
            continue
        lo = lo or (0, 1.0)
        out[k] = lo[1] if hi[0] == lo[0] else lo[1] + (k - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])
    return out


def _table(per_position: list[float], costs: dict[int, float], per_prompt: list, ks: Iterable[int],
           draft_pass: float | None) -> list[dict]:
    """The rows at `ks`: tokens(k) from the per-position acceptance, C(k) by step_costs."""
    ks = list(ks)
    cost_at = step_costs(costs, ks, draft_pass)
    table = []
    for k in ks:
        cost = cost_at[k]
        tokens = 1.0 + sum(per_position[:k])
        _, se = acceptance((n, sum(acc[:k])) for n, acc in per_prompt) if per_prompt else (None, None)
        table.append({"k": k, "tokens_per_step": tokens, "tokens_per_step_se": se, "step_cost": cost,
                      "speedup": tokens / cost})
    return table


def best(table: list[dict]) -> dict | None:
    """The row with the highest predicted speedup (the smaller k on a tie: fewer passes for the same speed)."""
    return max(table, key=lambda r: (r["speedup"], -r["k"])) if table else None


def choice(report: dict, records: list[dict], block: bool, draft_pass: float | None = None) -> dict | None:
    """report.json's `k_choice`: the table of an eval's report and records, the best K and whether drafting pays
    there (None without a measured speedup); draft_pass: one draft pass in plain steps, when the engine timed it."""
    table = k_table(report.get("acceptance_per_position") or [], report.get("acceptance_length"),
                    report.get("speedup"), ((r["num_drafts"], r["accepted_per_pos"]) for r in records), block,
                    draft_pass)
    top = best(table)
    if top is None:
        return None
    rule = ("C(k) = C(K) - (K - k) d, d one draft pass as timed" if draft_pass is not None else
            "C(k) = 1 + k (C(K) - 1) / K, linear from plain decoding (optimistic where the step does not scale)")
    return {"measured_k": len(report["acceptance_per_position"]), "table": table, "best_k": top["k"],
            "best_speedup": top["speedup"], "pays": top["speedup"] > 1.0, "block": block, "draft_pass": draft_pass,
            "rule": f"{rule}; C(K) = tau / speedup in plain steps; draftsmith/speedup.py"}


def chosen(reports: list[dict]) -> dict | None:
    """The K to serve at, from a run's eval reports (each with its `folder`, oldest first): those of the vLLM engine
    (what users serve with), else the local engine's. A K measured by one of them counts at its measured speedup
    (the newest measurement); any other K up to the largest measured is predicted by the rule with C(k) linear
    between the measured costs of its neighbours (a confirmation at a smaller K refines the costs around it), from
    the per-position acceptance of the report at the largest K. A k_choice-shaped dict (best_k, best_speedup,
    pays, block, measured_k = best_k when it was measured, else the K it was predicted from) with the engine,
    machine and folder of the report it comes from; None when no report has a table."""
    for engine in ("vllm", "local"):
        mine = [r for r in reports if r.get("engine") == engine and isinstance(r.get("k_choice"), dict)]
        if not mine:
            continue
        measured = {r["k_choice"]["measured_k"]: r for r in mine}  # k -> its newest report
        widest = measured[max(measured)]
        if widest["k_choice"]["block"]:
            r, row = widest, widest["k_choice"]["table"][-1]
            return {**_pick(row["k"], row["speedup"], r, True), "block": True}
        costs = {k: step_cost(r["acceptance_length"], r["speedup"]) for k, r in measured.items()}
        rows = _table(widest["acceptance_per_position"], costs, [], range(1, max(measured) + 1),
                      widest["k_choice"].get("draft_pass"))
        options = [(measured[row["k"]]["speedup"], row["k"], True) if row["k"] in measured else
                   (row["speedup"], row["k"], False) for row in rows]
        speed, k, was_measured = max(options, key=lambda o: (o[0], -o[1]))
        return {**_pick(k, speed, measured.get(k, widest), was_measured), "block": False}
    return None


def _pick(k: int, speed: float, report: dict, was_measured: bool) -> dict:
    return {"best_k": k, "best_speedup": speed, "pays": speed > 1.0,
            "measured_k": k if was_measured else report["k_choice"]["measured_k"], "engine": report.get("engine"),
            "machine": report.get("machine"), "folder": report.get("folder")}


def summary(k_choice: dict | None) -> str:
    """One line: the best K and its predicted speedup, or why there is none."""
    if not k_choice:
        return "no K chosen (no plain-decoding baseline measured)"
    k, s, K = k_choice["best_k"], k_choice["best_speedup"], k_choice["measured_k"]
    if k_choice["block"]:
        return f"K = {K} (a block drafter is served at its block only): {s:.2f}x measured"
    where = "measured" if k == K else f"predicted from the K = {K} eval"
    verdict = "" if k_choice["pays"] else "; drafting does not pay here at any K, plain decoding is faster"
    return f"best K = {k}: {s:.2f}x plain decoding ({where}){verdict}"
