"""Reasoning through the chat templates of the families that reason: Qwen3 (`reasoning_content`,
kept for the last turn only), gpt-oss (harmony: the analysis channel from the `thinking` field, a
system prompt of its own), DeepSeek-R1 and V3.1 (history always stripped up to `</think>`; the
generation prompt opens the think block), Kimi-K2-Thinking (a default system prompt; the answer
rendered as history with an empty `<think></think>`).

The templates below mirror the real ones (tool branches left out; everything that renders system,
user and assistant turns and the generation prompt is the released text). For each: a server's
reply with reasoning (the fake OpenAI server's `reasoning_content`, gpt-oss's channels as raw text,
a `<think>` block in the content) -> generate -> prepare, and the reasoning is in the prepared ids,
inside the loss mask, with the template's own rendering around it; the capture rate of the
manifest counts it. The system prompt a template adds is outside the mask."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import build_tiny_target
from draftsmith.config import load_config
from draftsmith.generate.local import decode_answer
from draftsmith.generate.openai import parse_turn
from draftsmith.generate.reasoning import split_harmony
from draftsmith.generate.stage import run_generate
from draftsmith.prepare import ChatEncoder, run_prepare
from draftsmith.rundir import RunDir
from draftsmith.target import load_tokenizer, target_info

sys.path.insert(0, str(Path(__file__).resolve().parent))
from openai_fakes import FakeOpenAIServer  # noqa: E402
from test_prepare import masked_runs  # noqa: E402

# Qwen3 (Qwen/Qwen3-8B tokenizer_config.json), without the tools branch.
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# gpt-oss (openai/gpt-oss-20b chat_template.jinja): system message, developer message, and the
# assistant branches without tool calls.
GPT_OSS = """{%- macro build_system_message() -%}
    {%- if model_identity is not defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\\n" }}
    {{- "Knowledge cutoff: 2024-06\\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\\n\\n" }}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {{- "Reasoning: " + reasoning_effort + "\\n\\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
{%- endmacro -%}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if developer_message %}
    {{- "<|start|>developer<|message|>" }}
    {{- "# Instructions\\n\\n" }}
    {{- developer_message }}
    {{- "\\n\\n" }}
    {{- "<|end|>" }}
{%- endif %}
{%- for message in loop_messages -%}
    {%- if message.role == 'assistant' -%}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field.") }}
            {%- endif %}
        {%- endif %}
        {%- if loop.last and not add_generation_prompt %}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
        {%- endif %}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""

# DeepSeek-R1 (deepseek-ai/DeepSeek-R1 tokenizer_config.json, 2025 revision), without tools.
DEEPSEEK_R1 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='') %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    "{{bos_token}}{{ns.system_prompt}}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    "{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}"
    "{%- endif %}"
    "{%- endfor -%}"
    "{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)

# DeepSeek-V3.1 (deepseek-ai/DeepSeek-V3.1 tokenizer_config.json), without tools: `thinking`
# switches the generation prompt between "</think>" and "<think>".
DEEPSEEK_V31 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% if not thinking is defined %}{% set thinking = false %}{% endif %}"
    "{% set ns = namespace(is_first=false, is_tool=false, system_prompt='', is_first_sp=true, is_last_user=false) %}"
    "{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}"
    "{{ bos_token }}{{ ns.system_prompt }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{%- set ns.is_first = false -%}{%- set ns.is_last_user = true -%}"
    "{{'<｜User｜>' + message['content']}}{%- endif %}"
    "{%- if message['role'] == 'assistant' and (message['tool_calls'] is not defined or message['tool_calls'] is none) %}"
    "{%- if ns.is_last_user %}{{'<｜Assistant｜>'}}{%- if message['prefix'] is defined and message['prefix'] and thinking %}"
    "{{'<think>'}}{%- else %}{{'</think>'}}{%- endif %}{%- endif %}"
    "{%- set ns.is_last_user = false -%}"
    "{%- if ns.is_tool %}{{message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"
    "{%- else %}{%- set content = message['content'] -%}{%- if '</think>' in content %}{%- set content = content.split('</think>', 1)[1] -%}{%- endif %}"
    "{{content + '<｜end▁of▁sentence｜>'}}{%- endif %}"
    "{%- endif %}"
    "{%- endfor -%}"
    "{% if add_generation_prompt and ns.is_last_user and not ns.is_tool %}{{'<｜Assistant｜>'}}"
    "{%- if not thinking %}{{'</think>'}}{%- else %}{{'<think>'}}{%- endif %}{% endif %}"
)

