import json

import pytest

from sandloop import InvalidArgument, UnknownLanguage, languages
from sandloop.languages import Language
from sandloop.runner import MAX_CODE_BYTES, build_request
from sandloop.runtime.protocol import encode_run


def test_builtins_and_aliases():
    assert languages.names() == ["bash", "node", "python"]
    assert languages.get("py").name == "python"
    assert languages.get("JavaScript").name == "node"
    assert languages.get("sh").name == "bash"


def test_unknown_language_lists_the_known_ones():
    with pytest.raises(UnknownLanguage) as info:
        languages.get("cobol")
    assert "bash, node, python" in str(info.value)


def test_register_refuses_to_shadow_without_replace():
    with pytest.raises(ValueError):
        languages.register(Language("python", "x.py", ("python3",)))


def test_register_a_new_language():
    lang = languages.register(Language("perl-test", "main.pl", ("perl",), aliases=("pl-test",)), replace=True)
    assert languages.get("pl-test") is lang


def test_request_payload_frames_code_and_stdin():
    req = build_request("print(input())", "python", 5, stdin="hello\n")
    payload = encode_run(req)
    assert payload[:10] == b"SANDLOOP1 " and payload[18:19] == b"\n"
    n = int(payload[10:18])
    meta, rest = json.loads(payload[19 : 19 + n]), payload[19 + n :]
    assert meta["inproc"] is True
    assert meta["argv"] == ["python3"] and meta["file"].endswith("main.py")
    assert rest[: meta["code"]] == b"print(input())"
    assert rest[meta["code"] :] == b"hello\n"


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 10**9, "30", True])
def test_absurd_timeouts_are_refused(timeout):
    with pytest.raises(InvalidArgument):
        build_request("print(1)", "python", timeout)


def test_code_must_be_text_or_bytes_and_bounded():
    with pytest.raises(InvalidArgument):
        build_request(123, "python", 5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="most accepted"):
        build_request(b"#" * (MAX_CODE_BYTES + 1), "python", 5)


def test_limits_must_be_sandbox_limits():
    with pytest.raises(InvalidArgument):
        build_request("print(1)", "python", 5, limits={"memory": "1g"})  # type: ignore[arg-type]
