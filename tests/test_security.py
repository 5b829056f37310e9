"""Security (docs/reliability.md, "Security"): no pickle, `torch.load` only with weights_only=True,
trust_remote_code off unless asked (and logged when on), API keys never in a file, log or
message."""

from __future__ import annotations

import ast
import base64
import html
import json
import urllib.parse
import os
import secrets
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, build_tiny_target, run_cli
from draftsmith.config import Config
from draftsmith.rundir import RunDir

sys.path.insert(0, str(Path(__file__).parent))
from openai_fakes import FakeOpenAIServer  # noqa: E402

SOURCES = sorted((REPO / "draftsmith").rglob("*.py"))


# -------------------------------------------------------------------------------------------------
# (a) a static scan of draftsmith's own sources


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else "?"


def _kw(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def test_no_pickle_and_torch_load_only_with_weights_only():
    torch_loads, problems = 0, []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        where = lambda n: f"{path.relative_to(REPO)}:{n.lineno}"  # noqa: E731
        for node in ast.walk(tree):
            # modules that unpickle (or run) arbitrary data
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
                bad = {n.split(".")[0] for n in names} & {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve"}
                if bad:
                    problems.append(f"{where(node)}: imports {', '.join(sorted(bad))}")
                if isinstance(node, ast.ImportFrom) and node.module == "torch" and "load" in [a.name for a in node.names]:
                    problems.append(f"{where(node)}: `from torch import load` hides torch.load from this check")
        for call in _calls(tree):
            name = _dotted(call.func)
            if name == "torch.load":
                torch_loads += 1
                wo = _kw(call, "weights_only")
                if not (isinstance(wo, ast.Constant) and wo.value is True):
                    problems.append(f"{where(call)}: torch.load without weights_only=True")
            elif name in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                problems.append(f"{where(call)}: {name} (use yaml.safe_load)")
            elif name.endswith(".load") and isinstance(_kw(call, "allow_pickle"), ast.Constant) and _kw(call, "allow_pickle").value:
                problems.append(f"{where(call)}: {name}(allow_pickle=True)")
            elif name in ("eval", "exec"):
                problems.append(f"{where(call)}: {name}()")
    assert not problems, "\n".join(problems)
    assert torch_loads >= 1  # the scan sees the calls it checks (train's optimizer state on resume)


def test_trust_remote_code_only_from_the_config():
    assert Config().trust_remote_code is False
    passed, problems = 0, []
    for path in SOURCES:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                value = _kw(node, "trust_remote_code")
                if value is None:
                    continue
                passed += 1
                # a variable that comes down from cfg.trust_remote_code, never a literal True
                if isinstance(value, ast.Constant) and value.value is not False:
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: trust_remote_code={value.value!r}")
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) + node.args.defaults + node.args.kw_defaults
                for a, d in zip(args, defaults):
                    if a.arg == "trust_remote_code" and not (isinstance(d, ast.Constant) and d.value is False):
                        problems.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.name}(trust_remote_code) must default to False")
    assert not problems, "\n".join(problems)
    assert passed >= 4


# -------------------------------------------------------------------------------------------------
# (b) trust_remote_code: off by default (the folder's code does not run), logged when on


REMOTE_CONFIG = '''
import os, pathlib
pathlib.Path(os.environ["DS_REMOTE_MARKER"]).write_text("the target folder's code ran")
from transformers import LlamaConfig

class RemoteConfig(LlamaConfig):
    model_type = "draftsmith-remote-test"
'''