# Kimi-K2-Thinking (moonshotai/Kimi-K2-Thinking chat_template.jinja), without tools: a default
# system prompt; every turn up to the last answer is history ("<think></think>" + content).
KIMI_K2_THINKING = """{%- macro render_content(msg) -%}
    {%- set c = msg.get('content') -%}
    {%- if c is string -%}{{ c }}{%- endif -%}
{%- endmacro -%}
{%- if messages|length == 0 or messages[0]['role'] != 'system' -%}
<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>
{%- endif -%}
{% set ns = namespace(last_non_tool_call_assistant_msg=-1) %}
{%- for idx in range(messages|length-1, -1, -1) -%}
    {%- if messages[idx]['role'] == 'assistant' and not messages[idx].get('tool_calls') and ns.last_non_tool_call_assistant_msg == -1 -%}
        {%- set ns.last_non_tool_call_assistant_msg = idx -%}
    {%- endif -%}
{%- endfor -%}
{%- set hist_msgs = messages[:ns.last_non_tool_call_assistant_msg+1] -%}
{%- set suffix_msgs = messages[ns.last_non_tool_call_assistant_msg+1:] -%}
{%- for message in hist_msgs -%}
  {%- set role_name = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}<|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}<|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' -%}<think></think>{{render_content(message)}}
  {%- else -%}{{render_content(message)}}
  {%- endif -%}<|im_end|>
{%- endfor -%}
{%- for message in suffix_msgs -%}
  {%- set role_name = message.get('name') or message['role'] -%}
  {%- if message['role'] == 'user' -%}<|im_user|>{{role_name}}<|im_middle|>
  {%- elif message['role'] == 'assistant' -%}<|im_assistant|>{{role_name}}<|im_middle|>
  {%- else -%}<|im_system|>{{role_name}}<|im_middle|>
  {%- endif -%}
  {%- if message['role'] == 'assistant' -%}
    {%- set rc = message.get('reasoning_content', '') -%}<think>{{rc}}</think>{{render_content(message)}}
  {%- else -%}{{render_content(message)}}
  {%- endif -%}<|im_end|>
{%- endfor -%}
{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"""

