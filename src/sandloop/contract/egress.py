"""Egress allowlists: the rules a sandbox's outbound requests are held to, and what it tried.

A rule is a hostname with an optional port: ``pypi.org`` (ports 80 and 443), ``pypi.org:443``,
``*.githubusercontent.com`` (any subdomain, not the bare name), ``*.example.com:8443``, or an IP
address (``10.1.2.3:8080``: listing an inward address is the only way to reach one). Names are
matched case-insensitively, without a trailing dot.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator

from sandloop.contract.errors import InvalidArgument

#: Ports a rule without one allows.
DEFAULT_PORTS = (80, 443)
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


def _split(rule: str) -> tuple[str, int | None]:
    text = rule.strip().lower()
    if text.startswith("["):  # [v6]:port
        host, _, rest = text[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else None
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, None
    if port is None:
        return host.rstrip("."), None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"egress rule {rule!r}: the port must be a number from 1 to 65535")
    return host.rstrip("."), int(port)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def is_hostname(host: str) -> bool:
    """Whether ``host`` is a well-formed DNS name (no empty labels, no stray characters)."""
    labels = host.rstrip(".").split(".")
    return 0 < len(host) <= 253 and all(_LABEL.match(label) for label in labels)


def normalize_rule(rule: str) -> str:
    """``'PyPI.org.'`` -> ``'pypi.org'``; raises ``ValueError`` with what is wrong."""
    if not isinstance(rule, str) or not rule.strip():
        raise ValueError("an egress rule is a hostname like 'pypi.org', '*.example.com' or 'host:443'")
    if "://" in rule or "/" in rule:
        from urllib.parse import urlsplit

        netloc = urlsplit(rule if "://" in rule else f"//{rule}").netloc or rule.split("/", 1)[0]
        raise ValueError(
            f"egress rule {rule!r} is a URL or a path: give a host name (and an optional :port), e.g. {netloc!r}"
        )
    host, port = _split(rule)
    try:
        ip = ipaddress.ip_address(host)
        host = f"[{ip}]" if ip.version == 6 and port is not None else str(ip)
    except ValueError:
        name = host[2:] if host.startswith("*.") else host
        labels = name.split(".")
        if "*" in name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
            raise ValueError(
                f"egress rule {rule!r} is not a hostname: use letters, digits and '-', with an optional "
                f"leading '*.' (any subdomain) and ':port'"
            ) from None
        if host.startswith("*.") and len(labels) < 2:
            wide = f"egress rule {rule!r} is too wide: a wildcard needs a domain, e.g. '*.example.com'"
            raise ValueError(wide) from None
        if host.startswith("*.") and labels[-1].isdigit():
            # '*.0.1' would match IP addresses (127.0.0.1), which then skip the inward check
            raise ValueError(
                f"egress rule {rule!r}: a wildcard covers host names only; list an address as it is"
            ) from None
    return host if port is None else f"{host}:{port}"


def rule_allows(rule: str, host: str, port: int) -> bool:
    """Whether one normalized rule allows ``host:port``."""
    pattern, rule_port = _split(rule)
    pattern = pattern.strip("[]")
    host = host.lower().rstrip(".").strip("[]")
    if port not in ((rule_port,) if rule_port is not None else DEFAULT_PORTS):
        return False
    if pattern.startswith("*."):
        if _is_ip(host):  # a wildcard never names an address
            return False
        return host.endswith(pattern[1:]) and len(host) > len(pattern) - 1
    return host == pattern


def allows(rules: tuple[str, ...], host: str, port: int) -> bool:
    return any(rule_allows(rule, host, port) for rule in rules)


#: A policy entry (a token's, say) that covers every rule.
ANY = "any"


def covers(policy: tuple[str, ...], rule: str) -> bool:
    """Whether a policy (normalized rules, or ``any``) permits asking for ``rule``: everything the
    rule allows, some policy entry allows too."""
    if ANY in policy:
        return True
    host, port = _split(rule)
    ports = (port,) if port is not None else DEFAULT_PORTS
    if host.startswith("*."):  # a wildcard is covered only by a wildcard as wide or wider
        suffix = host[1:]
        return all(
            any(
                _split(p)[0].startswith("*.")
                and (suffix == _split(p)[0][1:] or suffix.endswith(_split(p)[0][1:]))
                and rule_allows(p, "x" + suffix, n)
                for p in policy
            )
            for n in ports
        )
    return all(allows(policy, host.strip("[]"), n) for n in ports)


class EgressAttempt(BaseModel):
    """One outbound request a sandbox made through its egress proxy, allowed or not."""

    model_config = ConfigDict(frozen=True)

    host: str
    port: int
    method: str = Field(description="CONNECT (a tunnel, e.g. HTTPS) or the HTTP method of a plain request.")
    allowed: bool
    note: str = Field("", description="Why it was refused, or what failed after it was allowed.")
    bytes_out: int = Field(0, description="Bytes the sandbox sent to the destination.")
    bytes_in: int = Field(0, description="Bytes the destination sent back.")


#: Headers a secret's placeholder is replaced in unless the secret names others.
DEFAULT_SECRET_HEADERS = ("authorization",)
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")
#: Headers a secret may never go in: the proxy's own, and the ones servers route or echo by.
_NEVER_SECRET = frozenset({"host", "proxy-authorization", "connection", "content-length", "transfer-encoding"})


class Secret(BaseModel):
    """A value code may use but never see: inside the sandbox its variable holds a placeholder,
    and the egress proxy puts the value in place of it only in the value of one of ``headers``
    (``Authorization`` unless others are named) of a request to one of ``hosts``, over TLS unless
    ``plain_http``. A placeholder in the URL, ``Host``, or another header of a request to those
    hosts is refused (a server would echo it back: a redirect's ``Location``, a 404 page).
    ``Secret(os.environ["GITHUB_TOKEN"], hosts=["api.github.com"])``,
    ``Secret(key, hosts=["api.example.com"], headers=["X-Api-Key"])``."""

    model_config = ConfigDict(frozen=True)

    value: SecretStr
    hosts: tuple[str, ...]
    headers: tuple[str, ...] = DEFAULT_SECRET_HEADERS
    plain_http: bool = False

    def __init__(self, value: str | SecretStr, hosts: Any = (), **data: Any) -> None:
        try:
            super().__init__(value=value, hosts=hosts, **data)
        except ValidationError as exc:
            raise InvalidArgument(
                "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            ) from None

    @field_validator("headers", mode="before")
    @classmethod
    def _headers(cls, v: object) -> tuple[str, ...]:
        if isinstance(v, str):
            v = (v,)
        if not isinstance(v, list | tuple) or not v or len(v) > 8:
            raise ValueError("a secret's headers are 1 to 8 header names, e.g. headers=['Authorization']")
        names = []
        for name in v:
            if not isinstance(name, str) or not _HEADER_NAME.match(name):
                raise ValueError(f"{name!r} is not a header name")
            if name.lower() in _NEVER_SECRET:
                raise ValueError(f"a secret cannot go in the {name} header")
            names.append(name.lower())
        return tuple(dict.fromkeys(names))

    @field_validator("hosts", mode="before")
    @classmethod
    def _hosts(cls, v: object) -> tuple[str, ...]:
        if isinstance(v, str):
            v = (v,)
        if not isinstance(v, list | tuple) or not v:
            raise ValueError("a secret needs the hosts it may be sent to, e.g. hosts=['api.github.com']")
        return tuple(normalize_rule(h) for h in v)

    @field_validator("value")
    @classmethod
    def _value(cls, v: SecretStr) -> SecretStr:
        if not v.get_secret_value() or any(c in v.get_secret_value() for c in "\r\n\0"):
            raise ValueError("a secret's value must be non-empty and one line")
        return v
