"""Test helpers: a fake OpenAI chat server and a fault-injecting HTTP proxy (both on 127.0.0.1).

FakeOpenAIServer answers /v1/models and /v1/chat/completions deterministically from the request:
the reply names the last user message and the turn number, so a test can check that turn k saw the
model's own earlier replies. Prompts containing these words change the answer:
  [reason-field]  -> `reasoning_content` field      [reasoning]    -> `reasoning` field
  [think]         -> `<think>...</think>` in content [open-think]   -> an unclosed `<think>`, finish length
  [long]          -> finish_reason "length"          [bad-request]  -> HTTP 400 echoing the request headers
  [stall]         -> a streamed reply that stops after its first events (holds the connection `stall_s`; 0: none)
A request with `stream: true` gets the same reply as server-sent events, as vLLM sends them (a role
event, the reasoning then the content a word per event, the finish reason, the usage when
`stream_options.include_usage`, `data: [DONE]`), `event_delay_s` apart, on a connection closed at
its end (no Content-Length, as HTTP/1.0 allows: FaultProxy reads it to the end and forwards it whole).
It records every request (path, headers, JSON body) in `.requests`.

FaultProxy forwards to an upstream and answers a share of requests with a fault instead:
500, 429, a hang longer than the client's timeout, a dropped connection, or cut JSON (a complete
HTTP reply whose JSON body is cut in half, or a connection closed half-way through the body).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeOpenAIServer:
    def __init__(self, model: str = "fake-model", delay_s: float = 0.0, api_key: str | None = None,
                 event_delay_s: float = 0.0, stall_s: float = 30.0):
        self.model, self.delay_s, self.api_key = model, delay_s, api_key
        self.event_delay_s, self.stall_s = event_delay_s, stall_s
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as real servers do

            def log_message(self, *args):
                pass

            def _send(self, code: int, obj) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _auth_ok(self) -> bool:
                if outer.api_key is None or self.headers.get("Authorization") == f"Bearer {outer.api_key}":
                    return True
                self._send(401, {"error": {"message": "bad key"}})
                return False

            def do_GET(self):
                with outer._lock:
                    outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": None})
                if not self._auth_ok():
                    return
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, {"object": "list", "data": [{"id": outer.model, "object": "model"}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                with outer._lock:
                    outer.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if not self._auth_ok():
                    return
                if self.path.rstrip("/") != "/v1/chat/completions":
                    self._send(404, {"error": "not found"})
                    return
                if outer.delay_s:
                    time.sleep(outer.delay_s)
                code, reply = outer.answer(body, dict(self.headers))
                if code != 200 or not body.get("stream"):
                    self._send(code, reply)
                    return
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                stall = "[stall]" in body["messages"][-1]["content"] and outer.stall_s > 0
                try:
                    for k, event in enumerate(outer.stream_events(body, reply)):
                        if stall and k == 2:
                            time.sleep(outer.stall_s)
                            return
                        self.wfile.write(f"data: {event}\n\n".encode())
                        self.wfile.flush()
                        time.sleep(outer.event_delay_s)
                except (BrokenPipeError, ConnectionResetError):
                    return  # the client gave up (an idle timeout): what a real server sees too

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def answer(self, body: dict, headers: dict) -> tuple[int, dict]:
        msgs = body["messages"]
        user = [m for m in msgs if m["role"] == "user"]
        last = user[-1]["content"]
        turn = len(user)
        if "[bad-request]" in last:
            auth = headers.get("Authorization")
            return 400, {"error": {"message": f"rejected request with Authorization: {auth}; all headers: {headers}"}}
        content = f"answer {turn} to: {last[:40]}"
        msg: dict = {"role": "assistant", "content": content}
        finish = "stop"
        if "[reason-field]" in last:
            msg["reasoning_content"] = f"thinking about {turn}"
        if "[reasoning]" in last:
            msg["reasoning"] = f"pondering {turn}"
        if "[think]" in last:
            msg["content"] = f"<think>inner {turn}</think>\n{content}"
        if "[open-think]" in last:
            msg["content"] = f"{content}<think>cut off {turn}"
            finish = "length"
        if "[long]" in last:
            finish = "length"
        prompt_tokens = sum(len(m["content"].split()) for m in msgs)
        completion_tokens = min(body.get("max_tokens") or 16, len(msg["content"].split()))
        return 200, {
            "id": "chatcmpl-fake", "object": "chat.completion", "model": body["model"],
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        }

    @staticmethod
    def stream_events(body: dict, reply: dict) -> list[str]:
        """`reply` (a whole chat completion) as the `data:` payloads of its stream, [DONE] last."""
        msg, finish = reply["choices"][0]["message"], reply["choices"][0]["finish_reason"]

        def chunk(delta: dict, finish_reason=None) -> str:
            return json.dumps({"id": reply["id"], "object": "chat.completion.chunk", "model": reply["model"],
                               "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})

        events = [chunk({"role": "assistant", "content": ""})]
        for field in ("reasoning_content", "reasoning"):
            events += [chunk({field: w}) for w in re.findall(r"\s*\S+\s*", msg.get(field) or "")]
        events += [chunk({"content": w}) for w in re.findall(r"\s*\S+\s*", msg["content"])]
        events.append(chunk({}, finish))
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append(json.dumps({"id": reply["id"], "object": "chat.completion.chunk", "model": reply["model"],
                                      "choices": [], "usage": reply["usage"]}))
        return events + ["[DONE]"]

    def chat_requests(self) -> list[dict]:
        with self._lock:
            return [r for r in self.requests if r["body"] is not None]

    def __enter__(self) -> "FakeOpenAIServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


FAULTS = ("500", "429", "hang", "drop", "cut_json", "cut_body")


class FaultProxy:
    """HTTP/1.1 proxy on 127.0.0.1 (asyncio streams, own thread) that injects faults.

    `rate`: share of requests answered with a fault (types drawn from `faults`, seeded);
    `hang_s`: how long a "hang" holds the request before closing (longer than the client timeout).
    `script`: faults for the first chat requests, in order (then `rate` applies); `chat_only`: only
