"""generate.backend=dataset: no decoding: each user turn keeps the reply the prompt file itself has
(ShareGPT's `gpt` turns, `messages`' assistant turns), cut at max_tokens tokens of the target's
tokenizer; a conversation ends before its first turn without a reply (left out when that is the
first) and after its first cut reply (later turns answer text that is gone).

Not the target's own text, but with train.loss_on=all the target still teaches every position
(its distribution on this text), and a token costs a forward pass instead of a decoding step: on
the 2-core CPU a drafter trained on
ShareGPT's answers replays tau 1.35 against 1.37 for the same number of regenerated tokens, but
four times the tokens this way did not beat the regenerated two-hour recipe (1.67 against 1.70
in vLLM at the same training time; docs/experiments/drafter-quality.md).
"""

from draftsmith.generate.reasoning import split_reasoning
from draftsmith.generate.samples import TurnResult, build_record
from draftsmith.target import load_tokenizer


def decode(run, cfg, info, pending, prog, on_done, on_fail) -> dict:
    """Each pending prompt's replies from its source, cut at generate.max_tokens target tokens
    (finish reason `length` then, as a server reports a cut reply; else `stop`); a conversation
    ends with its first cut reply. Token counts are the target tokenizer's: the prompt as the chat
    template renders it and the reply, with the stop token counted as servers do."""
    gen = cfg.generate
    tok = load_tokenizer(info, cfg.trust_remote_code)
    model = f"dataset:{gen.prompts}"
    prog.log(f"dataset backend: the replies in {gen.prompts}, at most {gen.max_tokens} tokens each "
             f"({info.name}'s tokenizer)")
    for p in pending:
        conv = p.system_messages()
        turns: list[TurnResult] = []
        for user, answer in zip(p.turns, p.answers):
            conv.append({"role": "user", "content": user})
            prompt = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
            n_prompt = len(tok(prompt, add_special_tokens=False)["input_ids"])
            ids = tok(answer, add_special_tokens=False)["input_ids"]
            cut = len(ids) > gen.max_tokens
            if cut:  # a cut inside a multi-byte character decodes to U+FFFD: drop it
                answer = tok.decode(ids[:gen.max_tokens], clean_up_tokenization_spaces=False).rstrip("\ufffd")
            content, reasoning = split_reasoning(answer)
            turns.append(TurnResult(content, reasoning, "length" if cut else "stop", n_prompt,
                                    gen.max_tokens if cut else len(ids) + 1))
            conv.append({"role": "assistant", "content": content})
            if cut:
                break
        on_done(build_record(p, turns, "dataset", model))
    return {"model": model}
