"""ShareGPT conversations as chat messages, for benchmarks that need realistic samples."""

from __future__ import annotations

from draftsmith.prompts import iter_records, resolve_source

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant"}


def sharegpt_conversations(n: int) -> list[tuple[str, list[dict]]]:
    """(id, messages) of the first n packaged ShareGPT conversations that start with a user turn
    and have at least one assistant turn (empty turns and unknown roles dropped)."""
    path, _ = resolve_source("sharegpt")
    out: list[tuple[str, list[dict]]] = []
    for _, rec in iter_records(path, tolerate_cut_tail=True):
        conv = rec.get("conversations") if isinstance(rec, dict) else None
        if not isinstance(conv, list):
            continue
        msgs = [{"role": ROLES[t.get("from")], "content": t.get("value")} for t in conv
                if isinstance(t, dict) and t.get("from") in ROLES and isinstance(t.get("value"), str) and t["value"].strip()]
        if len({m["role"] for m in msgs}) < 2 or msgs[0]["role"] != "user":
            continue
        out.append((str(rec.get("id", len(out))), msgs))
        if len(out) == n:
            break
    return out
