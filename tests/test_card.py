"""The model card the Hub reads: what it counts as trained, the front matter the Hub knows, and every acceptance
length with its standard error.

Most cases on a hand-made run folder (the records card.py reads: export/config.json, the train and prepare
manifests, eval/report.json); the trained-token count of the train stage on hand-made prepared samples; and the
session's tiny pipeline (tests/tiny_pipeline.py) for the count a real train stage records and the line export says
when the target has no Hub id."""

import json
import shutil
import subprocess

import numpy as np
import pytest

from conftest import TINY_RUN_SETS
from draftsmith import DraftsmithError
from draftsmith.card import front_matter, write_card
from draftsmith.config import load_config
from draftsmith.rundir import RunDir, atomic_write_json
from draftsmith.speedup import choice
from draftsmith.train.data import PreparedSource
from draftsmith.train.stage import trained_tokens

SERVE = {"method": "eagle3", "num_speculative_tokens": 3}
VALIDATION = {"step": 60, "acceptance_length": 1.404, "acceptance_per_position": [0.3, 0.08, 0.02], "samples": 6}
REPORT = {"engine": "local", "num_speculative_tokens": 3, "temperature": 0.0, "prompts": 16,
          "prompts_source": "mt-bench", "acceptance_length": 1.374, "acceptance_per_position": [0.3, 0.06, 0.01],
          "speedup": 0.67, "machine": "AMD EPYC, 2 cores"}
TRAIN_COUNTS = {"done": 60, "tokens": 9000, "samples": 120, "train_minutes": 1.5,
                "trained_samples": 34, "held_out": 6, "trained_tokens": 1234}


def hand_made_run(tmp_path, target_id="target", validation=VALIDATION, report=REPORT, train_counts=TRAIN_COUNTS,
                  loss_on="assistant") -> RunDir:
    """A run folder holding only what the card reads: a target published as `target_id`, 40 prepared samples with
    2,000 answer tokens, a train stage with `train_counts`, an export with `validation` and an eval `report`."""
    run = RunDir(tmp_path / "run")
    (run.path / "export").mkdir(parents=True)
    atomic_write_json(run.path / "export" / "config.json", {
        "speculators_model_type": "eagle3", "eagle_aux_hidden_state_layer_ids": [2, 4, 5], "draft_vocab_size": 64,
        "transformer_layer_config": {"vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 1},
        "draftsmith": {"kind": "eagle3", "target_id": target_id, "step": 60, "ttt_steps": 3,
                       "validation": validation}})
    for stage, counts in (("prepare", {"samples": 40, "tokens": 5000, "masked_tokens": 2000}),
                          ("train", train_counts)):
        (run.path / stage).mkdir()
        atomic_write_json(run.manifest_path(stage), {"stage": stage, "counts": counts})
    (run.path / "train" / "config.yaml").write_text(f"train:\n  mode: offline\n  loss_on: {loss_on}\n")
    if report is not None:
        (run.path / "eval").mkdir()
        atomic_write_json(run.path / "eval" / "report.json", report)
    return run


def card_of(run: RunDir, base_model_id: str | None = None) -> str:
    assert write_card(run, run.path / "export", SERVE, "acme/drafter", base_model_id=base_model_id) is None
    return (run.path / "export" / "README.md").read_text()


# -------------------------------------------------------------------------------------------------
# Trained tokens


def test_the_card_counts_as_trained_what_training_read_not_every_answer(tmp_path):
    card = card_of(hand_made_run(tmp_path))
    assert "on 34 samples (6 held out for validation) and their 1,234 tokens trained (the loss on the answers' " \
           "tokens)" in card
    assert "(2,000 in the answers)" in card and "2,000 trained" not in card
    # with train.loss_on all the same count says so
    card = card_of(hand_made_run(tmp_path / "all", loss_on="all"))
    assert "1,234 tokens trained (the loss on every token)" in card
    # a run stopped inside its first pass says how few samples its steps read
    card = card_of(hand_made_run(tmp_path / "part", train_counts={**TRAIN_COUNTS, "samples": 20}))
    assert "1,234 tokens trained (the loss on the answers' tokens; the steps read 20 samples, less than one pass)" \
        in card


def test_a_run_from_before_the_count_calls_no_token_trained(tmp_path):
    old = {k: v for k, v in TRAIN_COUNTS.items() if k not in ("trained_samples", "held_out", "trained_tokens")}
    card = card_of(hand_made_run(tmp_path, train_counts=old))
    assert "trained" not in card.split("| training data |")[1].split("\n")[0]
    assert "tokens trained" not in card and "9,000 tokens read by the steps" in card


def write_prepared(run: RunDir, masks: list[list[int]]) -> None:
    (run.path / "prepare").mkdir(parents=True)
    with open(run.path / "prepare" / "samples.jsonl", "w") as f:
        for i, m in enumerate(masks):
            f.write(json.dumps({"id": f"p{i}", "input_ids": list(range(len(m))), "loss_mask": m,
                                "truncated": False}) + "\n")
    atomic_write_json(run.manifest_path("prepare"), {"stage": "prepare", "counts": {"samples": len(masks)}})


@pytest.mark.parametrize("source", ["offline", "online"])
def test_the_trained_tokens_leave_out_held_out_samples_and_follow_loss_on(tmp_path, source):
    """Three samples, the second held out (packing length 0): its answer tokens are not trained. Offline the masks
    are prepare/samples.jsonl's, online the source's own; each sample is cut to a row, loss_skip_tokens first."""
    run = RunDir(tmp_path / "run")
    masks = [[0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1, 1]]
    write_prepared(run, masks)
    if source == "offline":
        src = object()  # not a PreparedSource: the masks come from prepare/samples.jsonl
    else:
        src = PreparedSource.__new__(PreparedSource)
        src.masks = [np.asarray(m, dtype=bool) for m in masks]
    lengths = [5, 0, 8]
    assert trained_tokens(run, src, lengths, 64, "assistant", 0) == 3 + 5
    assert trained_tokens(run, src, lengths, 64, "all", 0) == 5 + 8
    assert trained_tokens(run, src, lengths, 6, "assistant", 0) == 3 + 3  # the third cut to a row of 6
    assert trained_tokens(run, src, lengths, 64, "assistant", 3) == 2 + 5
    assert trained_tokens(run, src, lengths, 64, "all", 3) == 2 + 5
    # masks of other samples than training read (a count that does not match): no count rather than a wrong one
    assert trained_tokens(run, src, [5, 0, 8, 4], 64, "assistant", 0) is None


# -------------------------------------------------------------------------------------------------
# The front matter


def test_the_front_matter_has_no_library_name_the_hub_does_not_know(tmp_path):
    meta = front_matter(card_of(hand_made_run(tmp_path, target_id="HuggingFaceTB/SmolLM2-135M-Instruct")))
    assert "library_name" not in meta
    assert {"speculative-decoding", "eagle3", "speculators", "vllm"} <= set(meta["tags"])
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.mark.parametrize("target_id", ["target", "model-q4.gguf", "smollm2-135m"])
def test_a_target_with_no_hub_id_leaves_base_model_out_unless_export_base_model_names_it(tmp_path, target_id):
    run = hand_made_run(tmp_path, target_id=target_id)
    assert "base_model" not in front_matter(card_of(run))
    assert front_matter(card_of(run, base_model_id="acme/base-7b"))["base_model"] == "acme/base-7b"


@pytest.mark.parametrize("value", ["/models/llama", "llama", "acme/../x", "acme--x/y", "acme/x/y", "-acme/x",
                                   "ächme/x"])
def test_an_export_base_model_that_is_not_a_hub_id_is_refused_in_one_line(value):
    with pytest.raises(DraftsmithError) as e:
        load_config(None, [f"export.base_model={value}"])
    assert "export.base_model: a Hub model id, org/name" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, ["export.base_model=HuggingFaceTB/SmolLM2-135M-Instruct"]).export.base_model \
        == "HuggingFaceTB/SmolLM2-135M-Instruct"


