"""The held-out split: which samples validation keeps out of training (and out of the draft vocabulary), by
group, and its file train/validation.json. No torch: vocab and train both ask it, and a reader can check a split.

Groups. Samples that share text must fall on one side, or a validation answer is one the drafter has half
seen. A sample's group (`group_of`) is, in this order:
- the group its prompt record named, when generate.group_by names a field (a data set's conversation or topic
  column): carried by generate and prepare as the record's `group`;
- else its prompt's id with the suffixes draftsmith adds taken off: a resampled answer's `#k@T...`
  (generate.answers_per_prompt) and a renamed duplicate's `#n` (prompts.load_prompts), so that every answer to
  one prompt text is one group;
- and a ShareGPT segment's conversation: ShareGPT splits long conversations into segments `XXXXXXX_k` (seven
  letters or digits, then the segment), whose turns continue each other, so `wNBG8Gp_0` and `wNBG8Gp_15` are one
  group. Only that exact shape is read as a segment: an id `sample_3` stays its own group.

The rule (`split`). Each group gets u = the first 8 bytes of sha256(group) as a number in [0, 1); groups are
held out lowest u first, a prefix of that order:
- train.validation < 1 (a share): the groups with u < share; when they hold fewer than
  train.validation_min_samples greedy answers (MIN_SAMPLES_NOTE says why 64), more groups in u order until they
  do, but never past MAX_FLOOR_SHARE of the groups;
- train.validation >= 1 (a count): groups in u order until that many samples;
- then at most train.validation_max_samples samples, and never every sample.
Why a prefix of one fixed order: the split depends on the groups alone (not the order, packing, world size or a
resume), and when the store grows the cut in u can only stay or fall (a share's cut is fixed; the floor's, a
count's and the cap's fall as groups are added), so a group trained on in a smaller store is never held out in a
larger one, and while the share alone decides (at least validation_min_samples / share groups, under the cap) the
held-out groups are exactly the same. Held-out groups of a smaller store may go to training in a larger one only
where the floor, a count or the cap decided: then a drafter resumed from the smaller run has never seen the new
held-out set either.

File (`record`): train/validation.json, written by train when it holds samples out: the rule's settings and cut,
and per held-out group its sample ids and which of them validation measures (the greedy answers).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from draftsmith.generate.samples import prompt_id_of

FILE = "validation.json"
VERSION = 1
# ShareGPT's segment ids: a seven-character conversation id, then `_` and the segment's number
SHAREGPT_SEGMENT = re.compile(r"^([A-Za-z0-9]{7})_\d+$")
DUPLICATE = re.compile(r"#\d+$")  # load_prompts numbers a repeated id `X#2`, `X#3`, ...
# The floor never holds out more than this share of the groups (a 192-prompt demo keeps 90 % to train on).
MAX_FLOOR_SHARE = 0.10
# why 64: the served tau's per-prompt spread is 0.16-0.32 on SmolLM2's answers (a standard error of 0.04-0.08 at 16
# prompts, docs/experiments/calibration.md), so 64 answers bring validation's standard error to about 0.03
MIN_SAMPLES_NOTE = "64 give a standard error near 0.03"


def group_of(sample_id: str, group: str | None = None) -> str:
    """The group a sample is held out with (module doc)."""
    if group is not None:
        return str(group)
    pid = DUPLICATE.sub("", prompt_id_of(sample_id))
    m = SHAREGPT_SEGMENT.match(pid)
    return m.group(1) if m else pid


def is_greedy(sample_id: str) -> bool:
    """Whether a sample is its prompt's first (greedy) answer, not a resampled one: what validation measures."""
    return prompt_id_of(sample_id) == str(sample_id)


def rank_of(group: str) -> float:
    """u in [0, 1): where a group sits in the one fixed order the split cuts (module doc)."""
    return int.from_bytes(hashlib.sha256(group.encode("utf-8", "surrogatepass")).digest()[:8], "big") / 2.0 ** 64


