"""The one place that keeps credentials out of everything draftsmith writes or prints.

Two rules, applied where text leaves the process:
- `scrub(text)`, for logs, errors, journals and tracebacks: anything shaped like a credential whatever its value
  (an Authorization header's token, an `sk-` key, a URL's user:password), and every registered secret.
- `redact_secrets(text)`, for data files (samples, failures, manifests, reports, configs: rundir's text writers):
  the registered secrets only, so that an answer that merely looks like a key (code with `Bearer x`) stays as the
  target wrote it.

A secret is registered (`register_secret`) where draftsmith reads it (the API key of generate.api_key_env, in the
HTTP client), and then matched in every encoding a server could echo it in: as itself, with any of its characters
escaped (backslashes, \\uXXXX, %XX, `+` for a space), base64 and base64url at each byte alignment, hex in either
case, and reversed (in each of those forms). Nothing here imports anything of draftsmith.
"""

from __future__ import annotations

import base64
import re
import threading

# What looks like a credential whatever its value: an Authorization header's token, an OpenAI-style
# key, the user:password of a URL (http://user:key@host/v1 in generate.servers).
_BEARER = re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=\\%-]{6,}")
_KEY_LIKE = re.compile(r"\bsk-[A-Za-z0-9_\\/%+=-]{12,}")
_URL_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s@]+@")

_B64_RUN = r"[A-Za-z0-9+/_=\\-]*"  # a base64 or base64url run, `/` possibly JSON-escaped as `\/`
_B64_MIN_CORE = 8  # a shorter core would match unrelated base64 text
MIN_SECRET_CHARS = 4  # a shorter "secret" would redact ordinary text; such a key is not a key

_lock = threading.Lock()
_patterns: dict[str, list[re.Pattern]] = {}  # secret -> the patterns of its encodings


def _char_pattern(secret: str) -> str:
    """The secret's characters, each as itself, escaped by any number of backslashes (JSON writing a slash as
    backslash-slash, an escape of an escape), as a backslash-u escape, or percent-encoded (URL, form: `+` for a
    space); hex digits in either case (the pattern is compiled ignoring case)."""
    parts = []
    for ch in secret:
        forms = [re.escape(ch), f"u{ord(ch):04x}"]
        if ord(ch) < 128:
            forms.append(f"%{ord(ch):02x}")
        if ch == " ":
            forms.append(r"\+")
        parts.append(r"\\*(?:" + "|".join(forms) + ")")
    return "".join(parts)


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
        if (b64 := _base64_pattern(s)) is not None:
            out.append(b64)
        out.append(re.compile(re.escape(s.encode("utf-8", "surrogatepass").hex()), re.IGNORECASE))
    return out


def register_secret(secret: str | None) -> None:
    """Redact `secret` from everything written or printed from now on, in this process (module doc)."""
    if not secret or len(secret) < MIN_SECRET_CHARS:
        return
    with _lock:
        if secret not in _patterns:
            _patterns[secret] = secret_patterns(secret)


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
