"""The one place that keeps credentials out of everything draftsmith writes or prints.

Two rules, applied where text leaves the process:
- `scrub(text)`, for logs, errors, journals and tracebacks: anything shaped like a credential whatever its value
  (an Authorization header's token, an `sk-` key, a URL's user:password), and every registered secret.
- `redact_secrets(text)`, for data files (samples, failures, manifests, reports, configs: rundir's text writers):
  the registered secrets only, so that an answer that merely looks like a key (code with `Bearer x`) stays as the
  target wrote it.

A secret is registered (`register_secret`) where draftsmith reads it (the API key of generate.api_key_env, in the
HTTP client; every secret a config holds, `register_config_secrets`: a URL's user:password, an argument named like a
key such as `--api-key X` in a server's argument list), and then matched in every encoding a server could echo it in:
as itself, with any of its characters escaped (backslashes, \\uXXXX, %XX, `+` for a space, HTML's `&#NN;`, `&#xHH;`
and `&amp;`-style entities), its characters one at a time (a short run of punctuation or white space between each:
spaced, one per line, a JSON array of characters), base64 and base64url at each byte alignment, base32 at each, hex of
its UTF-8 and of its UTF-16 (either byte order) in either case, and reversed (in each of those forms). Nothing here
imports anything of draftsmith.
"""

from __future__ import annotations

import base64
import re
import threading
import urllib.parse

# What looks like a credential whatever its value: an Authorization header's token, an OpenAI-style
# key, the user:password of a URL (http://user:key@host/v1 in generate.servers).
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=\\%-]{6,}")
_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_\\/%+=-]{12,}")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")

_B64_RUN = r"[A-Za-z0-9+/_=\\-]*"  # a base64 or base64url run, `/` possibly JSON-escaped as `\/`
_B64_MIN_CORE = 8  # a shorter core would match unrelated base64 text
MIN_SECRET_CHARS = 4  # a shorter "secret" would redact ordinary text; such a key is not a key
# Its characters one at a time: at most this many characters of punctuation or white space between two of them
# (`s k - 1`, one per line, `["s", "k"]`); only for secrets this long, where ordinary text cannot spell one by chance.
_SPACED_GAP = r"[^A-Za-z0-9]{0,8}"
_SPACED_MIN_CHARS = 8
_HTML_NAMED = {"&": "amp", "<": "lt", ">": "gt", '"': "quot", "'": "apos"}

_lock = threading.Lock()
_patterns: dict[str, list[re.Pattern]] = {}  # secret -> the patterns of its encodings


def _char_pattern(secret: str) -> str:
    """The secret's characters, each as itself, escaped by any number of backslashes (JSON writing a slash as
    backslash-slash, an escape of an escape), as a backslash-u escape, percent-encoded (URL, form: `+` for a
    space) or as an HTML entity; hex digits in either case (the pattern is compiled ignoring case); for a secret of
    _SPACED_MIN_CHARS or more, a short run of punctuation or white space allowed between two characters."""
    parts = []
    for ch in secret:
        # HTML entities: decimal and hex character references, any leading zeros, and the named ones
        forms = [re.escape(ch), f"u{ord(ch):04x}", f"&#0*{ord(ch)};", f"&#x0*{ord(ch):x};"]
        if ord(ch) < 128:
            forms.append(f"%{ord(ch):02x}")
        if ch == " ":
            forms.append(r"\+")
        if ch in _HTML_NAMED:
            forms.append(f"&{_HTML_NAMED[ch]};")
        parts.append(r"\\*(?:" + "|".join(forms) + ")")
    return (_SPACED_GAP if len(secret) >= _SPACED_MIN_CHARS else "").join(parts)


