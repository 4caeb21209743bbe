"""Who may use the server: bearer API keys for /v1/*, and a login for the page."""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence

API_KEY_ENV = "POP_VLM_API_KEY"
UI_AUTH_ENV = "POP_VLM_UI_AUTH"
KEYED_PATHS = ("/v1/",)


def api_keys_from(flags: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The `--api-key` flags, else $POP_VLM_API_KEY (several keys separated by commas); empty: no key needed."""
    environ = os.environ if environ is None else environ
    raw = list(flags or ()) or environ.get(API_KEY_ENV, "").split(",")
    keys = tuple(dict.fromkeys(key.strip() for key in raw if key and key.strip()))
    for key in keys:
        # a key travels in an HTTP header: visible ASCII only, or no client could ever send it
        if not key.isascii() or not key.isprintable() or " " in key:
            raise ValueError("an API key may contain only visible ASCII characters (no spaces)")
    return keys


def ui_auth_from(flags: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> list[tuple[str, str]]:
    """`--ui-auth user:pass` (repeatable), else $POP_VLM_UI_AUTH (one user:pass): the page's own login."""
    environ = os.environ if environ is None else environ
    entries = list(flags or ()) or ([environ[UI_AUTH_ENV]] if environ.get(UI_AUTH_ENV) else [])
    pairs = []
    for entry in entries:
        user, sep, password = entry.partition(":")
        if not sep or not user.strip() or not password:
            raise ValueError("--ui-auth takes user:password")
        pairs.append((user.strip(), password))
    return pairs


def key_matches(presented: str, keys: Sequence[str]) -> bool:
    """Constant-time comparison with every key (no early exit, so timing tells nothing about which one is close)."""
    given = presented.encode("utf-8", "replace")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode("ascii"))
    return matched


def page_login(keys: Sequence[str], ui_auth: Sequence[tuple[str, str]]):
    """Gradio's `auth` for the page: the --ui-auth users, else any user name with an API key as the password, else
    None (an open page, only when the API is open too: the page runs the same models)."""
    if ui_auth:
        return list(ui_auth)
    if keys:
        return lambda _user, password: key_matches(password or "", keys)
    return None


def exposure_warning(host: str, keys: Sequence[str]) -> str | None:
    """A warning for a server reachable from other machines with no key in front of it."""
    if keys or is_loopback(host):
        return None
    return (f"listening on {host} without an API key: anyone who can reach this port can run the models. "
            f"Set --api-key or {API_KEY_ENV}.")


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable from elsewhere


def unauthorized_body(has_header: bool) -> dict:
    message = ("Incorrect API key provided." if has_header else
               "Missing API key: send it in the header 'Authorization: Bearer <key>'.")
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}


class RequireAPIKey:
    """Pure ASGI middleware: requests under `paths` need `Authorization: Bearer <one of keys>`, else 401 in OpenAI's
    error shape, before the request body is read (streams pass through untouched)."""

    def __init__(self, app, keys: Sequence[str], paths: tuple[str, ...] = KEYED_PATHS):
        self.app, self.keys, self.paths = app, tuple(keys), paths

    async def __call__(self, scope, receive, send):
        if not self.keys or scope["type"] != "http" or not scope.get("path", "").startswith(self.paths):
            return await self.app(scope, receive, send)
        header = dict(scope.get("headers") or ()).get(b"authorization")
        if header is not None:
            scheme, _, token = header.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and key_matches(token.strip(), self.keys):
                return await self.app(scope, receive, send)
        body = json.dumps(unauthorized_body(header is not None)).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b'Bearer realm="pop-vlm"')]})
        await send({"type": "http.response.body", "body": body})
