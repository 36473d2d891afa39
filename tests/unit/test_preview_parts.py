"""Preview URLs' parts without a sandbox (server/preview.py): which heads are previews, the path
form's redirect, the keyed origin, what is taken out of a request, the anonymous rate."""

from __future__ import annotations

import h11
import pytest

from sandloop.server import preview as pv
from sandloop.server.preview import Preview, Refused, clean_request

KEY = "e2b_" + "ab" * 32


def _head(target: str, host: str, *extra: str) -> bytes:
    return ("\r\n".join([f"GET {target} HTTP/1.1", f"Host: {host}", *extra]) + "\r\n\r\n").encode()


def test_the_path_form_only_redirects_to_the_host_form():
    found = Preview(None, None).match(_head("/sandboxes/s-abc/ports/8000/a/b?x=1", "127.0.0.1:9000"))  # type: ignore[arg-type]
    assert found is not None and found.answer.startswith(b"HTTP/1.1 307")
    assert b"Location: http://8000-s-abc.localhost:9000/a/b?x=1\r\n" in found.answer
    assert b"Connection: close" in found.answer


def test_host_forms_and_the_keyed_origin_name_their_target():
    preview = Preview(None, None)  # type: ignore[arg-type]
    plain = preview.match(_head("/p", "8000-s-abc.localhost:9000"))
    assert plain is not None and (plain.session_id, plain.port, plain.key, plain.answer) == (
        "s-abc",
        8000,
        ("", ""),
        b"",
    )
    label = preview.preview_key("tok_0123456789ab", "s-abc", 8000)
    keyed = preview.match(_head("/p", f"8000-s-abc.{label}.localhost:9000"))
    assert keyed is not None and preview._key_token(keyed) == "tok_0123456789ab"
    other_mac = label[:-1] + ("1" if label.endswith("0") else "0")  # (never the label itself)
    for wrong in (f"8001-s-abc.{label}", f"8000-s-abd.{label}", f"8000-s-abc.{other_mac}"):
        other = preview.match(_head("/p", f"{wrong}.localhost:9000"))
        assert other is not None and preview._key_token(other) is None, wrong
    assert Preview(None, None).preview_key("tok_0123456789ab", "s-abc", 8000) != label  # (each server's secret)
    assert preview.match(_head("/p", "49983-s-abc.localhost")) is None  # envd's port stays the API's
    assert preview.match(_head("/p", "8000-s-abc.example.com")) is None


def test_a_request_loses_the_owners_credentials_and_keeps_the_apps():
    request = h11.Request(
        method="GET",
        target=f"/a?x=1&sandloop_token={KEY}&y=2",
        headers=[
            ("Host", "8000-s.localhost"),
            ("Authorization", f"Bearer {KEY}"),
            ("X-API-Key", KEY),
            ("Cookie", "theirs=1; sandloop_preview=abc; more=2"),
            ("e2b-traffic-access-token", "t"),
            ("X-Own", "kept"),
        ],
    )
    cleaned = clean_request(request)
    assert cleaned.target == b"/a?x=1&y=2"
    assert dict(cleaned.headers) == {b"host": b"8000-s.localhost", b"cookie": b"theirs=1; more=2", b"x-own": b"kept"}
    app = clean_request(h11.Request(method="GET", target="/", headers=[("Host", "h"), ("Authorization", "Bearer app")]))
    assert (b"authorization", b"Bearer app") in list(app.headers)


def test_anonymous_opens_are_metered_per_sandbox(monkeypatch):
    monkeypatch.setattr(pv, "ANONYMOUS_OPENS", 0.0)  # (no refill within the test)
    preview = Preview(None, None)  # type: ignore[arg-type]
    for _ in range(int(pv.ANONYMOUS_BURST)):
        preview._metered("s-a")
    with pytest.raises(Refused) as refused:
        preview._metered("s-a")
    assert refused.value.status == 429 and "without its token" in refused.value.message
    preview._metered("s-b")  # another sandbox has its own
