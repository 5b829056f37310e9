"""The prepare stage: chat-template rendering, loss masks, length policy, resume; and the CLI on
SmolLM2 (prepare + vocab) as an integration test."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from conftest import build_tiny_target, run_cli
from draftsmith import DraftsmithError
from draftsmith.config import load_config
from draftsmith.prepare import ChatEncoder, TemplateProblem, run_prepare
from draftsmith.rundir import RunDir, repair_jsonl_tail
from draftsmith.target import load_tokenizer, target_info

# A Qwen3-like template: reasoning_content rendered as a <think> block, but only for assistant
# turns after the last user message (earlier turns lose it, as Qwen3's own template does).
THINK_TEMPLATE = (
    "{%- set ns = namespace(last_query=0) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\n' }}"
    "{%- if message.reasoning_content and loop.index0 > ns.last_query %}"
    "{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}"
    "{%- endif %}"
    "{{- message.content.lstrip('\n') + '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

# A template that changes what the assistant wrote: no mask can be trusted.
UPPER_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n'}}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] | upper }}{% else %}{{ message['content'] }}{% endif %}"
    "{{'<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# No newline after the role: "assistant" + "ance" is one pre-token that BPE merges across the join.
JOINED_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + message['content'] + '<|im_end|>\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant' }}{% endif %}"
)


def make_run(path: Path, target: str | Path, records: list[dict], target_fingerprint: str | None = None) -> RunDir:
    """A run whose generate stage completed with `records` (generate/samples.jsonl + manifest)."""
    run = RunDir(path).ensure()
    d = run.stage_dir("generate")
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    fp = target_fingerprint or target_info(str(target)).fingerprint
    run.write_manifest("generate", fingerprint=f"gen-{len(records)}", inputs={"target_fingerprint": fp},
                       settings={"target": str(target)}, counts={"done": len(records), "total": len(records), "unit": "samples"},
                       started=time.time())
    return run


def conv(i: int, answer: str = "The quick brown fox jumps over the lazy dog.", **extra) -> dict:
    return {"id": f"s{i}", "messages": [{"role": "user", "content": f"Hello! Question number {i}?"},
                                        {"role": "assistant", "content": answer}],
            "finish_reasons": ["stop"], **extra}


def cfg_for(target, *sets: str):
    return load_config(None, [f"target={target}", *sets])


def read_prepared(run: RunDir) -> list[dict]:
    return [json.loads(line) for line in (run.path / "prepare" / "samples.jsonl").read_text().splitlines()]


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The contiguous runs of masked token ids."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


def encoder_for(target: Path) -> tuple[ChatEncoder, object]:
    info = target_info(str(target))
    tok = load_tokenizer(info)
    return ChatEncoder.for_target(tok, info), tok


@pytest.fixture(scope="module")
def think_target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("think-target"), chat_template=THINK_TEMPLATE)


# -------------------------------------------------------------------------------------------------
# Masks


def test_mask_is_assistant_content_plus_end_token(tiny_target):
    enc, tok = encoder_for(tiny_target)
    msgs = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Write a short poem about the sea."},
            {"role": "assistant", "content": "The sea and the sky, numbers and letters."}]
    out = enc.encode(msgs)
    # Same tokens as the template's own tokenization (what the target sees).
    assert out.input_ids == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    runs = masked_runs(out.input_ids, out.loss_mask)
    assert len(runs) == 1
    assert tok.decode(runs[0]) == "The sea and the sky, numbers and letters.<|im_end|>"
    # The header right before it is not trained on; the newline after <|im_end|> neither.
    first = out.loss_mask.index(1)
    assert tok.decode(out.input_ids[:first]).endswith("<|im_start|>assistant\n")
    assert out.loss_mask[-1] == 0 and tok.decode(out.input_ids[-1:]) == "\n"


def test_multi_turn_masks_every_assistant_turn_only(tiny_target):
    enc, tok = encoder_for(tiny_target)
    msgs = [{"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! How can I help you today?"},
            {"role": "user", "content": "def add(a, b):"},
            {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}]
    out = enc.encode(msgs)
    assert out.assistant_turns == 2
    runs = [tok.decode(r) for r in masked_runs(out.input_ids, out.loss_mask)]
    # The second answer is found as written, although the user turn before it holds the same text.
    assert runs == ["Hello! How can I help you today?<|im_end|>", "def add(a, b):\n    return a + b\n<|im_end|>"]
    unmasked = tok.decode([t for t, m in zip(out.input_ids, out.loss_mask) if not m])
    assert "<|im_start|>user\ndef add(a, b):<|im_end|>" in unmasked


def test_unfinished_turn_does_not_train_the_end_token(tiny_target):
    enc, tok = encoder_for(tiny_target)
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "The quick brown"}]
    out = enc.encode(msgs, finish_reasons=["length"])
    assert [tok.decode(r) for r in masked_runs(out.input_ids, out.loss_mask)] == ["The quick brown"]


def test_token_straddling_the_turn_start_is_retokenized(tmp_path):
    enc, tok = encoder_for(build_tiny_target(tmp_path / "joined", chat_template=JOINED_TEMPLATE))
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "ance and the sky."}]
    whole = list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    out = enc.encode(msgs)
    assert out.notes == {"boundary_retokenized": 1}
    assert out.input_ids != whole  # the whole-text tokens merge "t" + "an" across the join
    assert tok.decode(out.input_ids) == tok.decode(whole)  # ... but spell the same text
    runs = masked_runs(out.input_ids, out.loss_mask)
    assert [tok.decode(r) for r in runs] == ["ance and the sky.<|im_end|>"]
    first = out.loss_mask.index(1)
    # The prompt part is exactly what the target was fed before answering.
    prompt = tok.apply_chat_template(msgs[:1], tokenize=True, add_generation_prompt=True)["input_ids"]
    assert out.input_ids[:first] == list(prompt)


def test_reasoning_through_a_think_template(think_target):
    enc, tok = encoder_for(think_target)
    assert enc.reasoning_key == "reasoning_content"
    msgs = [{"role": "user", "content": "Write a poem"},
            {"role": "assistant", "content": "The sea and the sky.", "reasoning": "A poem about the sea."}]
    out = enc.encode(msgs)
    runs = [tok.decode(r) for r in masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["<think>\nA poem about the sea.\n</think>\n\nThe sea and the sky.<|im_end|>"]
    assert out.notes == {"reasoning_turns": 1, "reasoning_kept": 1}


def test_think_template_drops_earlier_reasoning_counted(think_target):
    enc, tok = encoder_for(think_target)
    msgs = [{"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! How can I help?", "reasoning": "Greet back politely."},
            {"role": "user", "content": "Write a poem"},
            {"role": "assistant", "content": "The sea and the sky.", "reasoning": "A poem about the sea."}]
    out = enc.encode(msgs)
    runs = [tok.decode(r) for r in masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["Hello! How can I help?<|im_end|>",
                    "<think>\nA poem about the sea.\n</think>\n\nThe sea and the sky.<|im_end|>"]
    assert out.notes == {"reasoning_dropped_by_template": 1, "reasoning_turns": 2, "reasoning_kept": 1}


def test_reasoning_without_template_support_is_written_as_think_block(tiny_target):
    enc, tok = encoder_for(tiny_target)
    assert enc.reasoning_key is None
    msgs = [{"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! How can I help?", "reasoning": "Greet back."}]
    out = enc.encode(msgs)
    runs = [tok.decode(r) for r in masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["<think>\nGreet back.\n</think>\n\nHello! How can I help?<|im_end|>"]


def test_template_that_rewrites_content_is_an_error(tmp_path):
    target = build_tiny_target(tmp_path / "upper", chat_template=UPPER_TEMPLATE)
    enc, _ = encoder_for(target)
    with pytest.raises(TemplateProblem, match="drops or rewrites the content of assistant message 2"):
        enc.encode([{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "the quick fox"}])
    run = make_run(tmp_path / "run", target, [conv(0)])
    with pytest.raises(DraftsmithError, match=r"generate/samples.jsonl:1: sample 's0': the chat template of upper"):
        run_prepare(run, cfg_for(target))
    assert run.read_manifest("prepare") is None


def test_target_without_chat_template_is_an_error(tmp_path):
    target = build_tiny_target(tmp_path / "notemplate", chat_template=None)
    run = make_run(tmp_path / "run", target, [conv(0)])
    with pytest.raises(DraftsmithError, match="target notemplate: its tokenizer has no chat template"):
        run_prepare(run, cfg_for(target))
    p = run_cli("prepare", "--run", str(run.path), "--set", f"target={target}")
    assert p.returncode == 2
    assert p.stderr.strip().count("\n") == 0 and "no chat template" in p.stderr
    assert "Traceback" not in p.stderr


# -------------------------------------------------------------------------------------------------
# The stage


def test_stage_output_and_manifest(tiny_target, tmp_path):
    records = [conv(i) for i in range(4)]
    records.append({"id": "no-answer", "messages": [{"role": "user", "content": "Hello!"}]})
    run = make_run(tmp_path / "run", tiny_target, records)
    m = run_prepare(run, cfg_for(tiny_target))
    lines = read_prepared(run)
    assert [r["id"] for r in lines] == ["s0", "s1", "s2", "s3"]  # generate's order; no assistant tokens -> dropped
    assert all(set(r) == {"id", "input_ids", "loss_mask", "truncated"} for r in lines)
    c = m["counts"]
    assert c["done"] == c["samples"] == 4 and c["input_samples"] == 5 and c["dropped_empty_mask"] == 1
    assert c["tokens"] == sum(len(r["input_ids"]) for r in lines)
    assert c["masked_tokens"] == sum(sum(r["loss_mask"]) for r in lines)
    assert (run.path / "prepare" / "config.yaml").is_file()
    assert m["inputs"]["target_fingerprint"] == target_info(str(tiny_target)).fingerprint
    # Journal: total shrank by the dropped sample, so it matches the lines on disk.
    events = [json.loads(x) for x in (run.path / "prepare" / "progress.jsonl").read_text().splitlines()]
    assert events[-1]["ev"] == "end" and events[-1]["done"] == 4 and events[-1]["total"] == 4
    # A second run with the same inputs does nothing.
    again = run_prepare(run, cfg_for(tiny_target))
    assert again["finished"] == m["finished"]


def test_truncate_and_drop_are_counted(tiny_target, tmp_path):
    long = "The quick brown fox jumps over the lazy dog. " * 6
    records = [conv(0, "Hello!"), conv(1, long), conv(2, long)]
    # A prompt so long that truncation leaves no assistant token: dropped, not kept empty.
    records.append({"id": "long-prompt", "messages": [{"role": "user", "content": long},
                                                       {"role": "assistant", "content": "Hello!"}]})
    n_short = len(encoder_for(tiny_target)[0].encode(records[0]["messages"]).input_ids)
    max_len = n_short + 5
    run = make_run(tmp_path / "trunc", tiny_target, records)
    c = run_prepare(run, cfg_for(tiny_target, f"prepare.max_length={max_len}"))["counts"]
    lines = read_prepared(run)
    assert [r["id"] for r in lines] == ["s0", "s1", "s2"]
    assert [r["truncated"] for r in lines] == [False, True, True]
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) == max_len for r in lines[1:])
    assert (c["truncated"], c["dropped_too_long"], c["dropped_empty_mask"]) == (2, 0, 1)

    run = make_run(tmp_path / "drop", tiny_target, records)
    c = run_prepare(run, cfg_for(tiny_target, f"prepare.max_length={max_len}", "prepare.overflow=drop"))["counts"]
    assert [r["id"] for r in read_prepared(run)] == ["s0"]
    assert (c["truncated"], c["dropped_too_long"], c["dropped"]) == (0, 3, 3)


def test_resume_after_a_torn_line(tiny_target, tmp_path):
    records = [conv(i, "The quick brown fox jumps over the lazy dog." * (1 + i % 3)) for i in range(6)]
    run = make_run(tmp_path / "run", tiny_target, records)
    cfg = cfg_for(tiny_target)
    full = run_prepare(run, cfg)
    path = run.path / "prepare" / "samples.jsonl"
    reference = path.read_bytes()
    # Simulate a kill in the middle of writing the fourth line: three whole lines, half of one.
    lines = reference.splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:3]) + lines[3][: len(lines[3]) // 2])
    run.invalidate("prepare")
    resumed = run_prepare(run, cfg)
    assert path.read_bytes() == reference
    start = json.loads((run.path / "prepare" / "progress.jsonl").read_text().splitlines()[0])
    assert start["done"] == 3  # the three whole lines were kept, not redone
    assert resumed["counts"] == full["counts"]


def test_partial_output_from_other_settings_is_not_reused(tiny_target, tmp_path):
    records = [conv(i, "The quick brown fox jumps over the lazy dog. " * 3) for i in range(3)]
    run = make_run(tmp_path / "run", tiny_target, records)
    run_prepare(run, cfg_for(tiny_target))
    path = run.path / "prepare" / "samples.jsonl"
    path.write_bytes(path.read_bytes().splitlines(keepends=True)[0])  # a crash after one sample
    run.invalidate("prepare")
    prompt = encoder_for(tiny_target)[0].encode(records[0]["messages"][:1]).input_ids
    max_len = len(prompt) + 8
    m = run_prepare(run, cfg_for(tiny_target, f"prepare.max_length={max_len}"))
    lines = read_prepared(run)
    assert len(lines) == 3 and all(len(r["input_ids"]) == max_len and r["truncated"] for r in lines)
    assert m["counts"]["truncated"] == 3


def test_repair_jsonl_tail(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_bytes(b'{"a": 1}\n{"a": 2}\n{"a"')
    assert repair_jsonl_tail(p) == 4
    assert p.read_bytes() == b'{"a": 1}\n{"a": 2}\n'
    assert repair_jsonl_tail(p) == 0
    p.write_bytes(b'{"a"')
    repair_jsonl_tail(p)
    assert p.read_bytes() == b""


def test_refuses_generate_from_another_target_or_unfinished(tiny_target, tmp_path):
    run = make_run(tmp_path / "run", tiny_target, [conv(0)], target_fingerprint="0123456789abcdef")
    with pytest.raises(DraftsmithError, match=r"generate/manifest.json: built for another target"):
        run_prepare(run, cfg_for(tiny_target))
    # The shape generate writes: inputs.target = {name, fingerprint}.
    run.write_manifest("generate", fingerprint="g", inputs={"target": {"name": "x", "fingerprint": "fedcba9876543210"}},
                       settings={}, counts={"done": 1, "total": 1, "unit": "samples"}, started=time.time())
    with pytest.raises(DraftsmithError, match=r"fingerprint fedcba9876543210"):
        run_prepare(run, cfg_for(tiny_target))
    run.invalidate("generate")
    with pytest.raises(DraftsmithError, match="stage 'generate' has not completed"):
        run_prepare(run, cfg_for(tiny_target))


def test_bad_generate_record_names_the_line(tiny_target, tmp_path):
    run = make_run(tmp_path / "run", tiny_target, [conv(0), {"id": "x", "messages": [{"role": "bot", "content": "hi"}]}])
    with pytest.raises(DraftsmithError, match=r"samples.jsonl:2: message 1: role must be one of"):
        run_prepare(run, cfg_for(tiny_target))


# -------------------------------------------------------------------------------------------------
# The real target, through the CLI


@pytest.mark.integration
def test_cli_prepare_and_vocab_on_smollm2(smol_target, tmp_path):
    from safetensors.numpy import load_file

    records = [
        conv(0, "The capital of France is Paris."),
        {"id": "multi", "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "2 + 2 = 4."},
            {"role": "user", "content": "And times 3?"},
            {"role": "assistant", "content": "4 times 3 is 12.", "reasoning": "Multiply the previous answer by 3."}],
         "finish_reasons": ["stop", "stop"]},
        conv(2, "Here is a function:\n\n```python\ndef add(a, b):\n    return a + b\n```"),
        # Leading spaces: SmolLM2's BPE merges the first with the header's newline into one token.
        conv(3, "  Sure, here it is."),
    ]
    run = make_run(tmp_path / "run", smol_target, records)
    p = run_cli("prepare", "--run", str(run.path), "--max-length", "512", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "prepared 4 samples" in p.stdout
    counts = json.loads((run.path / "prepare" / "manifest.json").read_text())["counts"]
    assert counts["boundary_retokenized"] == 1
    p = run_cli("vocab", "--run", str(run.path), "--draft-vocab-size", "64", timeout=120)
    assert p.returncode == 0, p.stderr
    assert "draft vocab 64 of 49152 covers" in p.stdout

    tok = load_tokenizer(target_info(smol_target))
    by_id = {r["id"]: r for r in read_prepared(run)}
    runs = [tok.decode(r) for r in masked_runs(by_id["multi"]["input_ids"], by_id["multi"]["loss_mask"])]
    assert runs == ["2 + 2 = 4.<|im_end|>",
                    "<think>\nMultiply the previous answer by 3.\n</think>\n\n4 times 3 is 12.<|im_end|>"]
    # SmolLM2's template adds its default system prompt when none is given; it is not trained on.
    text = tok.decode(by_id["s0"]["input_ids"])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert [tok.decode(r) for r in masked_runs(by_id["s0"]["input_ids"], by_id["s0"]["loss_mask"])] == [
        "The capital of France is Paris.<|im_end|>"]
    assert [tok.decode(r) for r in masked_runs(by_id["s3"]["input_ids"], by_id["s3"]["loss_mask"])] == [
        "  Sure, here it is.<|im_end|>"]

    info = json.loads((run.path / "vocab" / "vocab.json").read_text())
    t = load_file(str(run.path / "vocab" / "vocab.safetensors"))
    assert t["t2d"].shape == (49152,) and t["d2t"].shape == (64,)
    masked = sum(sum(r["loss_mask"]) for r in by_id.values())
    assert info["tokens_counted"] == masked == int(t["counts"].sum())
    assert 0 < info["coverage"] <= 1 and info["coverage"] == json.loads(
        (run.path / "vocab" / "manifest.json").read_text())["counts"]["coverage"]
    # --help carries examples.
    p = run_cli("prepare", "--help")
    assert p.returncode == 0 and "draftsmith prepare --run runs/r1" in p.stdout
    p = run_cli("vocab", "--help")
    assert p.returncode == 0 and "--draft-vocab-size 32000" in p.stdout


def test_a_full_disk_names_the_file_and_tears_no_line(tiny_target, tmp_path, monkeypatch):
    """The disk fills while prepare appends: one line naming prepare/samples.jsonl, the file holds
    whole lines only (the first of an uninterrupted run), and the rerun ends with that run's file."""
    import errno

    import draftsmith.rundir as rundir
    from draftsmith.rundir import DiskFull

    records = [conv(i) for i in range(6)]
    reference = make_run(tmp_path / "reference", tiny_target, records)
    run_prepare(reference, cfg_for(tiny_target))
    want = (reference.path / "prepare" / "samples.jsonl").read_bytes()

    run = make_run(tmp_path / "run", tiny_target, records)
    real, lines = os.write, []

    def fills_at_the_third_line(fd, data):  # a short write, then ENOSPC, as a filling disk does
        if b'"input_ids"' in data:
            lines.append(data)
            if len(lines) == 3:
                real(fd, data[:7])
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(rundir.os, "write", fills_at_the_third_line)
    out = run.path / "prepare" / "samples.jsonl"
    with pytest.raises(DiskFull, match=rf"^{re.escape(str(out))}: no space left on device"):
        run_prepare(run, cfg_for(tiny_target))
    monkeypatch.undo()
    got = out.read_bytes()
    assert got.endswith(b"\n") and got.count(b"\n") == 2 and want.startswith(got)
    run_prepare(run, cfg_for(tiny_target))
    assert out.read_bytes() == want


