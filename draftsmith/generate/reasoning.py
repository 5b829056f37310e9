"""Reasoning in a reply: server fields, `<think>` blocks in the content, gpt-oss's harmony channels.

Every generate backend moves a reply's reasoning out of its answer with these, so that
samples.jsonl keeps the two apart (prepare renders them back the way the template wants).
"""

import re

_THINK_BLOCK = re.compile(r"<think>(.*?)</think>", re.DOTALL)


def split_reasoning(content: str, reasoning: str | None = None) -> tuple[str, str | None]:
    """(answer, reasoning) from a reply: `<think>...</think>` blocks move from the content into the
    reasoning (after a server-given reasoning field, if any).

    Also handled: a reply that starts inside the block (templates that put `<think>` in the
    prompt, so only `</think>` comes back) and a block left open by a truncated reply.
    """
    parts = [reasoning.strip()] if reasoning and reasoning.strip() else []
    close = content.find("</think>")
    if close != -1 and "<think>" not in content[:close]:
        parts.append(content[:close])
        content = content[close + len("</think>"):]
    parts.extend(_THINK_BLOCK.findall(content))
    content = _THINK_BLOCK.sub("", content)
    opened = content.find("<think>")
    if opened != -1:  # never closed: the reply was cut inside its reasoning
        parts.append(content[opened + len("<think>"):])
        content = content[:opened]
    parts = [p.strip() for p in parts if p.strip()]
    if parts or reasoning is not None or close != -1 or opened != -1:
        content = content.strip()
    return content, ("\n\n".join(parts) if parts else None)


# gpt-oss (harmony): `<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...`
_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>[^<]*)?<\|channel\|>([A-Za-z_]+)[^<]*<\|message\|>(.*?)"
    r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)",
    re.DOTALL)


def split_harmony(text: str) -> tuple[str, str | None] | None:
    """(answer, reasoning) of a reply in gpt-oss's harmony format, decoded with its special tokens:
    the `final` channel is the answer, the `analysis` (and `commentary`) channels the reasoning.
    None when the text is not harmony (no `<|channel|>`). A reply cut inside its analysis has
    reasoning and an empty answer."""
    if "<|channel|>" not in text:
        return None
    answer: list[str] = []
    reasoning: list[str] = []
    for channel, body in _HARMONY_MESSAGE.findall(text):
        (answer if channel == "final" else reasoning).append(body.strip())
    reasoning = [r for r in reasoning if r]
    return "\n\n".join(a for a in answer if a), ("\n\n".join(reasoning) if reasoning else None)
