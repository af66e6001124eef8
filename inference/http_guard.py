"""Who may use the server: an API key every `/v1` request must carry, and no open bind without one.

    key = resolve_api_key(args.api_key, args.api_key_file, os.environ)   # None: no key configured
    warning = check_bind(args.host, key, args.allow_unauthenticated)     # ConfigError: refused
    app.add_middleware(KeyGuard, key=key)                                 # 401 without the key

Clients authenticate as OpenAI's API, vLLM and SGLang have them do: `Authorization: Bearer KEY`
(the `openai` client sends its `api_key` so). The key is compared in constant time, as SHA-256
digests so that not even its length shows in the timing, and it is never logged or echoed: a
refusal logs the method, path and client address and says whether a key was sent. `/health` stays
open (load balancers probe it without credentials). The key can come from the command line, from
an environment variable or from a file, so that it need not show in `ps` or a shell's history.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import socket
from collections.abc import Mapping

from meshwork.config import ConfigError

KEY_ENV = "MESHWORK_API_KEY"
OPEN_PATHS = ("/health",)
log = logging.getLogger("meshwork.serve")


def resolve_api_key(flag: str | None, path: str | None, environ: Mapping[str, str]) -> str | None:
    """The one key the sources give (--api-key, --api-key-file, $MESHWORK_API_KEY), or None. Raises
    ConfigError for an empty key, an unreadable file, or sources that give different keys."""
    sources = {}
    if flag is not None:
        sources["--api-key"] = flag
    if path is not None:
        try:
            sources["--api-key-file"] = open(path, encoding="utf-8").read().strip()  # noqa: SIM115
        except OSError as e:
            raise ConfigError(f"--api-key-file {path}: cannot read it ({e.strerror}); give a readable file") from None
    if environ.get(KEY_ENV) is not None:
        sources[f"${KEY_ENV}"] = environ[KEY_ENV]
    for name, key in sources.items():
        if not key.strip():
            raise ConfigError(f"{name}: the API key is empty; give a non-empty key")
    if len(set(sources.values())) > 1:
        raise ConfigError(f"{' and '.join(sources)} give different API keys; give the key once")
    return next(iter(sources.values()), None)


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches only this machine: every address it resolves to is loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_bind(host: str, key: str | None, allow_unauthenticated: bool) -> str | None:
    """Refuses (ConfigError) to serve beyond this machine without a key unless told to; the warning
    to print at start when told to, else None."""
    if key is not None or is_loopback(host):
        return None
    if not allow_unauthenticated:
        raise ConfigError(
            f"--host {host} serves other machines and no API key is set; give --api-key-file, ${KEY_ENV} "
            "or --api-key (clients send Authorization: Bearer KEY), or --allow-unauthenticated to serve anyone"
        )
    return f"warning: serving {host} without an API key (--allow-unauthenticated): anyone who reaches it can use it"


def _bearer(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" else None
    return None


class KeyGuard:
    """ASGI middleware: an HTTP request to any path but OPEN_PATHS without `Authorization: Bearer
    KEY` gets 401 in OpenAI's error shape (code invalid_api_key) before the app sees it. Plain ASGI,
    not Starlette's BaseHTTPMiddleware, which would stand between a streamed response and the
    handler's view of a disconnecting client."""

    def __init__(self, app, key: str):
        self.app = app
        self.digest = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        token = _bearer(scope["headers"])
        if token is not None and hmac.compare_digest(hashlib.sha256(token).digest(), self.digest):
            return await self.app(scope, receive, send)
        client = ":".join(map(str, scope["client"])) if scope.get("client") else "unknown client"
        sent = "no key" if token is None else "a wrong key"
        log.warning("401 %s %s from %s: %s", scope["method"], scope["path"], client, sent)
        message = f"{sent} in the Authorization header; send Authorization: Bearer <the server's API key>"
        body = {
            "error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
        }
        headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
