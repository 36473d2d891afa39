"""Where the server's agent runs may send model requests, and which key goes with each.

A caller of ``POST /v1/agent/runs`` never decides where the server's provider keys go. The operator
lists endpoints at ``sandloop serve`` (``--provider-url``); a caller may pick one of them by its
``base_url`` and nothing else (403 otherwise, and no request is sent). Each endpoint names the
environment variable whose key is sent there, or none:

    openai=http://127.0.0.1:11434/v1                 # a local server: no key is sent
    openai=https://gateway.internal/v1;key=GW_KEY    # the value of $GW_KEY is sent there

The official endpoints (``https://api.anthropic.com``, ``https://api.openai.com/v1``) are listed
by default with ``ANTHROPIC_API_KEY`` / ``OPENAI_API_KEY``, so a provider's own key only ever goes
to that provider. A token can be restricted further to some of the listed URLs
(``sandloop tokens create --provider-url``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

OFFICIAL = {"anthropic": "https://api.anthropic.com", "openai": "https://api.openai.com/v1"}
OFFICIAL_KEY_ENV = {"anthropic": "ANTHROPIC_API_KEY", "openai": "OPENAI_API_KEY"}
#: Sent where an endpoint needs no key: the SDKs refuse to start without one, and it grants nothing.
NO_KEY = "sandloop-no-key"


class EndpointRefused(Exception):
    """A caller asked for a provider endpoint the operator did not list (HTTP 403)."""


class EndpointConfigError(ValueError):
    """The operator's endpoint list is malformed, or a listed endpoint's key is missing."""


def normalize_url(url: str) -> str:
    """``scheme://host[:port]/path`` without a trailing slash; refuses what an allowlist cannot
    compare safely (credentials, query, fragment, other schemes)."""
    text = url.strip()
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{url!r} is not a URL: {exc}") from None
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ValueError(f"{url!r} carries credentials, a query or a fragment; give the bare base URL")
    host = parts.hostname.lower()
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path.rstrip('/')}"


@dataclass(frozen=True)
class Endpoint:
    provider: str
    base_url: str
    #: The environment variable whose value is sent as the API key; None sends no key.
    key_env: str | None

    def api_key(self) -> str:
        if self.key_env is None:
            return NO_KEY
        key = os.environ.get(self.key_env)
        if not key:
            raise EndpointConfigError(
                f"the server has no {self.key_env} for {self.base_url}: the operator must set it before "
                "`sandloop serve`, or list a keyless endpoint with --provider-url"
            )
        return key

    def __str__(self) -> str:
        return f"{self.provider}={self.base_url}" + (f";key={self.key_env}" if self.key_env else "")


def parse_endpoint(spec: str) -> Endpoint:
    """``PROVIDER=URL`` or ``PROVIDER=URL;key=ENV_VAR``."""
    provider, sep, rest = spec.partition("=")
    provider = provider.strip().lower()
    if not sep or provider not in OFFICIAL:
        raise EndpointConfigError(
            f"{spec!r}: write PROVIDER=URL[;key=ENV_VAR] with PROVIDER one of {', '.join(OFFICIAL)}"
        )
    url, _, key = rest.partition(";key=")
    try:
        base_url = normalize_url(url)
    except ValueError as exc:
        raise EndpointConfigError(f"{spec!r}: {exc}") from None
    key_env = key.strip() or None
    if key_env is not None and not key_env.replace("_", "").isalnum():
        raise EndpointConfigError(f"{spec!r}: key= names an environment variable, e.g. key=GATEWAY_API_KEY")
    return Endpoint(provider, base_url, key_env)


class ProviderEndpoints:
    """The operator's allowlist. The first endpoint listed for a provider is its default."""

    def __init__(self, endpoints: Iterable[Endpoint | str] = (), *, official: bool = True) -> None:
        listed = [e if isinstance(e, Endpoint) else parse_endpoint(e) for e in endpoints]
        if official:
            listed += [Endpoint(p, normalize_url(u), OFFICIAL_KEY_ENV[p]) for p, u in OFFICIAL.items()]
        self._by_provider: dict[str, dict[str, Endpoint]] = {}
        for e in listed:
            self._by_provider.setdefault(e.provider, {}).setdefault(e.base_url, e)

    def listed(self, provider: str) -> list[str]:
        return list(self._by_provider.get(provider, {}))

    def resolve(self, provider: str, base_url: str | None, token_urls: Iterable[str] = ()) -> Endpoint:
        """The endpoint a run may use. ``token_urls``, when given, restricts the token further."""
        allowed: Mapping[str, Endpoint] = self._by_provider.get(provider, {})
        restrict = {normalize_url(u) for u in token_urls}
        if restrict:
            allowed = {u: e for u, e in allowed.items() if u in restrict}
        if not allowed:
            raise EndpointRefused(f"this server lists no {provider} endpoint this token may use")
        if base_url is None:
            return next(iter(allowed.values()))
        try:
            wanted = normalize_url(base_url)
        except ValueError as exc:
            raise EndpointRefused(f"base_url refused: {exc}") from None
        if wanted not in allowed:
            raise EndpointRefused(
                f"base_url {wanted} is not one of the {provider} endpoints this server lists for this token "
                f"({', '.join(allowed)}); the operator adds endpoints with `sandloop serve --provider-url`"
            )
        return allowed[wanted]