def _base32_pattern(secret: str) -> re.Pattern | None:
    """The secret base32-encoded inside any text, as `_base64_pattern` does for base64: at each of the five byte
    alignments of a 5-byte group, the characters only the secret's bytes decide (either case)."""
    raw, cores = secret.encode(), []
    for k in range(5):
        enc = base64.b32encode(b"\0" * k + raw + b"\0" * 4).decode()
        core = enc[-(-8 * k // 5): (8 * (k + len(raw))) // 5]  # chars whose 5 bits are all the secret's
        if len(core) >= _B64_MIN_CORE:
            cores.append(core)
    if not cores:
        return None
    return re.compile("(?:" + "|".join(map(re.escape, dict.fromkeys(cores))) + ")", re.IGNORECASE)


def _base64_pattern(secret: str) -> re.Pattern | None:
    """The secret base64- or base64url-encoded inside any text (`Bearer <key>`, a whole header):
    at each of the three byte alignments, the characters that only the secret's bytes decide, and
    the whole base64 run around them; None for a secret too short to tell apart."""
    raw, cores = secret.encode(), []
    for k in range(3):  # the secret starts k bytes into a 3-byte group of the encoded text
        enc = base64.b64encode(b"\0" * k + raw + b"\0\0").decode()
        core = enc[-(-8 * k // 6): (8 * (k + len(raw))) // 6]  # chars whose 6 bits are all the secret's
        if len(core) >= _B64_MIN_CORE:
            cores += [core, core.translate(str.maketrans("+/", "-_"))]
    if not cores:
        return None
    alternatives = ("".join(r"\\*/" if c == "/" else re.escape(c) for c in core) for core in dict.fromkeys(cores))
    return re.compile(_B64_RUN + "(?:" + "|".join(alternatives) + ")" + _B64_RUN)


def secret_patterns(secret: str) -> list[re.Pattern]:
    """Every pattern `secret` is matched by (module doc): the secret and its reverse, each as characters (with
    escapes), base64/base64url and hex."""
    out = []
    for s in dict.fromkeys((secret, secret[::-1])):
        out.append(re.compile(_char_pattern(s), re.IGNORECASE))
        out += [p for p in (_base64_pattern(s), _base32_pattern(s)) if p is not None]
        for codec in ("utf-8", "utf-16-be", "utf-16-le"):
            out.append(re.compile(re.escape(s.encode(codec, "surrogatepass").hex()), re.IGNORECASE))
    return out


def register_secret(secret: str | None) -> None:
    """Redact `secret` from everything written or printed from now on, in this process (module doc)."""
    if not secret or len(secret) < MIN_SECRET_CHARS:
        return
    with _lock:
        if secret not in _patterns:
            _patterns[secret] = secret_patterns(secret)


# A secret in a config: an argument whose name ends like one (`--api-key`, `--hf-token=...`, `--password`,
# `--client-secret`; not `--tokenizer` or `--max-num-batched-tokens`), and a URL's userinfo.
_SECRET_ARG = re.compile(r"(?i)^-{1,2}(?:[a-z0-9]+[-_.])*(?:key|token|secret|password|passwd|credentials?)$")
_URL_CREDENTIALS = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://([^/\s@]+)@")


def config_secrets(value) -> list[str]:
    """The secrets a config's values hold (nested dicts and lists of strings): the password of every URL's
    `user:password@` (the user when it stands alone: a token given as the user name), and the value of every argument
    named like a secret in a list of arguments (`["--api-key", "X"]`, `["--hf-token=X"]`); each also URL-decoded."""
    out: list[str] = []
    if isinstance(value, dict):
        for v in value.values():
            out += config_secrets(v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            out += config_secrets(v)
            if isinstance(v, str) and v.startswith("-"):
                name, eq, arg = v.partition("=")
                if _SECRET_ARG.match(name):
                    if eq:
                        out.append(arg)
                    elif i + 1 < len(value) and isinstance(value[i + 1], str) and not value[i + 1].startswith("-"):
                        out.append(value[i + 1])
    elif isinstance(value, str):
        for m in _URL_CREDENTIALS.finditer(value):
            user, _, password = m.group(1).partition(":")
            out.append(password or user)
    return list(dict.fromkeys(x for s in out if s for x in (s, urllib.parse.unquote(s))))


def register_config_secrets(value) -> None:
    """Register every secret `value` (a config as plain data) holds (config_secrets): from then on no file, log or
    tracker this process writes holds one, and what a config file records shows where one was set (`***`)."""
    for s in config_secrets(value):
        register_secret(s)


def redact_tree(value):
    """`value` (nested dicts, lists and strings: a config handed to a tracker) with redact_secrets and the URL
    userinfo rule applied to every string, keys included."""
    if isinstance(value, dict):
        return {redact_tree(k): redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_tree(v) for v in value]
    if isinstance(value, str):
        return _URL_USERINFO.sub(r"\1***@", redact_secrets(value))
    return value


def has_secrets() -> bool:
    return bool(_patterns)


def redact_secrets(text: str, secret: str | None = None) -> str:
    """`text` with every registered secret (and `secret`, when given) replaced by *** in each of its encodings."""
    pats = [p for ps in list(_patterns.values()) for p in ps]
    if secret and secret not in _patterns and len(secret) >= MIN_SECRET_CHARS:
        pats += secret_patterns(secret)
    for p in pats:
        text = p.sub("***", text)
    return text


def scrub(text: str) -> str:
    """`text` with anything shaped like a credential, and every registered secret, replaced by ***: applied to
    every log line, error line and traceback draftsmith writes or prints."""
    if _patterns:
        text = redact_secrets(text)
    return _URL_USERINFO.sub(r"\1***@", _KEY_LIKE.sub("***", _BEARER.sub(r"\1***", text)))