# -------------------------------------------------------------------------------------------------
# A card is data, not a script


HOSTILE = ["x'; touch PWNED; echo '", "$(touch PWNED)", "`touch PWNED`", "a\n```\n# Injected\n<script>x</script>",
           "  ---\nlibrary_name: evil\n---", "a|b`c``d", "name with spaces\r\u2028end"]


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_target_name_cannot_run_a_command_or_change_the_card(tmp_path, name):
    """The name the export records for its target (a folder's own name, a hand-edited config.json) reaches the
    card's title, text and serve line: pasted, the serve line runs nothing and hands vllm the name as one argument;
    the front matter, headings and code fences stay the card's own."""
    card = card_of(hand_made_run(tmp_path, target_id=name, report={**REPORT, "machine": name}))
    assert front_matter(card) == {"pipeline_tag": "text-generation",
                                  "tags": ["speculative-decoding", "eagle3", "draftsmith", "speculators", "vllm"]}
    assert [x for x in card.splitlines() if x.startswith("#")] == [
        card.splitlines()[card.splitlines().index("---", 1) + 2], "## Measured acceptance and speed", "## Serve it",
        "## Upload it"]
    assert [x for x in card.splitlines() if x.lstrip().startswith("```")] == ["```bash", "```"] * 2
    serve = card.split("```bash\n")[1].split("\n```")[0]
    assert "\n" not in serve
    # pasted into a shell where `vllm` only prints its arguments: one argument per name, nothing else run
    out = subprocess.run(["bash", "-c", 'vllm() { printf "%s\\0" "$@"; }; ' + serve], cwd=tmp_path,
                         capture_output=True, text=True)
    args = out.stdout.split("\0")[:-1]
    assert out.returncode == 0 and args[0] == "serve" and args[2] == "--speculative-config", out
    assert args[1] == name.replace("\n", "?").replace("\r", "?").replace("\u2028", "?")
    assert json.loads(args[3]) == {**SERVE, "model": "acme/drafter"} and len(args) == 4
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("key,value", [("export.repo_id", "acme/x'; rm -rf ~; echo '"), ("export.repo_id", "/models/x"),
                                       ("export.repo_id", "acme/x\n# h"), ("target_id", "$(touch x)"),
                                       ("target_id", "a/b/c"), ("target_id", "x\n---")])
