"""generate.backend=local: the target in-process through transformers, batched with left padding;
greedy (and deterministic) at temperature 0.

Batches hold one temperature (resampled answers after the first answers) and similar lengths (less
padding); a conversation's turns go one after another, each batch turn by turn.
"""

import torch
from transformers import GenerationConfig

from draftsmith import DraftsmithError
from draftsmith.config import Config, GenerateConfig
from draftsmith.generate.reasoning import split_harmony, split_reasoning
from draftsmith.generate.samples import SAMPLING, TurnResult, build_record
from draftsmith.http import SampleFailed
from draftsmith.progress import Progress
from draftsmith.prompts import Prompt, prefix_exceeds
from draftsmith.target import Target, load_target


def decode_answer(tok, answer: list[int]) -> tuple[str, str | None]:
    """(answer, reasoning) of generated token ids: gpt-oss's harmony channels are told apart by
    their special tokens (decoded with them); any other reply is decoded without special tokens and
    its `<think>` block moved out (Qwen3's `<think>` is a normal added token, kept by the decode)."""
    harmony = split_harmony(tok.decode(answer, skip_special_tokens=False))
    if harmony is not None:
        return harmony
    return split_reasoning(tok.decode(answer, skip_special_tokens=True))


def _load(cfg: Config, prog: Progress) -> tuple[Target, set[int], int]:
    """(target, its stop token ids, the pad id) of a target that can generate: one without a chat
    template or an end-of-sequence token is refused here, before any batch is built."""
    with prog.busy("loading target"):
        target = load_target(cfg.target, cfg.device, cfg.dtype, cfg.trust_remote_code, log=prog.log)
    tok = target.tokenizer
    if not getattr(tok, "chat_template", None):
        raise DraftsmithError(f"target: {target.info.path} has no chat template; generate needs one to build prompts")
    eos_ids = target.eos_ids()
    if not eos_ids:
        raise DraftsmithError(f"target: {target.info.path} defines no end-of-sequence token")
    # a tokenizer without a pad token pads with a stop token: the attention mask hides a prompt's padding,
    # and an answer ends at its first stop token, so the rows that stopped early are cut there
    return target, eos_ids, tok.pad_token_id if tok.pad_token_id is not None else min(eos_ids)


def _generation_config(gen: GenerateConfig, temperature: float, pad_id: int, eos_ids: set[int]) -> GenerationConfig:
    """How one batch is decoded: up to generate.max_tokens, stopping at any stop token; sampled at
    `temperature` (with generate.top_p) or, at 0, greedy."""
    gcfg = dict(max_new_tokens=gen.max_tokens, do_sample=temperature > 0, pad_token_id=pad_id,
                eos_token_id=sorted(eos_ids))
    if temperature > 0:
        gcfg.update(temperature=temperature, top_p=gen.top_p)
    else:  # the model's own sampling defaults must not turn greedy into something else
        gcfg.update(temperature=None, top_p=None, top_k=None)
    return GenerationConfig(**gcfg)


def _say_settings(prog: Progress, target: Target, gen: GenerateConfig) -> None:
    """The backend's first line: the target, where it runs and how it samples (the log tells a slow
    CPU run or a sampled one at a glance)."""
    prog.log(f"local backend: {target.info.name} on {target.device} ({str(target.dtype).replace('torch.', '')}), "
             f"batch {gen.batch_size}, "
             + ("greedy" if gen.temperature == 0 else f"temperature {gen.temperature}")
             + (f"; {gen.answers_per_prompt - 1} more answer(s) per prompt at temperature {gen.resample_temperature}"
                if gen.answers_per_prompt > 1 else ""))


def _batches(pending: list[Prompt], batch_size: int) -> list[list[Prompt]]:
    """The pending samples in batches of one temperature (resampled answers after the first answers),
    similar lengths in a batch (less padding)."""
    order = sorted(pending, key=lambda p: (SAMPLING in p.meta, len(p.turns), len(p.turns[0])))
    batches = []
    for resampled in (False, True):
        group = [p for p in order if (SAMPLING in p.meta) == resampled]
        batches += [group[b:b + batch_size] for b in range(0, len(group), batch_size)]
    return batches