@dataclass
class Split:
    """The held-out samples of one list of sample ids."""
    indices: list[int]  # held-out sample indices, ascending
    groups: dict[str, list[int]]  # held-out group -> its sample indices
    cut: float  # the u below which groups are held out (0.0: none)
    decided_by: str  # "share", "floor", "count", "cap" or "off"
    greedy: int  # held-out greedy answers (what validation measures)


def split(ids: list[str], share: float, min_samples: int = 64, max_samples: int = 256,
          groups: dict[str, str] | None = None) -> Split:
    """The held-out samples of `ids` under train.validation = `share` (module doc). `groups`: sample id -> the
    group its record named (generate.group_by), for the samples that have one."""
    groups = groups or {}
    keys = [group_of(i, groups.get(i)) for i in ids]
    members: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        members.setdefault(k, []).append(i)
    if share <= 0 or len(members) < 2:
        return Split([], {}, 0.0, "off", 0)
    order = sorted(members, key=lambda k: (rank_of(k), k))
    greedy_in = {k: sum(1 for i in members[k] if is_greedy(ids[i])) for k in order}
    n = 0
    samples = greedy = 0
    if share < 1:
        decided = "share"
        while n < len(order) and rank_of(order[n]) < share:
            samples += len(members[order[n]])
            greedy += greedy_in[order[n]]
            n += 1
        floor_groups = math.floor(MAX_FLOOR_SHARE * len(order))
        while greedy < min_samples and n < floor_groups:
            decided = "floor"
            samples += len(members[order[n]])
            greedy += greedy_in[order[n]]
            n += 1
    else:
        decided = "count"
        while n < len(order) and samples < int(share):
            samples += len(members[order[n]])
            greedy += greedy_in[order[n]]
            n += 1
    # the cap and "never more than half": drop groups from the end of the prefix (a tiny store keeps most of its
    # samples for training whatever the count asked)
    while n > 0 and (samples > max_samples or 2 * samples > len(ids) or n >= len(order)):
        decided = "cap"
        n -= 1
        samples -= len(members[order[n]])
        greedy -= greedy_in[order[n]]
    held = {k: members[k] for k in order[:n]}
    cut = rank_of(order[n]) if n < len(order) and n else 0.0
    return Split(sorted(i for m in held.values() for i in m), held, cut, decided if n else "off", greedy)


KEYS = ("validation", "validation_min_samples", "validation_max_samples")  # the train keys the split reads


def settings(tc) -> dict | None:
    """The split's settings of train config `tc` (None when validation is off): vocab's fingerprint holds them."""
    return {k: getattr(tc, k) for k in KEYS} if tc.validation > 0 else None


def split_of(tc, ids: list[str], groups: dict[str, str] | None = None) -> Split:
    """The held-out samples of `ids` under train config `tc`: the one split vocab and train both make."""
    return split(ids, tc.validation, tc.validation_min_samples, tc.validation_max_samples, groups)


def shortfall(s: Split, tc) -> str | None:
    """The line train says when the split measures fewer greedy answers than train.validation_min_samples asks."""
    if not s.indices or s.greedy >= tc.validation_min_samples:
        return None
    return (f"validation: {s.greedy} greedy answers measured, fewer than train.validation_min_samples "
            f"({tc.validation_min_samples}: {MIN_SAMPLES_NOTE}), so its standard error is larger"
            + ("; a share never holds out more than a tenth of the groups" if s.decided_by == "floor"
               else "; raise train.validation to hold out more"))


def record(s: Split, ids: list[str], settings: dict) -> dict:
    """train/validation.json's content: the settings, the cut and, per held-out group, its sample ids and the
    measured (greedy) ones."""
    return {"version": VERSION, "settings": settings, "decided_by": s.decided_by, "cut": s.cut,
            "samples": len(s.indices), "measured": s.greedy, "groups": len(s.groups),
            "held_out": {g: {"ids": [ids[i] for i in m], "measured": [ids[i] for i in m if is_greedy(ids[i])]}
                         for g, m in s.groups.items()}}