@pytest.fixture(scope="module")
def remote_code_target(tmp_path_factory) -> Path:
    """A tiny target whose config class lives in the folder itself (auto_map), and writes a
    marker file when Python imports it."""
    path = build_tiny_target(tmp_path_factory.mktemp("remote") / "remote-target", num_layers=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "draftsmith-remote-test"
    cfg["auto_map"] = {"AutoConfig": "configuration_remote.RemoteConfig"}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    return path


def test_remote_code_runs_only_when_asked_and_is_logged(remote_code_target, tmp_path):
    run = RunDir(tmp_path / "run").ensure()
    d = run.stage_dir("generate")
    conv = {"id": "s0", "messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there."}]}
    (d / "samples.jsonl").write_text(json.dumps(conv) + "\n")
    # (no target fingerprint: computing one here would run the folder's code in this process)
    run.write_manifest("generate", fingerprint="g", inputs={}, settings={}, counts={"done": 1, "total": 1, "unit": "samples"},
                       started=time.time())
    marker = tmp_path / "marker"
    args = ["prepare", "--run", str(run.path), "--set", f"target={remote_code_target}"]

    off = run_cli(*args, env={"DS_REMOTE_MARKER": str(marker)})
    assert off.returncode == 2 and not marker.exists()
    assert off.stderr.count("\n") == 1 and "Traceback" not in off.stderr
    assert "remote-target/config.json: the model needs Python code from its own folder" in off.stderr
    assert "set trust_remote_code=true" in off.stderr

    on = run_cli(*args, "--set", "trust_remote_code=true", env={"DS_REMOTE_MARKER": str(marker)})
    assert on.returncode == 0, on.stderr
    assert marker.exists()
    assert on.stdout.count(f"trust_remote_code is ON: Python code from {remote_code_target} may run") == 1
    assert "trust_remote_code: true" in (run.path / "prepare" / "config.yaml").read_text()


# -------------------------------------------------------------------------------------------------
# (c) API keys


class EchoingServer(FakeOpenAIServer):
    """Also answers prompts with [echo-500] with a 500 that quotes the request headers (retried,
    then recorded as a failure and logged), and [echo-escaped] with one that quotes the key the
    ways other servers write it: JSON with `/` escaped as `\\/`, URL-encoded, \\u-escaped."""

    def answer(self, body: dict, headers: dict):
        text = body["messages"][-1]["content"]
        if "[echo-500]" in text:
            return 500, {"error": {"message": f"internal error; request headers were {headers}"}}
        if "[echo-escaped]" in text:
            auth = headers.get("Authorization", "")
            escaped = json.dumps(auth).replace("/", "\\/")
            uni = "".join(f"\\u{ord(c):04x}" for c in auth)
            return 500, {"error": {"message": f"auth {escaped}; query ?auth={urllib.parse.quote(auth, safe='')}; {uni}"}}
        key = headers.get("Authorization", "").removeprefix("Bearer ")
        if "[echo-hex]" in text:  # the key as hex (both cases) and reversed, in an error
            return 500, {"error": {"message": f"trace {key.encode().hex()} {key.encode().hex().upper()} "
                                              f"rev {key[::-1]}"}}
        if "[echo-200]" in text:  # a successful answer that carries the key: stored as the target's text
            reply = super().answer(body, headers)
            reply[1]["choices"][0]["message"]["content"] += f" key {key} hex {key.encode().hex()} rev {key[::-1]}"
            return reply
        if "[echo-b64]" in text:  # the header and the key alone, base64 and base64url, inside more text
            auth = headers.get("Authorization", "")
            key = auth.removeprefix("Bearer ")
            return 500, {"error": {"message": "bad auth", "auth_b64": base64.b64encode(auth.encode()).decode(),
                                   "key_b64": base64.b64encode(key.encode()).decode(),
                                   "key_b64url": base64.urlsafe_b64encode(("id:" + key).encode()).decode().rstrip("=")}}
        return super().answer(body, headers)


def _prompts(path: Path, extra: list[str]) -> Path:
    texts = [f"question {i}" for i in range(4)] + extra
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                            for i, t in enumerate(texts)))
    return path