def test_a_repo_id_or_target_id_that_is_not_a_name_is_refused_in_one_line(key, value):
    with pytest.raises(DraftsmithError) as e:
        load_config(None, [f"{key}={json.dumps(value)}"])
    assert f"{key}: a Hub model id, org/name" in str(e.value) and "\n" not in str(e.value)
    assert load_config(None, [f"{key}=acme/Drafter-1.5_b"]).model_dump()[key.split(".")[0]] is not None


def test_the_front_matter_reader_ends_at_a_line_that_is_exactly_three_dashes():
    assert front_matter("---\na: '  ---'\nb: |\n  x\n  ---\n---\n# t\n---\n") == {"a": "  ---", "b": "x\n---"}
    for bad in ("# no front matter\n", "---\na: 1\n", "---\n[1, 2]\n---\n", "---\na: [\n---\n"):
        with pytest.raises(ValueError):
            front_matter(bad)


# -------------------------------------------------------------------------------------------------
# Errors


def test_every_acceptance_length_with_a_standard_error_shows_it_and_says_what_it_is(tmp_path):
    run = hand_made_run(tmp_path, validation={**VALIDATION, "acceptance_length_se": 0.052},
                        report={**REPORT, "acceptance_length_se": 0.045})
    card = card_of(run)
    assert "acceptance length 1.404 ± 0.052, per position" in card
    assert "| local | 3 | 0.0 | 16 of `mt-bench` | 1.374 ± 0.045 |" in card
    assert card.count("± is one standard error") == 1
    front_matter(card)


def test_figures_without_a_standard_error_stay_plain(tmp_path):
    run = hand_made_run(tmp_path, report={**REPORT, "acceptance_length_se": None})
    card = card_of(run)
    assert "acceptance length 1.404, per position" in card and "| 1.374 |" in card
    assert "±" not in card


# -------------------------------------------------------------------------------------------------
# The K it serves at


def test_the_card_serves_at_the_k_found_fastest_preferring_the_vllm_report(tmp_path):
    local = {**REPORT, "k_choice": choice(REPORT, [], block=False)}
    assert local["k_choice"]["best_k"] == 1  # 0.3 of first drafts at 0.67x for three: one draft is cheaper
    run = hand_made_run(tmp_path, report=local)
    vllm_report = {**REPORT, "engine": "vllm", "speedup": 1.4, "acceptance_per_position": [0.6, 0.5, 0.05],
                   "acceptance_length": 2.15}
    vllm_report["k_choice"] = choice(vllm_report, [], block=False)
    assert vllm_report["k_choice"]["best_k"] == 2
    card = card_of(run)
    assert '"num_speculative_tokens": 1' in card and "At K = 1 draft tokens" in card and "local engine" in card
    (run.path / "eval-vllm").mkdir()
    atomic_write_json(run.path / "eval-vllm" / "report.json", vllm_report)
    card = card_of(run)
    assert '"num_speculative_tokens": 2' in card and "vllm engine" in card and "`eval-vllm/report.md`" in card
    front_matter(card)


def test_without_a_k_choice_the_card_serves_at_the_k_it_was_given(tmp_path):
    card = card_of(hand_made_run(tmp_path))
    assert '"num_speculative_tokens": 3' in card and "At K =" not in card


# -------------------------------------------------------------------------------------------------
# A real train stage and export (the session's tiny pipeline: its target is a local folder)


def test_train_records_the_tokens_it_trained_and_the_card_prints_them(tiny_run):
    run, *_ = tiny_run
    prepared = run.read_manifest("prepare")["counts"]
    c = run.read_manifest("train")["counts"]
    assert c["held_out"] == 6 and c["trained_samples"] + c["held_out"] == prepared["samples"]
    # the held-out samples' answers are not counted (and train.seq_len cuts the longest ones)
    assert 0 < c["trained_tokens"] < prepared["masked_tokens"]
    card = (run.path / "export" / "README.md").read_text()
    assert f"their {c['trained_tokens']:,} tokens trained (the loss on the answers' tokens)" in card


def test_export_says_in_one_line_that_a_local_target_has_no_base_model(tiny_run, tmp_path, capsys):
    from draftsmith.export import run_export

    run, config, *_ = tiny_run
    copy = RunDir(tmp_path / "run")
    shutil.copytree(run.path, copy.path, ignore=shutil.ignore_patterns(".locks"))
    capsys.readouterr()
    run_export(copy, load_config(config, TINY_RUN_SETS))
    notes = [x for x in capsys.readouterr().out.splitlines() if "base_model" in x]
    assert len(notes) == 1 and "'target' is not a Hub id" in notes[0] and "export.base_model" in notes[0]
    assert "base_model" not in front_matter((copy.path / "export" / "README.md").read_text())
    run_export(copy, load_config(config, [*TINY_RUN_SETS, "export.base_model=acme/tiny-base"]))
    assert not [x for x in capsys.readouterr().out.splitlines() if "base_model" in x]
    assert front_matter((copy.path / "export" / "README.md").read_text())["base_model"] == "acme/tiny-base"