chat requests get faults. Change `rate` at any time (0 for a clean retry run); `counts` tallies.
    """

    def __init__(self, upstream_port: int, rate: float = 0.3, faults=FAULTS, seed: int = 0, hang_s: float = 3.0,
                 script: list[str] | None = None, chat_only: bool = True):
        self.upstream_port = upstream_port
        self.rate, self.faults, self.hang_s = rate, tuple(faults), hang_s
        self.script = list(script or [])  # faults for the first requests, in this order, before `rate` applies
        self.chat_only = chat_only  # leave GET /v1/models alone
        self.rng = random.Random(seed)
        self.counts: dict[str, int] = {"ok": 0, **{f: 0 for f in FAULTS}}
        self.loop = asyncio.new_event_loop()
        self.port: int | None = None
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._client, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()

    async def _read_request(self, reader) -> bytes | None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        body = await reader.readexactly(length) if length else b""
        return head + body

    async def _forward(self, raw: bytes) -> tuple[bytes, bytes]:
        """(status line + headers without Content-Length/Connection, body) from the upstream."""
        head, _, body = raw.partition(b"\r\n\r\n")
        lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
        # as HTTP/1.0: a server streaming its reply then ends it by closing instead of in chunked encoding
        lines[0] = lines[0].replace(b" HTTP/1.1", b" HTTP/1.0")
        req = b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n" + body
        r, w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        w.write(req)
        await w.drain()
        resp = await r.read()  # Connection: close -> read to EOF
        w.close()
        rhead, _, rbody = resp.partition(b"\r\n\r\n")
        keep = [ln for ln in rhead.split(b"\r\n") if not ln.lower().startswith((b"content-length:", b"connection:"))]
        return b"\r\n".join(keep), rbody

    @staticmethod
    def _reply(head: bytes, body: bytes, length: int | None = None) -> bytes:
        n = len(body) if length is None else length
        return head + f"\r\nContent-Length: {n}\r\nConnection: keep-alive\r\n\r\n".encode() + body

    @staticmethod
    def _json_reply(code: int, reason: str, obj: dict, extra: str = "") -> bytes:
        body = json.dumps(obj).encode()
        head = f"HTTP/1.1 {code} {reason}\r\nContent-Type: application/json{extra}".encode()
        return FaultProxy._reply(head, body)

    async def _client(self, reader, writer) -> None:
        try:
            while True:
                raw = await self._read_request(reader)
                if raw is None:
                    return
                if self.chat_only and b"/chat/completions" not in raw.split(b"\r\n", 1)[0]:
                    fault = None
                elif self.script:
                    fault = self.script.pop(0)
                else:
                    fault = self.rng.choice(self.faults) if self.rng.random() < self.rate else None
                self.counts[fault or "ok"] += 1
                if fault == "500":
                    writer.write(self._json_reply(500, "Internal Server Error", {"error": "injected 500"}))
                elif fault == "429":
                    writer.write(self._json_reply(429, "Too Many Requests", {"error": "injected 429"}, "\r\nRetry-After: 0"))
                elif fault == "hang":
                    await asyncio.sleep(self.hang_s)
                    return
                elif fault == "drop":
                    return
                else:
                    head, body = await self._forward(raw)
                    if fault == "cut_json":  # a whole HTTP reply, but its JSON is cut in half
                        writer.write(self._reply(head, body[: len(body) // 2]))
                    elif fault == "cut_body":  # announces the whole body, sends half, closes
                        writer.write(self._reply(head, body[: len(body) // 2], length=len(body)))
                        await writer.drain()
                        return
                    else:
                        writer.write(self._reply(head, body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    def __enter__(self) -> "FaultProxy":
        self.thread.start()
        self._ready.wait(10)
        return self

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
