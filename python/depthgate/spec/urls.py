"""What an endpoint URL in a matrix may be (issue #37, item 6): checked where the matrix is read, so a
bad URL is exit 20 naming the field, never a traceback at the first request nor a secret on disk.

An endpoint is written to ``manifest.json``, ``suite.json``'s neighbours and every report, and sent on
every request; so it must be

* ``http`` or ``https`` with a host, and a port (when given) of ASCII digits in 1..65535 (``urlsplit``
  raises ``ValueError`` on ``:99999`` and ``:9 ``, and a Unicode digit is not a port a socket takes);
* free of credentials: no ``user:password@`` userinfo, no fragment (``#access_token=…``: a fragment is
  never sent to a server, so it can only be a secret or a mistake), no key or token in the query;
* free of whitespace and control characters (a CR/LF would split the request line or a header);
* at most :data:`MAX_URL_CHARS` characters: servers refuse request lines past 8 KB (nginx's default
  ``large_client_header_buffers`` is 8 KB, Apache's ``LimitRequestLine`` 8190 bytes), and the URL is
  repeated in every record and report line.
"""

from __future__ import annotations

import re
import unicodedata
from urllib.parse import urlsplit

from depthgate.spec.base import violation

__all__ = ["MAX_URL_CHARS", "check_url", "url_for_message"]

#: Longest endpoint URL accepted (see the module docstring: below the request-line limit of servers).
MAX_URL_CHARS = 2_048
#: Characters of a URL shown in a message (the rest elided).
_SHOWN = 80

_SCHEME = re.compile(r"^https?://", re.IGNORECASE)
#: A query parameter whose name says it carries a secret (``?api_key=``, ``&access_token=``, ``?sig=``).
_SECRET_PARAMETER = re.compile(
    r"(^|[&;])[^=&;]*(key|token|secret|passw(or)?d|auth|signature|sig)[^=&;]*=", re.IGNORECASE
)
_CREDENTIALS_FIX = "remove them; API keys are read from the environment (runtime.api_key_env), never a URL"


def url_for_message(url: str) -> str:
    """``url`` as a message shows it: repr'd (control characters visible) and cut to a few dozen
    characters with its length (a 1 MB URL is never printed whole)."""
    if len(url) <= _SHOWN:
        return repr(url)
    return f"{url[:_SHOWN]!r}… ({len(url)} characters)"


def _control_character(url: str) -> str | None:
    for char in url:
        if char.isspace() or unicodedata.category(char) in ("Cc", "Cf", "Zl", "Zp"):
            return f"U+{ord(char):04X}"
    return None


def _port_problem(netloc: str) -> str | None:
    """Why the port of ``netloc`` (userinfo already refused) is not a port, or None."""
    host_port = netloc.rsplit("]", 1)[-1] if netloc.startswith("[") else netloc
    if ":" not in host_port:
        return None
    port = host_port.rsplit(":", 1)[1]
    if port == "":
        return "has an empty port after ':'"
    if not (port.isascii() and port.isdigit()):
        return f"has port {port!r}, which is not a number in ASCII digits"
    if not 1 <= int(port) <= 65_535:
        return f"has port {int(port)}, outside 1..65535"
    return None


def _problem(url: str) -> tuple[str, str] | None:
    """(problem, fix) for an endpoint URL that may not be used, or None."""
    example = "give a URL such as 'http://127.0.0.1:8000'"
    if len(url) > MAX_URL_CHARS:
        return (
            f"is {len(url)} characters long, over the limit of {MAX_URL_CHARS}",
            "give the server's base URL (scheme, host, port and at most a short path such as /v1)",
        )
    control = _control_character(url)
    if control is not None:
        return (
            f"contains a whitespace or control character ({control})",
            "remove it (a CR or LF in a URL would split the HTTP request); " + example,
        )
    if not _SCHEME.match(url):  # HTTP://host is http://host
        return "is not an http(s) URL", example
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return "contains credentials (user:password@ before the host)", _CREDENTIALS_FIX
    if parts.fragment or url.endswith("#"):
        return (
            "has a fragment ('#…'), which is never sent to a server and may hold a token",
            "remove everything from '#' on; API keys are read from the environment (runtime.api_key_env)",
        )
    if _SECRET_PARAMETER.search(parts.query):
        return "contains credentials (a key or token in the query)", _CREDENTIALS_FIX
    if not parts.hostname:
        return "has no host", example
    port = _port_problem(parts.netloc)
    if port is not None:
        return port, "give a port between 1 and 65535 in ASCII digits, e.g. 'http://127.0.0.1:8000'"
    return None


def check_url(url: str, *, field: str) -> None:
    """Raise the spec violation (exit 20 naming ``field``) when ``url`` may not be an endpoint."""
    found = _problem(url)
    if found is not None:
        problem, fix = found
        # A URL that holds a secret is not repeated: the field names it.
        shown = "the URL" if "credentials" in problem or "fragment" in problem else url_for_message(url)
        raise violation(f"{shown} {problem}", field=field, fix=fix)