def test_api_key_never_in_files_logs_or_messages(tmp_path, tiny_target):
    # a key with the characters that JSON and URL encodings rewrite
    secret = "sk-test/" + secrets.token_hex(16) + "+k="
    wrong = "sk-wrong-" + secrets.token_hex(8)
    run = tmp_path / "run"
    prompts = _prompts(tmp_path / "p.jsonl", ["[bad-request] please", "[echo-500] please", "[echo-escaped] please",
                                              "[echo-b64] please", "[echo-hex] please"])
    base = ["generate", "--run", str(run), "--set", f"target={tiny_target}", "--prompts", str(prompts),
            "--backend", "openai", "--set", "generate.retries=1", "--set", "generate.backoff_s=0.01"]
    outputs = []

    # The key pasted where the variable's name belongs: refused without repeating it; nothing written.
    p = run_cli(*base, "--server", "http://127.0.0.1:9/v1", "--set", f"generate.api_key_env={secret}")
    outputs.append(p)
    assert p.returncode == 2 and "generate.api_key_env: must be the name of an environment variable" in p.stderr
    assert not run.exists()

    base += ["--set", "generate.api_key_env=DS_SECRET_KEY"]
    # the served model's id carries the key too (reversed): the manifest and samples record the model
    with EchoingServer(api_key=secret, model="model-" + secret[::-1]) as srv:
        base += ["--server", srv.base_url]
        # Two samples fail with server errors that quote the Authorization header.
        p = run_cli(*base, env={"DS_SECRET_KEY": secret})
        outputs.append(p)
        assert p.returncode == 2 and "5 samples failed" in p.stderr
        errors = {f["id"]: f["error"] for f in map(json.loads, (run / "generate" / "failures.jsonl").read_text().splitlines())}
        assert set(errors) == {"p4", "p5", "p6", "p7", "p8"} and all("Bearer ***" in errors[i] for i in ("p4", "p5"))
        assert errors["p6"].count("***") >= 3  # each encoding of the echoed key redacted
        assert errors["p7"].count("***") == 3 and "bad auth" in errors["p7"]  # the base64 forms too
        assert errors["p8"].count("***") == 3 and "trace" in errors["p8"]  # hex, HEX and reversed
        # A wrong key: one line naming the variable, not the key.
        p = run_cli(*base, "--retry-failed", env={"DS_SECRET_KEY": wrong})
        outputs.append(p)
        assert p.returncode == 2 and "HTTP 401" in p.stderr and "$DS_SECRET_KEY" in p.stderr
        # Without the bad prompts the stage completes; a 200 answer that carries the key is stored without it.
        _prompts(prompts, ["[echo-200] please"])
        p = run_cli(*base, env={"DS_SECRET_KEY": secret})
        outputs.append(p)
        assert p.returncode == 0, p.stderr
        assert all(r["headers"].get("Authorization") == f"Bearer {secret}" for r in srv.requests if r["body"])  # it was used
    outputs.append(run_cli("status", str(run)))

    assert (run / "generate" / "manifest.json").is_file()
    assert "api_key_env: DS_SECRET_KEY" in (run / "generate" / "config.yaml").read_text()  # the name only
    files = [f for f in run.rglob("*") if f.is_file()]
    assert {"config.yaml", "manifest.json", "stage.log", "progress.jsonl", "samples.jsonl"} <= {f.name for f in files}
    body = secret[len("sk-test/"):-len("+k=")]  # the key's random part: in no encoding anywhere
    answers = [json.loads(x) for x in (run / "generate" / "samples.jsonl").read_text().splitlines()]
    echoed = next(a for a in answers if "[echo-200]" in json.dumps(a))
    assert echoed["messages"][-1]["content"].count("***") == 3  # the answer kept, the key out of it
    hexes = [body.encode().hex()[4:-4], body[::-1]]  # the random part as hex, and reversed
    # the key's base64 forms: the middle of each encoding, which no surrounding bytes change
    b64 = [base64.b64encode(pad + secret.encode()).decode()[4:-4] for pad in (b"", b"x", b"xy")]
    b64 += [f.replace("+", "-").replace("/", "_") for f in b64]
    for f in files:
        data = f.read_bytes()
        assert body.encode() not in data.lower() and wrong.encode() not in data, f"API key leaked into {f}"
        assert not any(h.encode() in data.lower() for h in hexes), f"hex or reversed key leaked into {f}"
        assert not any(form.encode() in data.replace(b"\\/", b"/") for form in b64), f"base64 key leaked into {f}"
    for p in outputs:
        assert body not in (p.stdout + p.stderr).lower() and wrong not in p.stdout + p.stderr
        assert not any(h in (p.stdout + p.stderr).lower() for h in hexes)
        assert not any(form in p.stdout + p.stderr for form in b64)
    assert os.environ.get("DS_SECRET_KEY") is None  # the tests passed the key to the child processes only


def test_credentials_scrubbed_by_shape_from_every_log_and_error_line(tmp_path, capsys):
    """A key that draftsmith was never told is a key (a URL's user:password, a bearer token in a
    library error) is still kept out of logs and error lines, by its shape."""
    from draftsmith import one_line, scrub
    from draftsmith.progress import _current_log, log

    url = "http://alice:s3cr3t-pass@gpu-node:8000/v1"
    assert scrub(f"servers: {url}, http://127.0.0.1:8000/v1") == "servers: http://***@gpu-node:8000/v1, http://127.0.0.1:8000/v1"
    assert "s3cr3t" not in one_line(f"cannot reach {url}\nAuthorization: Bearer abcdef123456")
    assert "abcdef123456" not in one_line("Authorization: Bearer abcdef123456")
    stage_log = tmp_path / "stage.log"
    _current_log.append(stage_log)
    try:
        log(f"model m on 1 server(s): {url}", stage="generate")
    finally:
        _current_log.pop()
    assert "s3cr3t" not in stage_log.read_text() and "gpu-node:8000" in stage_log.read_text()
    assert "s3cr3t" not in capsys.readouterr().out


