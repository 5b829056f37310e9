"""generate.backend=openai: any OpenAI-compatible chat server (vLLM, SGLang).

One or several base URLs, requests spread over them (least in flight first), bounded
concurrency, retries with exponential backoff and jitter on 408/409/425/429/5xx, connection
errors, timeouts and malformed replies (all of it the one client's, draftsmith/http.py). Each
answer is streamed (`stream: true`, usage in the last event) and bounded by its progress, not its
length: an attempt is cut only when no data came for `generate.idle_timeout_s`, so a long thinking
answer at a slow server's pace completes. The streamed deltas are joined into the reply a
non-streamed request gets and read by the same `parse_turn`: content, reasoning (either field) and
token counts come out the same. The API key comes from the environment variable named by
`generate.api_key_env`; it is sent in the Authorization header only, never logged or stored
(error texts are scrubbed of it).
"""

import asyncio
import os
from typing import Callable

from draftsmith import DraftsmithError
from draftsmith.config import AUTO_OPENAI_IN_FLIGHT
from draftsmith.generate.reasoning import split_harmony, split_reasoning
from draftsmith.generate.samples import SAMPLING, TurnResult, build_record
from draftsmith.http import BadReply, OpenAIClient, SampleFailed, normalize_server, served_models


def configured_servers(gen) -> list[str]:
    """generate.servers, checked (before anything is written)."""
    if not gen.servers:
        raise DraftsmithError("generate.servers: backend openai needs at least one server URL (--server URL)")
    return [normalize_server(s, "generate.servers") for s in gen.servers]


def decode(run, cfg, info, pending, prog, on_done, on_fail) -> dict:
    """The backend: every pending sample from generate.servers."""
    gen = cfg.generate
    api_key = os.environ.get(gen.api_key_env) or None
    in_flight = AUTO_OPENAI_IN_FLIGHT if gen.concurrency == "auto" else gen.concurrency
    return asyncio.run(ask_servers(pending, gen, configured_servers(gen), api_key, prog, on_done, on_fail,
                                   in_flight=in_flight))