# template, its special tokens, the token that ends its answers, its beginning-of-sequence token
KINDS = {
    "qwen3": (QWEN3, ["<think>", "</think>"], "<|im_end|>", None),
    "gpt_oss": (GPT_OSS, ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>"], "<|return|>", None),
    "deepseek_r1": (DEEPSEEK_R1, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                    "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
    "deepseek_v31": (DEEPSEEK_V31, ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"],
                     "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"),
    "kimi_k2_thinking": (KIMI_K2_THINKING, ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<think>", "</think>"],
                         "<|im_end|>", None),
}
# How the target itself wrote (reasoning, answer) in its output, after the generation prompt.
RAW_OUTPUT = {
    "qwen3": "<think>\n{r}\n</think>\n\n{a}",
    "gpt_oss": "<|channel|>analysis<|message|>{r}<|end|><|start|>assistant<|channel|>final<|message|>{a}",
    "deepseek_r1": "{r}\n</think>\n\n{a}",  # the prompt ends with "<think>\n"
    "deepseek_v31": "{r}</think>{a}",  # thinking mode: the prompt ends with "<think>"
    "kimi_k2_thinking": "<think>{r}</think>{a}",
}
SYSTEM_PROMPT_OF_ITS_OWN = {"gpt_oss": "You are ChatGPT, a large language model trained by OpenAI.",
                            "kimi_k2_thinking": "You are Kimi, an AI assistant created by Moonshot AI."}


def build_kind_target(path: Path, kind: str) -> Path:
    """The tiny random Llama of conftest with `kind`'s chat template and special tokens."""
    from transformers import AutoTokenizer

    template, specials, eos, bos = KINDS[kind]
    build_tiny_target(path, chat_template=template)
    tok = AutoTokenizer.from_pretrained(path)
    # <think> and </think> are added but not special tokens in Qwen3's and DeepSeek's tokenizers
    tok.add_tokens([t for t in specials if t in ("<think>", "</think>")])
    tok.add_special_tokens({"additional_special_tokens": [t for t in specials if t not in tok.get_vocab()]})
    tok.eos_token = eos
    if bos:
        tok.bos_token = bos
    tok.save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = tok.convert_tokens_to_ids(eos)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def kind_target(tmp_path_factory):
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = build_kind_target(tmp_path_factory.mktemp(kind), kind)
        return made[kind]
    return get


def masked_text(tok, ids, mask) -> list[str]:
    """The text of each contiguous run of masked tokens."""
    return [tok.decode(r) for r in masked_runs(ids, mask)]


def encoder(target: Path) -> tuple[ChatEncoder, object]:
    info = target_info(str(target))
    tok = load_tokenizer(info)
    return ChatEncoder.for_target(tok, info), tok


# -------------------------------------------------------------------------------------------------
# One conversation per template: what lands in the ids and the mask


@pytest.mark.parametrize("kind", list(KINDS))
def test_last_turn_reasoning_is_rendered_as_the_target_wrote_it(kind, kind_target):
    enc, tok = encoder(kind_target(kind))
    msgs = [{"role": "user", "content": "Write a poem about the sea."},
            {"role": "assistant", "content": "The sea and the sky.", "reasoning": "A poem about the sea: short."}]
    out = enc.encode(msgs, ["stop"])
    text = tok.decode(out.input_ids)
    runs = masked_text(tok, out.input_ids, out.loss_mask)
    template, _, eos, _ = KINDS[kind]
    # one masked run: exactly the target's own output after the generation prompt, and its end token
    prompt = tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True, enable_thinking=True, thinking=True)
    assert runs == [RAW_OUTPUT[kind].format(r="A poem about the sea: short.", a="The sea and the sky.") + eos]
    assert text.startswith(prompt) and text[len(prompt):].startswith(runs[0])
    assert out.notes["reasoning_turns"] == 1 and out.notes["reasoning_kept"] == 1
    assert "reasoning_dropped_by_template" not in out.notes
    if kind in SYSTEM_PROMPT_OF_ITS_OWN:  # the template's own system prompt is there, unmasked
        assert SYSTEM_PROMPT_OF_ITS_OWN[kind] in text and not any(SYSTEM_PROMPT_OF_ITS_OWN[kind] in r for r in runs)
    spliced = kind in ("deepseek_r1", "deepseek_v31", "kimi_k2_thinking")
    assert out.notes.get("reasoning_spliced", 0) == int(spliced)


@pytest.mark.parametrize("kind", list(KINDS))
def test_earlier_turns_lose_reasoning_as_at_inference(kind, kind_target):
    enc, tok = encoder(kind_target(kind))
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello!"},
            {"role": "assistant", "content": "Hello! How can I help?", "reasoning": "Greet back politely."},
            {"role": "user", "content": "Write a poem"},
            {"role": "assistant", "content": "The sea and the sky.", "reasoning": "A poem about the sea."}]
    out = enc.encode(msgs, ["stop", "stop"])
    runs = masked_text(tok, out.input_ids, out.loss_mask)
    text = tok.decode(out.input_ids)
    # both answers trained; the last with its reasoning; the earlier one as the template shows it
    assert len(runs) == 2 and "Hello! How can I help?" in runs[0] and "Greet back politely." not in text
    assert "A poem about the sea." in runs[1] and runs[1].endswith("The sea and the sky." + KINDS[kind][2])
    assert out.notes["reasoning_turns"] == 2 and out.notes["reasoning_kept"] == 1
    assert out.notes["reasoning_dropped_by_template"] == 1
    assert "Be brief." in text and not any("Be brief." in r for r in runs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_cut_answer_keeps_its_reasoning_but_not_the_end_token(kind, kind_target):
    enc, tok = encoder(kind_target(kind))
    msgs = [{"role": "user", "content": "Write a poem"},
            {"role": "assistant", "content": "The sea and", "reasoning": "A poem about the sea."}]
    out = enc.encode(msgs, ["length"])
    runs = masked_text(tok, out.input_ids, out.loss_mask)
    assert len(runs) == 1 and "A poem about the sea." in runs[0] and runs[0].endswith("The sea and")
    assert out.notes["reasoning_kept"] == 1


def test_template_slots_found_by_probing(kind_target):
    keys = {k: (lambda e: (e.reasoning_key, e.think_slot))(encoder(kind_target(k))[0]) for k in KINDS}
    # transformers (5.2x) fills gpt-oss's `thinking` from `reasoning_content` itself, so the first probe renders
    assert keys["gpt_oss"] in (("reasoning_content", False), ("thinking", False))
    keys.pop("gpt_oss")
    assert keys == {"qwen3": ("reasoning_content", False),
                    "deepseek_r1": (None, False), "deepseek_v31": (None, True), "kimi_k2_thinking": (None, True)}


# -------------------------------------------------------------------------------------------------
# generate: how each server or model gives its reasoning


def test_harmony_channels_split():
    raw = "<|channel|>analysis<|message|>Think: 2+2.<|end|><|start|>assistant<|channel|>final<|message|>It is 4."
    assert split_harmony(raw) == ("It is 4.", "Think: 2+2.")
    assert split_harmony("<|channel|>analysis<|message|>cut in the mid") == ("", "cut in the mid")
    assert split_harmony("no channels here") is None
    # a server that passes the channels through as text, and one that parses them (vLLM: reasoning_content)
    t = parse_turn("s", {"choices": [{"message": {"content": raw}, "finish_reason": "stop"}]})
    assert (t.content, t.reasoning) == ("It is 4.", "Think: 2+2.")
    t = parse_turn("s", {"choices": [{"message": {"content": "It is 4.", "reasoning_content": "Think: 2+2."},
                                      "finish_reason": "stop"}]})
    assert (t.content, t.reasoning) == ("It is 4.", "Think: 2+2.")


@pytest.mark.parametrize("kind", ["gpt_oss", "qwen3", "deepseek_r1"])
def test_local_decode_separates_reasoning(kind, kind_target):
    """The local backend decodes the generated ids: harmony channels by their special tokens,
    <think> blocks (Qwen3's are normal added tokens; R1's prompt holds the opening one)."""
    tok = load_tokenizer(target_info(str(kind_target(kind))))
    raw = RAW_OUTPUT[kind].format(r="Think: 2+2.", a="It is 4.")
    ids = tok(raw, add_special_tokens=False)["input_ids"]
    assert decode_answer(tok, ids) == ("It is 4.", "Think: 2+2.")


class ReasoningServer(FakeOpenAIServer):
    """Replies as a reasoning server does: `reasoning_content` field (vLLM's reasoning parsers,
    DeepSeek, Kimi), or harmony channels in the content, or a <think> block in the content; every
    third prompt without reasoning."""

    def __init__(self, style: str, **kw):
        super().__init__(**kw)
        self.style = style

    def answer(self, body, headers):
        code, data = super().answer(body, headers)
        last = [m for m in body["messages"] if m["role"] == "user"][-1]["content"]
        msg = data["choices"][0]["message"]
        answer, thought = f"The sea and the sky {len(body['messages'])}.", f"A poem about the sea, turn {len(body['messages'])}."
        msg.pop("reasoning_content", None)
        if "[plain]" in last:
            msg["content"] = answer
        elif self.style == "field":
            msg["content"], msg["reasoning_content"] = answer, thought
        elif self.style == "harmony":
            msg["content"] = RAW_OUTPUT["gpt_oss"].format(r=thought, a=answer)
        else:
            msg["content"] = RAW_OUTPUT["qwen3"].format(r=thought, a=answer)
        return code, data


STYLE = {"qwen3": "think", "gpt_oss": "harmony", "deepseek_r1": "field", "deepseek_v31": "field", "kimi_k2_thinking": "field"}


@pytest.mark.parametrize("kind", list(KINDS))
def test_server_reasoning_through_generate_and_prepare(kind, kind_target, tmp_path):
    target = kind_target(kind)
    prompts = tmp_path / "prompts.jsonl"
    rows = []
    for i in range(6):
        q = f"Write poem {i}" + (" [plain]" if i % 3 == 2 else "")
        msgs = [{"role": "user", "content": q}]
        if i == 0:  # two user turns: the first answer's reasoning is history the template drops
            msgs += [{"role": "assistant", "content": "old"}, {"role": "user", "content": "And another one"}]
        rows.append({"id": f"p{i}", "messages": msgs})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = RunDir(tmp_path / "run")
    with ReasoningServer(STYLE[kind]) as srv:
        cfg = load_config(None, [f"target={target}", f"generate.prompts={prompts}", "generate.backend=openai",
                                 f"generate.servers=[{srv.base_url}]", "generate.max_tokens=64", "prepare.max_length=512"])
        gm = run_generate(run, cfg)
    recs = [json.loads(x) for x in (run.path / "generate" / "samples.jsonl").read_text().splitlines()]
    for r in recs:
        for m in r["messages"]:
            if m["role"] == "assistant":
                assert "<think>" not in m["content"] and "<|channel|>" not in m["content"]
    # 4 of 6 samples reasoned; answers: 7 (p0 has two), 5 of them with reasoning
    assert gm["counts"]["reasoning"] == 4 and gm["counts"]["answers"] == 7 and gm["counts"]["reasoning_answers"] == 5
    pm = run_prepare(run, cfg)
    c = pm["counts"]
    # p0's first answer is history: every one of these templates drops its reasoning
    assert (c["reasoning_turns"], c["reasoning_kept"], c["reasoning_dropped_by_template"]) == (5, 4, 1)
    assert c["reasoning_capture_rate"] == 0.8
    tok = load_tokenizer(target_info(str(target)))
    prepared = {json.loads(x)["id"]: json.loads(x) for x in (run.path / "prepare" / "samples.jsonl").read_text().splitlines()}
    for r in recs:
        last = r["messages"][-1]
        p = prepared[r["id"]]
        runs = masked_text(tok, p["input_ids"], p["loss_mask"])
        if last.get("reasoning"):
            assert last["reasoning"] in runs[-1] and last["content"] in runs[-1]
        else:
            assert "A poem about the sea" not in tok.decode(p["input_ids"])
    assert "5 assistant turns had reasoning; 4 of them (80%) kept" in (run.path / "prepare" / "stage.log").read_text()
    assert "reasoning captured for 4/6 (67%), 5/7 answers" in (run.path / "generate" / "stage.log").read_text()