def test_a_registered_key_is_redacted_in_every_encoding_a_server_could_echo():
    """redact.py's encodings beyond the ones test_api_key_never_in_files_logs_or_messages sees through a server: HTML
    entities, base32 at every alignment and either case, UTF-16 hex, the characters one at a time (spaced, one per
    line, a JSON array of them) and reversed; and nothing of ordinary text."""
    from draftsmith.redact import redact_secrets, register_secret

    key = "sk-enc/" + secrets.token_hex(12) + "&<'"
    body = key[len("sk-enc/"):-3]
    register_secret(key)
    echoed = {
        "html decimal": "".join(f"&#{ord(c)};" for c in key),
        "html hex": "".join(f"&#x{ord(c):X};" for c in key),
        "html escaped": html.escape(f"<b>{key}</b>"),
        "spaced": " ".join(key), "one per line": "\n".join(key), "json array": json.dumps(list(key)),
        "reversed, spaced": " ".join(key[::-1]),
        "utf-16 hex": key.encode("utf-16-be").hex() + " " + key.encode("utf-16-le").hex().upper(),
        **{f"base32 at {k}": base64.b32encode(b"x" * k + key.encode()).decode() for k in range(5)},
        "base32, lower case": base64.b32encode(key.encode()).decode().lower(),
    }
    for name, form in echoed.items():
        out = redact_secrets(f"server said: {form} (end)")
        assert "***" in out and out.startswith("server said: ") and out.endswith(" (end)"), name
        for leak in (body, " ".join(body), body.encode().hex(), body.encode("utf-16-be").hex(),
                     base64.b32encode(body.encode()).decode()[2:-2]):
            assert leak.lower() not in out.lower(), (name, out)
    ordinary = "a b c d e f, [\"x\", \"y\"] &#65; QUJDREVGR0g= 0041004200430044 the quick brown fox"
    assert redact_secrets(ordinary) == ordinary


def test_secrets_a_config_holds_are_written_nowhere(tmp_path, tiny_target):
    """A password in a `generate.servers` URL and `--api-key X` in `generate.vllm_args`: the stage talks to the
    server with them, and no file of the run (config.yaml, manifest, samples, logs) holds either in any encoding;
    config.yaml shows where they were set (***)."""
    from draftsmith.redact import config_secrets

    assert config_secrets({"g": {"servers": ["http://u:p%40ss@h/v1", "https://tok123456@h"],
                                 "vllm_args": ["--api-key", "K1", "--hf-token=T2", "--port", "8000", "--x", "y",
                                               "--tokenizer", "/models/tok", "--max-num-batched-tokens", "8192",
                                               "--client-secret", "S3"]},
                           "n": 3}) == ["p%40ss", "p@ss", "tok123456", "K1", "T2", "S3"]
    password, api_key = "pw-" + secrets.token_hex(10), "vk-" + secrets.token_hex(10)
    run = tmp_path / "run"
    prompts = _prompts(tmp_path / "p.jsonl", [])
    with FakeOpenAIServer() as srv:
        url = srv.base_url.replace("http://", f"http://alice:{password}@")
        p = run_cli("generate", "--run", str(run), "--set", f"target={tiny_target}", "--prompts", str(prompts),
                    "--backend", "openai", "--server", url, "--set", f"generate.vllm_args=[--api-key, {api_key}]")
        assert p.returncode == 0, p.stderr
        assert srv.requests  # the URL with its credentials was used
    config = (run / "generate" / "config.yaml").read_text()
    assert "alice:***@" in config and "  - --api-key\n  - ***\n" in config
    for f in (x for x in run.rglob("*") if x.is_file()):
        data = f.read_bytes().lower()
        for s in (password, api_key):
            for form in (s, s.encode().hex(), s[::-1], base64.b64encode(s.encode()).decode()[2:-2].lower()):
                assert form.encode() not in data, f"{s} leaked into {f}"
    for s in (password, api_key):
        assert s not in p.stdout + p.stderr
