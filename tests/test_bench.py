"""The pure helpers the quality benches decide with: bench_levers' row syntax and the paired bootstrap
over prompts that bench_levers and bench_store_quality print as a difference's 95% interval."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import bench_levers  # noqa: E402  (bench/ is scripts, not a package)
from bench_store_quality import paired_bootstrap  # noqa: E402


def test_lever_rows_parse_and_bad_ones_stop_in_one_line():
    assert bench_levers.parse_row("base=") == ("base", [])
    assert bench_levers.parse_row("a2wt=train.lr_schedule=wsd  train.loss_tv=0.5") == (
        "a2wt", ["train.lr_schedule=wsd", "train.loss_tv=0.5"])
    for bad in ("=train.gamma=1", "a/b=train.gamma=1"):
        with pytest.raises(SystemExit, match=r"--row .*expected NAME="):
            bench_levers.parse_row(bad)


def test_each_comparison_writes_its_own_report(tmp_path):
    """A --report-only on two rows must not replace the report of all rows: the file is named by the
    rows in order and K, so only the same comparison is written again."""
    full = bench_levers.report_path(tmp_path, ["base", "tv", "rkl", "g13"], 3)
    assert full.parent == tmp_path
    pair = bench_levers.report_path(tmp_path, ["tv", "rkl"], 3)
    assert len({full, pair, bench_levers.report_path(tmp_path, ["tv", "rkl"], 5),
                bench_levers.report_path(tmp_path, ["rkl", "tv"], 3)}) == 4
    assert pair == bench_levers.report_path(tmp_path, ["tv", "rkl"], 3)


def test_paired_bootstrap_interval_follows_the_prompts():
    """Per seed {prompt: (drafts, accepted)}: equal runs give a zero interval; a run accepting more on
    some prompts gives an interval above zero that holds the pooled difference; one accepting less, below."""
    a = [{f"p{i}": (10, 3 + i % 3) for i in range(40)}, {f"p{i}": (10, 2 + i % 4) for i in range(40)}]
    assert paired_bootstrap(a, a) == (0.0, 0.0)
    # one more accepted token per 10 drafts on the even prompts: +0.05 pooled, above zero on any resample
    # that holds an even prompt
    b = [{k: (d, acc + (int(k[1:]) % 2 == 0)) for k, (d, acc) in seed.items()} for seed in a]
    lo, hi = paired_bootstrap(a, b)
    assert 0 < lo < 0.05 < hi <= 0.1
    worse = [{k: (d, max(acc - 2, 0)) for k, (d, acc) in seed.items()} for seed in a]
    lo, hi = paired_bootstrap(a, worse)
    assert hi < 0
    # only prompts every run holds are resampled
    assert paired_bootstrap(a, [dict(list(s.items())[:5]) for s in a]) == (0.0, 0.0)
