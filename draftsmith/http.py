"""How draftsmith talks to OpenAI-compatible servers (vLLM, SGLang, any `/v1` API): generate's chat
completions, extract's hidden-states completions and eval's requests to a vLLM server.

- `normalize_server`: a server as the config gives it -> its base URL `http://host:port/v1`.
- `Balancer`: which server gets the next request: the fewest in flight (round-robin on ties), a
  server that just failed last, one marked down none at all.
- The retry rule (`OpenAIClient._judge_reply`, `_judge_error`, `backoff_delay`): 408/409/425/429/5xx,
  refused or dropped connections, timeouts, undecodable JSON and replies the caller's `parse`
  rejects (`BadReply`) are retried after an exponential, jittered backoff (a 429's Retry-After
  wins); 401/403 stop everything (a wrong key fails every request); any other status fails the
  request at once (retrying cannot fix a 400).
- `SampleFailed`: a request failed for good; the stage records its sample as failed and goes on.
- `OpenAIClient`: one client over one or several servers, called from threads (`request`) or from
  an event loop (`arequest`), the same rule either way.
- Streamed replies (`arequest(stream=True)`: server-sent events, OpenAI's `stream: true`): bounded by progress, not
  by their total time. An attempt is cut when no data came for the client's timeout (the wait for the
  first event included); a reply that keeps coming may take as long as it takes. A request whose last
  attempt was cut so is `SampleFailed.timed_out`.

An API key goes in the Authorization header only. Every error text the client raises has the key
replaced by `***` first, so it never reaches a log line, a failures file or a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import httpx

from draftsmith import DraftsmithError
from draftsmith.redact import redact_secrets, register_secret, scrub

RETRY_STATUS = {408, 409, 425, 429} | set(range(500, 600))
FATAL_STATUS = {401, 403}  # a wrong or missing key fails every request: stop at once
MAX_BACKOFF_S = 30.0
CONNECT_TIMEOUT_S = 30.0  # at most; a refused connection fails at once anyway


def normalize_server(url: str, field: str) -> str:
    """`http://host:8000` and `http://host:8000/v1/` both mean `http://host:8000/v1`; `field`
    names the config key in the error."""
    url = url.strip().rstrip("/")
    if not re.match(r"^https?://", url):
        raise DraftsmithError(f"{field}: {url!r} is not an http(s) URL")
    if re.match(r"^https?://[^/]+$", url):
        url += "/v1"
    return url


def root_url(server: str) -> str:
    """Where vLLM's own endpoints (/health, /metrics, /version) are, from a base URL (.../v1)."""
    return server.removesuffix("/v1")


