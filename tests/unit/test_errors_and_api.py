import docker.errors
import pytest
import requests

import sandloop
from sandloop import (
    EngineUnavailable,
    ExecutionResult,
    ImageMissing,
    InvalidLimits,
    RuntimeUnavailable,
    SandboxError,
    SandboxLimits,
)
from sandloop.runtime.docker import DockerBackend, engine_errors


def test_public_api_is_what_it_should_be():
    assert sorted(sandloop.__all__) == sorted(
        [
            "CellResult",
            "CodeContext",
            "ContextNotFound",
            "EgressAttempt",
            "EngineUnavailable",
            "ExecutionResult",
            "HostDiskFull",
            "ImageMissing",
            "InvalidArgument",
            "InvalidLimits",
            "Language",
            "PathRefused",
            "RuntimeUnavailable",
            "SandboxBusy",
            "SandboxError",
            "SandboxLimits",
            "Sandloop",
            "Secret",
            "Session",
            "SessionNotFound",
            "Settings",
            "TooLarge",
            "UnknownLanguage",
            "WorkspaceFileNotFound",
            "WorkspaceFull",
            "__version__",
            "run_code",
        ]
    )


def test_contract_imports_no_backend():
    import subprocess
    import sys

    code = "import sys, sandloop.contract; print('docker' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_ok_is_exit_zero_and_not_timed_out():
    assert ExecutionResult(exit_code=0, duration_seconds=0.1).ok
    assert not ExecutionResult(exit_code=1, duration_seconds=0.1).ok
    assert not ExecutionResult(exit_code=-1, timed_out=True, duration_seconds=0.1).ok
    assert ExecutionResult(exit_code=0, duration_seconds=0.1).model_dump()["ok"] is True


def _raise(exc):
    with engine_errors(image="img:1", runtime="runsc"):
        raise exc


def _api_error(status, text):
    resp = requests.Response()
    resp.status_code = status
    return docker.errors.APIError(text, response=resp, explanation=text)


@pytest.mark.parametrize(
    "exc, expected, fragment",
    [
        (docker.errors.ImageNotFound("No such image"), ImageMissing, "sandloop images build"),
        (_api_error(500, "Unknown runtime specified runsc"), RuntimeUnavailable, "engine-up.sh"),
        (_api_error(400, "Range of CPUs is from 0.01 to 2.00"), InvalidLimits, "Range of CPUs"),
        # runc failing to start a container is not a missing runtime, though its text says "runtime ... unknown"
        (
            _api_error(
                500,
                "failed to create shim task: OCI runtime create failed: runc create failed: unable to start "
                "container process: error during container init: error setting rlimits for ready process: "
                "error setting rlimit type 7: operation not permitted: unknown",
            ),
            InvalidLimits,
            "open_files",
        ),
        (_api_error(500, "OCI runtime create failed: something else: unknown"), EngineUnavailable, "500"),
        (_api_error(500, "something broke"), EngineUnavailable, "something broke"),
        # a conflict or a refusal is the engine's state, not the caller's limits
        (_api_error(409, "container is marked for removal"), EngineUnavailable, "409"),
        (_api_error(403, "operation not permitted"), EngineUnavailable, "403"),
        (requests.exceptions.ConnectionError("refused"), EngineUnavailable, "engine-up.sh"),
        (requests.exceptions.ReadTimeout("slow"), EngineUnavailable, "did not answer"),
        (docker.errors.DockerException("no socket"), EngineUnavailable, "DOCKER_HOST"),
    ],
)
def test_foreign_exceptions_are_mapped_once(exc, expected, fragment):
    with pytest.raises(expected) as info:
        _raise(exc)
    assert fragment in str(info.value)
    assert info.value.__cause__ is exc


def test_no_engine_is_a_sandbox_error_that_says_what_to_do(tmp_path):
    backend = DockerBackend(base_url=f"unix://{tmp_path}/no-such-docker.sock", call_timeout=2, home=tmp_path)
    from sandloop.runner import build_request

    with pytest.raises(EngineUnavailable) as info:
        backend.run(build_request("print(1)", limits=SandboxLimits(), image="sandloop-runtime:any"))
    assert "docker" in str(info.value).lower()
    assert isinstance(info.value, SandboxError) and info.value.retryable


def test_every_error_has_a_stable_code():
    import sandloop.contract.errors as errors

    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, SandboxError)]
    codes = [c.code for c in classes]
    assert len(classes) >= 12 and len(set(codes)) == len(codes), codes  # one distinct code each
    assert all(c.code == c.code.lower() and " " not in c.code for c in classes)


def test_layers_above_the_runtime_import_no_backend():
    """The seam holds: pool, sessions, server, cli and agent never import a backend or docker-py
    (only the composition root's settings build one, lazily)."""
    import ast
    from pathlib import Path

    src = Path(sandloop.__file__).parent
    offenders = []
    for layer in ("pool", "sessions", "server", "cli", "agent"):
        for path in (src / layer).rglob("*.py"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                for name in names:
                    if name == "docker" or name.startswith(
                        ("docker.", "sandloop.runtime.docker", "sandloop.testing.fake")
                    ):
                        offenders.append(f"{path.relative_to(src)}: {name}")
    assert offenders == []


def test_a_bad_setting_is_a_clear_usage_error_not_a_traceback():
    import os
    import subprocess
    import sys

    env = {**os.environ, "SANDLOOP_BACKEND": "ocii"}
    p = subprocess.run(
        [sys.executable, "-m", "sandloop", "run", "-"], input="print(1)", env=env, capture_output=True, text=True
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "invalid setting: SANDLOOP_BACKEND" in p.stderr and "'oci'" in p.stderr