def _left_padded(ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of a batch's prompts, each [B, T] and left-padded: generate
    appends every row's answer at the same position, right after the longest prompt."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)  # [B, T], left-padded
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x):] = torch.tensor(x)
        attention_mask[i, width - len(x):] = 1
    return input_ids, attention_mask


def decode(run, cfg, info, pending, prog, on_done, on_fail) -> dict:
    """The backend: every pending sample decoded in-process, in batches (see the module doc)."""
    gen = cfg.generate
    target, eos_ids, pad_id = _load(cfg, prog)
    model, tok, name = target.model, target.tokenizer, target.info.name
    max_pos = getattr(model.config, "max_position_embeddings", None)
    _say_settings(prog, target, gen)
    if gen.temperature > 0:
        torch.manual_seed(gen.seed or 0)

    # A resampled batch is seeded by its first sample's seed: rerunning the same batch draws the
    # same answers (HF sampling has no per-row seed).
    batches = _batches(pending, gen.batch_size)
    for j, batch in enumerate(batches):
        sampling = batch[0].meta.get(SAMPLING)
        config = _generation_config(gen, sampling["temperature"] if sampling else gen.temperature, pad_id, eos_ids)
        if sampling:
            torch.manual_seed(sampling["seed"])
        convs = {p.id: p.system_messages() for p in batch}
        results: dict[str, list[TurnResult]] = {p.id: [] for p in batch}
        failed: set[str] = set()
        for k in range(max(len(p.turns) for p in batch)):
            active, ids = [], []
            for p in batch:
                if k >= len(p.turns) or p.id in failed:
                    continue
                convs[p.id].append({"role": "user", "content": p.turns[k]})
                try:  # one conversation the template or tokenizer cannot take fails alone, not the batch
                    text = tok.apply_chat_template(convs[p.id], tokenize=False, add_generation_prompt=True)
                except Exception as e:
                    failed.add(p.id)
                    on_fail(p, SampleFailed(f"the chat template cannot render it ({type(e).__name__}: "
                                            f"{str(e)[:200]})", 1, k))
                    continue
                room = None if max_pos is None else max_pos - gen.max_tokens  # prompt tokens that fit
                if prefix_exceeds(tok, text, room):
                    failed.add(p.id)
                    on_fail(p, SampleFailed(f"prompt of more than {room} tokens ({len(text)} characters) + max_tokens "
                                            f"{gen.max_tokens} exceeds the target's context ({max_pos})", 1, k))
                    continue
                x = tok(text, add_special_tokens=False)["input_ids"]  # the template has its own specials
                if room is not None and len(x) > room:
                    failed.add(p.id)
                    on_fail(p, SampleFailed(f"prompt of {len(x)} tokens + max_tokens {gen.max_tokens} exceeds the "
                                            f"target's context ({max_pos})", 1, k))
                    continue
                active.append(p)
                ids.append(x)
            if not active:
                continue
            input_ids, attention_mask = _left_padded(ids, pad_id)
            width = input_ids.shape[1]
            # no answer of a batch lands before its longest one ends: the phase keeps `status` saying
            # "running" (not "stalled") through a batch that takes minutes on a busy CPU, and its time is
            # its answers' own (work=True: the rate of the burst at its end is over the batch's time)
            turn = f", turn {k + 1}" if k else ""
            with prog.busy(f"decoding batch {j + 1}/{len(batches)} ({len(active)} conversations{turn}, "
                           f"up to {gen.max_tokens} tokens each)", work=True), torch.inference_mode():
                out = model.generate(input_ids=input_ids.to(target.device),
                                     attention_mask=attention_mask.to(target.device), generation_config=config)
            new = out[:, width:].tolist()  # [B, <= max_tokens]; rows that stopped early are padded
            for p, x, row in zip(active, ids, new):
                stop = next((i for i, t in enumerate(row) if t in eos_ids), None)
                answer = row if stop is None else row[:stop]
                content, reasoning = decode_answer(tok, answer)
                n_out = len(answer) + (stop is not None)  # the stop token counts, as servers count it
                results[p.id].append(TurnResult(content, reasoning, "length" if stop is None else "stop",
                                                len(x), n_out))
                convs[p.id].append({"role": "assistant", "content": content})
        for p in batch:
            if p.id not in failed:
                on_done(build_record(p, results[p.id], "local", name))
    return {"model": name}