class _NoOffsets:
    """The tokenizer seen as a Python (slow) tokenizer: no offsets, as transformers gives Kimi's."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __call__(self, text, **kwargs):
        kwargs.pop("return_offsets_mapping", None)
        return {"input_ids": self._tok(text, **kwargs)["input_ids"]}

    def __getattr__(self, name):
        return getattr(self._tok, name)


CONVERSATIONS = [
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "A poem?"},
     {"role": "assistant", "content": "The sea and the sky, numbers and letters."}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}],
    [{"role": "user", "content": "Ünïcödé 日本?"}, {"role": "assistant", "content": "  spaced   out\n\n and 12345 ☃"}],
]


@pytest.mark.parametrize("template", ["chatml", "joined"])
def test_prepare_without_offsets_equals_the_offsets_path(tmp_path, template):
    """A tokenizer without offsets (a Python tokenizer) gets the same ids and masks as the fast path, on SmolLM2's
    tokenizer both ways, the boundary fix included (JOINED_TEMPLATE merges a token across the turn start)."""
    folder = build_tiny_target(tmp_path / template, **({"chat_template": JOINED_TEMPLATE} if template == "joined" else {}))
    fast, tok = encoder_for(folder)
    slow = ChatEncoder(_NoOffsets(tok), fast.target, fast.end_tokens)
    convs = CONVERSATIONS if template == "chatml" else [
        [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "ance and the sky."}]]
    for msgs in convs:
        a, b = fast.encode(msgs), slow.encode(msgs)
        assert (b.input_ids, b.loss_mask, b.notes) == (a.input_ids, a.loss_mask, a.notes)
        assert sum(b.loss_mask) > 0


def test_prepare_with_the_tiktoken_tokenizer_of_the_kimi_family(tmp_path):
    """The tiny Kimi-K2.5's tiktoken tokenizer (the folder's own code, no offsets): its think-block template
    masks the reasoning and the answer of the last turn, as the SmolLM2 tokenizer with offsets does."""
    from families import make_tiny

    folder = make_tiny("kimi_k25", tmp_path / "k25")
    info = target_info(str(folder), trust_remote_code=True, log=lambda *a: None)
    tok = load_tokenizer(info, trust_remote_code=True)
    assert not tok.is_fast and "offset_mapping" not in tok("a b", return_offsets_mapping=True)
    enc = ChatEncoder.for_target(tok, info)
    msgs = [{"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4.", "reasoning": "Two and two make four."}]
    out = enc.encode(msgs)
    runs = [tok.decode(r) for r in masked_runs(out.input_ids, out.loss_mask)]
    assert runs == ["<think>Two and two make four.</think>4.<|im_end|>"]
    assert out.notes.get("reasoning_kept") == 1