def chat_body(gen, model: str, messages: list[dict], sampling: dict | None = None) -> dict:
    """One chat request; `sampling` ({temperature, seed}) overrides generate.temperature (a resampled answer)."""
    body = {"model": model, "messages": messages, "max_tokens": gen.max_tokens, "temperature": gen.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if sampling:
        body.update({k: v for k, v in sampling.items() if v is not None})
    if gen.top_p < 1.0:  # 1.0 is every server's default: leave it out
        body["top_p"] = gen.top_p
    return body


def parse_turn(server: str, data: dict) -> TurnResult:
    """`parse` of a chat reply (see http.OpenAIClient): the turn, its reasoning moved out of the
    content. A 200 without a usable message is as transient as a cut reply: BadReply, retried."""
    try:
        choice = data["choices"][0]
        msg = choice["message"]
        content = msg.get("content") or ""
        field_reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not isinstance(content, str) or not (field_reasoning is None or isinstance(field_reasoning, str)):
            raise TypeError("content is not text")
        usage = data.get("usage") or {}
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise BadReply(f"malformed reply: {type(e).__name__}: {e}") from None
    harmony = split_harmony(content)  # a server that passes gpt-oss's channels through as text
    if harmony is not None:
        content, channel_reasoning = harmony
        field_reasoning = "\n\n".join(r for r in (field_reasoning, channel_reasoning) if r) or None
    content, reasoning = split_reasoning(content, field_reasoning)
    return TurnResult(content, reasoning, choice.get("finish_reason"), prompt_tokens, completion_tokens)


def parse_stream(server: str, events: list[dict]) -> TurnResult:
    """`parse` of a streamed chat reply (see http.OpenAIClient.arequest, stream=True): the deltas of choice 0 joined
    into the reply a non-streamed request gets (content, `reasoning_content` or `reasoning`, the
    finish reason, the usage of the last event that has one), then read by parse_turn."""
    content: list[str] = []
    reasoning: list[str] = []
    finish, usage, seen = None, None, False
    try:
        for event in events:
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                seen = True
                delta = choice.get("delta") or {}
                content.append(delta.get("content") or "")
                if piece := delta.get("reasoning_content") or delta.get("reasoning"):
                    reasoning.append(piece)
                finish = choice.get("finish_reason") or finish
        if not seen:
            raise KeyError("no choice in the stream")
        message = {"content": "".join(content), "reasoning_content": "".join(reasoning) if reasoning else None}
    except (KeyError, TypeError, AttributeError) as e:
        raise BadReply(f"malformed stream: {type(e).__name__}: {e}") from None
    return parse_turn(server, {"choices": [{"message": message, "finish_reason": finish}], "usage": usage})


async def _sample(client: OpenAIClient, gen, model: str, prompt) -> list[TurnResult]:
    """One conversation, turn by turn: each user turn answered with the answers so far as history."""
    messages = prompt.system_messages()
    results = []
    for k, user in enumerate(prompt.turns):
        messages.append({"role": "user", "content": user})
        body = chat_body(gen, model, messages, prompt.meta.get(SAMPLING))
        try:
            t, _ = await client.arequest("POST", "/chat/completions", body, parse=parse_stream, stream=True)
        except SampleFailed as e:
            e.turn = k
            raise
        # History carries the answer only: chat templates drop earlier turns' reasoning too.
        messages.append({"role": "assistant", "content": t.content})
        results.append(t)
    return results


async def ask_servers(pending, gen, servers, api_key, prog, on_done, on_fail, *, in_flight: int,
                      server_gone: Callable[[], str | None] | None = None) -> dict:
    """Ask the servers for every pending sample, `in_flight` requests at a time (generate.concurrency as the
    backend resolved it). server_gone (backend vllm): why draftsmith's own server is gone, or None; a sample
    that fails after it has gone stops the stage with that reason instead of failing every sample in turn.
    Returns the model, retries, requests per server and in_flight."""
    client = OpenAIClient(servers, timeout_s=gen.idle_timeout_s, retries=gen.retries, backoff_s=gen.backoff_s,
                          concurrency=in_flight, api_key=api_key, api_key_env=gen.api_key_env)
    try:
        model = await _served_model(client, gen, prog)
        prog.log(f"model {model} on {len(servers)} server(s): {', '.join(servers)}; {in_flight} requests in flight")

        todo = iter(pending)  # shared by the workers (one event loop: no locking needed)

        async def worker():
            for p in todo:
                try:
                    turns = await _sample(client, gen, model, p)
                except SampleFailed as e:
                    gone = server_gone() if server_gone else None
                    if gone:  # not the sample's fault: left pending, tried again by the next run
                        raise DraftsmithError(f"generate: {gone}") from None
                    on_fail(p, e)
                    continue
                on_done(build_record(p, turns, gen.backend, model))

        tasks = [asyncio.ensure_future(worker()) for _ in range(min(in_flight, len(pending)))]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return {"model": model, "retried_requests": client.retried, "requests_per_server": dict(client.balancer.sent),
                "in_flight": in_flight}
    finally:
        await client.aclose()


async def _served_model(client: OpenAIClient, gen, prog) -> str:
    """generate.model, or the first model the first server lists; refused unless every server serves it."""
    async def names(server: str) -> list[str]:
        try:
            models, _ = await client.arequest("GET", "/models", server=server, parse=served_models)
        except SampleFailed as e:
            raise DraftsmithError(f"generate.servers: {server} does not answer /models ({e.error})") from None
        return [m["id"] for m in models]

    servers = client.servers
    with prog.busy("asking the servers which model they serve"):
        lists = await asyncio.gather(*(names(s) for s in servers))
    model = gen.model or (lists[0][0] if lists[0] else None)
    if model is None:
        raise DraftsmithError(f"generate.servers: {servers[0]} serves no model (empty /models)")
    for s, served in zip(servers, lists):
        if model not in served:
            raise DraftsmithError(f"generate.model: {s} does not serve {model!r} "
                                  f"(it serves {', '.join(served) or 'nothing'})")
    return model
