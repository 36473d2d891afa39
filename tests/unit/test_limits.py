import math

import pytest

from sandloop import InvalidLimits, SandboxError, SandboxLimits
from sandloop.contract import format_size, parse_size


def test_defaults_are_the_seeds():
    lim = SandboxLimits()
    assert lim.network is False
    assert lim.memory == "256m" and lim.memory_bytes == 256 * 1024**2
    assert lim.memory_swap is None and lim.memory_swap_bytes == lim.memory_bytes  # no swap headroom
    assert lim.cpus == 0.5
    assert lim.pids == 64
    assert lim.read_only is True
    assert lim.tmpfs_size == "64m"
    assert lim.user == "65534:65534"
    assert lim.runtime == "runc"
    assert lim.output_limit == 64 * 1024


def test_overriding_is_explicit_and_normalised():
    lim = SandboxLimits(network=True, memory="1g", memory_swap="2048m", runtime="runsc")
    assert lim.network and lim.memory == "1g" and lim.memory_swap == "2g" and lim.runtime == "runsc"
    assert SandboxLimits(memory=512 * 1024**2).memory == "512m"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"memory": "lots"}, "memory"),
        ({"memory": "1m"}, "at least 6m"),
        ({"memory": -5}, "memory"),
        ({"memory_swap": "128m"}, "memory_swap must be >= memory"),
        ({"cpus": 0}, "cpus"),
        ({"cpus": -1}, "cpus"),
        ({"cpus": math.nan}, "cpus"),
        ({"cpus": math.inf}, "cpus"),
        ({"pids": 0}, "pids"),
        ({"pids": 10**9}, "pids"),
        ({"tmpfs_size": "10k"}, "tmpfs_size"),
        ({"user": "root"}, "user"),
        ({"user": "0:0; rm -rf /"}, "user"),
        ({"runtime": "kata"}, "runtime"),
        ({"open_files": 1}, "open_files"),
        ({"output_limit": 0}, "output_limit"),
        ({"no_such_control": True}, "no_such_control"),
    ],
)
def test_invalid_values_are_rejected_when_made(kwargs, fragment):
    with pytest.raises(InvalidLimits) as info:
        SandboxLimits(**kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, SandboxError) and isinstance(info.value, ValueError)


def test_limits_are_frozen():
    lim = SandboxLimits()
    with pytest.raises(ValueError):
        lim.memory = "1g"  # type: ignore[misc]


@pytest.mark.parametrize("text, n", [("256m", 256 * 1024**2), ("1g", 1024**3), ("64K", 65536), ("100", 100), (7, 7)])
def test_parse_size(text, n):
    assert parse_size(text) == n


def test_format_size_round_trips():
    for n in (1, 1024, 3 * 1024**2, 5 * 1024**3, 1536):
        assert parse_size(format_size(n)) == n