def health_ok(root: str, timeout_s: float, client: httpx.Client | None = None) -> bool:
    """Whether the server at `root` answers GET /health with 200 (vLLM's liveness check)."""
    try:
        return (client or httpx).get(root + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def redact(text: str, secret: str | None) -> str:
    """`text` with `secret` replaced by *** in every encoding a reply could carry it in (draftsmith/redact.py), and
    with anything shaped like a credential (a Bearer token, an sk- key) replaced as well."""
    return scrub(redact_secrets(text, secret))


def backoff_delay(attempt: int, base_s: float, retry_after: str | None = None) -> float:
    """Seconds to wait before retry number `attempt` (1-based): base * 2^(attempt-1), jittered
    by x0.5-1.5 so that many clients do not retry in lockstep; a server's Retry-After wins."""
    if retry_after:
        try:
            return min(MAX_BACKOFF_S, max(0.0, float(retry_after)))
        except ValueError:
            pass  # an HTTP date instead of seconds: use our own delay
    return min(MAX_BACKOFF_S, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)


@contextlib.contextmanager
def _signals_unwrapped():
    """A Ctrl-C or SIGTERM (draftsmith.Terminated) raised while httpx's async client opens a connection comes out
    of anyio's connect, a task group, wrapped in an exception group: the command would end with a traceback, and its
    stage as failed rather than interrupted. Re-raise the interruption itself (streamed requests open connections
    often: a server that ends each stream by closing it)."""
    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        group = [e]
        while group:
            inner = getattr(group.pop(), "exceptions", None) or ()
            for x in inner:
                if isinstance(x, KeyboardInterrupt):
                    raise x from None
                group.append(x)
        raise


class SampleFailed(Exception):
    """A request failed for good (out of retries, or an answer retrying cannot fix); the stage
    records its sample as failed and goes on. `attempts`: requests sent for it (0: none could be);
    `turn`: the user turn (0-based) a generate conversation failed at; `timed_out`: its last attempt
    was cut for time (no reply, or no more of a streamed one, within the timeout)."""

    def __init__(self, error: str, attempts: int = 1, turn: int = 0, timed_out: bool = False):
        super().__init__(error)
        self.error, self.attempts, self.turn, self.timed_out = error, attempts, turn, timed_out


class BadReply(Exception):
    """Raised by a caller's `parse`: a 200 reply it cannot use (a cut message, states that fail
    validation). Retried like a server error."""


class ServersDown(DraftsmithError):
    """Every server is marked down: stop (what is done is kept; a rerun resumes)."""


# -------------------------------------------------------------------------------------------------
# Which server gets the next request


class Balancer:
    """Send each request to the server with the fewest requests in flight (round-robin on ties).

    A server whose last request failed (refused, dropped, timed out, 5xx...) within the past
    FAILING_S seconds goes last: one that went away answers at once with an error, so "fewest
    in flight" alone would keep sending it the requests, and their retries, while another server
    is up. A retry also avoids the server that just failed it when there is another. A server
    marked down (`mark_down`: it failed a health check) gets no request until its time is up;
    when all are down, `acquire` raises ServersDown. Thread-safe (extract calls it from threads).
    """

    FAILING_S = 5.0

    def __init__(self, servers: list[str]):
        self.servers = list(servers)
        self.inflight = dict.fromkeys(self.servers, 0)
        self.sent = dict.fromkeys(self.servers, 0)
        self.failed_at = dict.fromkeys(self.servers, float("-inf"))  # time.monotonic() seconds
        self.down_until = dict.fromkeys(self.servers, float("-inf"))
        self._next = 0
        self._lock = threading.Lock()

    def acquire(self, avoid: str | None = None) -> str:
        with self._lock:
            now = time.monotonic()
            up = [s for s in self.servers if self.down_until[s] <= now]
            if not up:
                raise ServersDown(f"no server answers any more ({', '.join(self.servers)})")
            n = len(up)
            order = [up[(self._next + i) % n] for i in range(n)]
            self._next = (self._next + 1) % n
            s = min([x for x in order if x != avoid] or order,
                    key=lambda x: (now - self.failed_at[x] < self.FAILING_S, self.inflight[x]))
            self.inflight[s] += 1
            self.sent[s] += 1
            return s

    def release(self, s: str, failed: bool = False) -> None:
        with self._lock:
            self.inflight[s] -= 1
            if failed:
                self.failed_at[s] = time.monotonic()

    def mark_down(self, s: str, seconds: float) -> bool:
        """Leave `s` out for `seconds`; False when it already was (one outage, one log line)."""
        with self._lock:
            now = time.monotonic()
            if self.down_until[s] > now:
                return False
            self.down_until[s] = now + seconds
            return True

    def in_flight(self) -> int:
        with self._lock:
            return sum(self.inflight.values())


# -------------------------------------------------------------------------------------------------
# The client


@dataclass
class _Outcome:
    """What one attempt came to: a value, or an error and whether another attempt may help."""

    ok: bool
    value: Any = None
    error: str = ""
    retry: bool = False
    retry_after: str | None = None  # a 429's Retry-After header
    no_answer: bool = False  # refused, dropped or timed out: the server itself may be gone
    timed_out: bool = False  # no (more) reply within the timeout


_RAISED = _Outcome(ok=False)  # the attempt raised (a fatal error): the server is not to blame


def served_models(server: str, data: dict) -> list[dict]:
    """`parse` for GET /models: the models a server serves, each a dict with an `id` (vLLM adds
    `max_model_len`); the first is what requests name by default."""
    models = data.get("data", [])
    if not isinstance(models, list):
        raise BadReply("/models: no `data` list")
    return [m for m in models if isinstance(m, dict) and m.get("id")]


class OpenAIClient:
    """Requests to OpenAI-compatible servers given by base URL (see normalize_server), retried by
    the rule in the module doc and spread by a Balancer.

    From threads: `request()`; from an event loop: `await arequest()` (its httpx client is made on
    first use, in that loop). timeout_s: per request (from an event loop a deadline for the whole
    request, where httpx's read timeout is per read); for a streamed reply (`arequest(stream=True)`)
    the longest wait for the next piece of the stream, not a bound on the whole reply.
    concurrency: how many requests the caller keeps in flight (sizes the connection pool). api_key:
    sent as `Authorization: Bearer`;
    api_key_env, the variable it came from, is what a 401/403 error names. on_no_answer(server):
    called after an attempt of a balanced request (no `server=` given) that the server did not
    answer (refused, dropped, timed out): extract checks the server's health there and may mark
    it down.
    """

    def __init__(self, servers: list[str], *, timeout_s: float, retries: int = 0, backoff_s: float = 0.5,
                 concurrency: int = 1, api_key: str | None = None, api_key_env: str | None = None,
                 on_no_answer: Callable[[str], None] | None = None):
        self.servers = list(servers)
        self.balancer = Balancer(self.servers)
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.api_key_env = api_key_env
        self.on_no_answer = on_no_answer
        self.retried = 0  # attempts sent again, over all requests
        self.closing = False  # set by close(): no new attempt starts
        self._api_key = api_key
        register_secret(api_key)  # from here on, nothing this process writes or prints holds it (redact.py)
        n = concurrency + len(self.servers)
        self._options = dict(headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                             timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, CONNECT_TIMEOUT_S)),
                             limits=httpx.Limits(max_connections=n, max_keepalive_connections=n))
        self._sync = httpx.Client(**self._options)
        self._async: httpx.AsyncClient | None = None
        self._count_lock = threading.Lock()

    def scrub(self, text: str) -> str:
        """Error texts are stored and logged: never with the key in them (see redact)."""
        return redact(text, self._api_key)

    # -- one request, retried ------------------------------------------------------------------
    def request(self, method: str, path: str, body: dict | Callable[[str], dict] | None = None, *,
                server: str | None = None, parse: Callable[[str, dict], Any] | None = None,
                timeout_s: float | None = None) -> tuple[Any, int]:
        """(parse(server, JSON reply), or the reply itself; attempts) of `method path` on
        `server`, or on the server the balancer picks (another one for a retry when there is one).
        `body(server)` when the body depends on the server (its model name). Raises SampleFailed
        when out of retries or on an answer retrying cannot fix, DraftsmithError on 401/403 and
        whatever `parse` raises besides BadReply."""
        attempt, s = 0, None
        while True:
            attempt += 1
            s = self._start(server, s, attempt)
            outcome = _RAISED
            try:
                outcome = self._send(s, method, path, body, parse, timeout_s)
            finally:
                self._end(server, s, outcome)
            if outcome.ok:
                return outcome.value, attempt
            time.sleep(self._retry_delay(s, attempt, outcome, balanced=server is None))

    async def arequest(self, method: str, path: str, body: dict | Callable[[str], dict] | None = None, *,
                       server: str | None = None, parse: Callable[[str, Any], Any] | None = None,
                       stream: bool = False) -> tuple[Any, int]:
        """`request` for an event loop; the same rule, the same results.

        stream=True: a streamed reply (`body` asks for one: `stream: true`), read as server-sent
        events; `parse(server, events)` gets the JSON object of each `data:` line, in order, up to
        `data: [DONE]`. An event holding `error` (vLLM's way to fail a request once its stream has
        begun) and a stream that ends without [DONE] are retried like a 5xx. An attempt is cut when
        no data came for timeout_s (see the class doc): SampleFailed.timed_out when it was the last."""
        if self._async is None:
            self._async = httpx.AsyncClient(**self._options)
        attempt, s = 0, None
        while True:
            attempt += 1
            s = self._start(server, s, attempt)
            outcome = _RAISED
            try:
                outcome = await (self._astream(s, method, path, body, parse) if stream
                                 else self._asend(s, method, path, body, parse))
            finally:
                self._end(server, s, outcome)
            if outcome.ok:
                return outcome.value, attempt
            await asyncio.sleep(self._retry_delay(s, attempt, outcome, balanced=server is None))

    def _send(self, s: str, method: str, path: str, body, parse, timeout_s: float | None) -> _Outcome:
        try:
            r = self._sync.request(method, s + path, json=body(s) if callable(body) else body,
                                   timeout=httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s)
        except httpx.TransportError as e:  # includes httpx's timeouts
            return self._judge_error(s, e, timeout_s or self.timeout_s)
        return self._judge_reply(s, r, parse)

    async def _asend(self, s: str, method: str, path: str, body, parse) -> _Outcome:
        request = self._async.request(method, s + path, json=body(s) if callable(body) else body)
        try:
            # one deadline for the whole request (httpx's read timeout is per read). asyncio.timeout where it
            # exists (3.11+): Python 3.11's wait_for loses a cancellation that lands as the request completes,
            # so a Ctrl-C (asyncio.run cancels the main task) was swallowed and generate finished with exit 0
            with _signals_unwrapped():
                if hasattr(asyncio, "timeout"):
                    async with asyncio.timeout(self.timeout_s):
                        r = await request
                else:  # pragma: no cover - Python 3.10
                    r = await asyncio.wait_for(request, self.timeout_s)
        except (asyncio.TimeoutError, httpx.TransportError) as e:
            return self._judge_error(s, e, self.timeout_s)
        return self._judge_reply(s, r, parse)

    async def _astream(self, s: str, method: str, path: str, body, parse) -> _Outcome:
        events: list[dict] = []
        try:
            # httpx's read timeout bounds each read, the response's head included: the idle time, not the total
            with _signals_unwrapped():
                r = await self._async.send(self._async.build_request(method, s + path,
                                                                     json=body(s) if callable(body) else body),
                                           stream=True)
            async with contextlib.aclosing(r):
                if r.status_code != 200:
                    await r.aread()
                    return self._judge_reply(s, r, parse)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, `:` comments, `event:` names
                    data = line[len("data:"):].strip()
                    if data == "[DONE]":
                        break
                    try:
                        event = json.loads(data)
                        if not isinstance(event, dict):
                            raise ValueError("not a JSON object")
                    except ValueError as e:
                        return _Outcome(ok=False, error=f"malformed stream event from {s}: {e}", retry=True)
                    if event.get("error"):
                        err = self.scrub(f"error event from {s}: {json.dumps(event['error'])}")[:400]
                        return _Outcome(ok=False, error=err, retry=True)
                    events.append(event)
                else:
                    return _Outcome(ok=False, error=f"stream from {s} ended without [DONE] after {len(events)} events",
                                    retry=True)
        except httpx.TransportError as e:  # includes httpx's timeouts
            out = self._judge_error(s, e, self.timeout_s)
            if out.timed_out:
                out.error = f"no data for {self.timeout_s:g}s after {len(events)} stream events ({s})"
            return out
        try:
            return _Outcome(ok=True, value=parse(s, events))
        except BadReply as e:
            return _Outcome(ok=False, error=f"{e} ({s})", retry=True)

    # -- the rule ------------------------------------------------------------------------------
    def _start(self, server: str | None, previous: str | None, attempt: int) -> str:
        if self.closing:
            raise SampleFailed("the client was closed", attempt - 1)
        return server or self.balancer.acquire(avoid=previous)

    def _end(self, server: str | None, s: str, outcome: _Outcome) -> None:
        if server is None:  # a request to a named server was not counted by the balancer
            self.balancer.release(s, failed=outcome.retry)

    def _judge_reply(self, s: str, r: httpx.Response, parse) -> _Outcome:
        if r.status_code == 200:
            try:
                data = r.json()
                if not isinstance(data, dict):
                    raise ValueError("not a JSON object")
            except ValueError as e:  # json.JSONDecodeError is a ValueError: a reply cut short
                return _Outcome(ok=False, error=f"malformed reply from {s}: {e}", retry=True)
            try:
                return _Outcome(ok=True, value=parse(s, data) if parse else data)
            except BadReply as e:
                return _Outcome(ok=False, error=f"{e} ({s})", retry=True)
        # Scrub before cutting: a cut could leave a piece of the key that no longer matches.
        err = self.scrub(f"HTTP {r.status_code} from {s}: {' '.join(r.text.split())}")[:400]
        if r.status_code in FATAL_STATUS:
            raise DraftsmithError(err + (f" (check the API key in ${self.api_key_env})" if self.api_key_env else ""))
        return _Outcome(ok=False, error=err, retry=r.status_code in RETRY_STATUS,
                        retry_after=r.headers.get("retry-after") if r.status_code == 429 else None)

    def _judge_error(self, s: str, e: Exception, timeout_s: float) -> _Outcome:
        timed_out = isinstance(e, (asyncio.TimeoutError, httpx.TimeoutException))
        err = f"timeout after {timeout_s:g}s ({s})" if timed_out else f"{type(e).__name__} ({s}): {e}"
        return _Outcome(ok=False, error=err, retry=True, no_answer=True, timed_out=timed_out)

    def _retry_delay(self, s: str, attempt: int, outcome: _Outcome, balanced: bool) -> float:
        """Seconds before the next attempt; SampleFailed when there is to be none."""
        if outcome.no_answer and balanced and self.on_no_answer is not None:
            self.on_no_answer(s)
        if not outcome.retry or attempt > self.retries:
            raise SampleFailed(self.scrub(outcome.error), attempt, timed_out=outcome.timed_out)
        with self._count_lock:
            self.retried += 1
        return backoff_delay(attempt, self.backoff_s, outcome.retry_after)

    # -- vLLM's endpoints beside /v1 ---------------------------------------------------------------
    def get_root(self, server: str, path: str, timeout_s: float = 30.0) -> httpx.Response | None:
        """GET one of vLLM's own endpoints (/metrics, /version) of `server`, once: the response,
        or None when the server did not answer."""
        try:
            return self._sync.get(root_url(server) + path, timeout=timeout_s)
        except httpx.HTTPError:
            return None

    def healthy(self, server: str, timeout_s: float = 10.0) -> bool:
        return health_ok(root_url(server), timeout_s, self._sync)

    # -- closing -------------------------------------------------------------------------------
    def close(self, wait_s: float = 0.0) -> None:
        """Start no new attempt; let the requests in flight finish for up to `wait_s` seconds;
        close the connections."""
        self.closing = True
        deadline = time.monotonic() + wait_s
        while self.balancer.in_flight() and time.monotonic() < deadline:
            time.sleep(0.02)
        self._sync.close()

    async def aclose(self) -> None:
        self._sync.close()
        if self._async is not None:
            await self._async.aclose()
