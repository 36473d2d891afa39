"""The parts of making Docker's config without Docker (runtime/oci/generate.py) that need no
engine: tmpfs options merged as moby merges them, the seccomp profile filtered by architecture and
capabilities, the environment's order, and what is refused. The whole config is compared with
Docker's own in tests/integration/test_no_docker.py."""

from __future__ import annotations

import pytest

from sandloop.contract import SandboxLimits
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.oci.generate import Unmakeable, _profile, docker_config, merge_tmpfs_options, seccomp

IMAGE = {"Env": ["PATH=/bin", "LANG=C.UTF-8", "EXTRA=1"], "Entrypoint": ["/init"], "Cmd": None, "WorkingDir": "/"}


def test_tmpfs_options_keep_the_last_of_each_key_and_flag_pair():
    merged = merge_tmpfs_options(["noexec", "nosuid", "nodev", "rprivate", "rw", "nosuid", "size=1", "exec", "size=2"])
    assert merged == ["nodev", "rprivate", "rw", "nosuid", "exec", "size=2"]


def test_seccomp_rules_follow_the_containers_capabilities_and_architecture():
    none = seccomp(_profile(), machine="x86_64")
    names = {n for rule in none["syscalls"] for n in rule["names"]}
    assert none["architectures"] == ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]
    assert "arch_prctl" in names and "ptrace" not in names  # amd64-only rule in; removed by sandloop out
    assert "chroot" not in names and "bpf" not in names  # need CAP_SYS_CHROOT / CAP_SYS_ADMIN
    admin = seccomp(_profile(), ["CAP_SYS_ADMIN"], machine="x86_64")
    assert "bpf" in {n for rule in admin["syscalls"] for n in rule["names"]}
    arm = seccomp(_profile(), machine="aarch64")
    assert arm["architectures"] == ["SCMP_ARCH_AARCH64", "SCMP_ARCH_ARM"]
    with pytest.raises(Unmakeable, match="riscv"):
        seccomp(_profile(), machine="riscv")


def test_the_environment_is_dockers_order_and_the_image_fills_in():
    config = docker_config(SandboxSpec("img", SandboxLimits().for_container()), IMAGE)
    env = config["process"]["env"]
    assert env[:2] == ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOSTNAME=sandbox"]
    assert env[-1] == "EXTRA=1" and "LANG=C.UTF-8" in env
    assert config["process"]["args"] == ["/init"] and config["process"]["cwd"] == "/tmp"
    kernel = docker_config(SandboxSpec("img", SandboxLimits().for_container(), command=("--kernel",)), IMAGE)
    assert kernel["process"]["args"] == ["/init", "--kernel"]


@pytest.mark.parametrize(
    ("limits", "spec_kw", "says"),
    [
        ({"network": True}, {}, "network"),
        ({"seccomp": "docker-default"}, {}, "built-in profile"),
        ({}, {"volumes": (("ws", "/workspace"),)}, "volumes"),
    ],
)
def test_what_only_docker_gives_is_refused(limits, spec_kw, says):
    with pytest.raises(Unmakeable, match=says):
        docker_config(SandboxSpec("img", SandboxLimits(**limits).for_container(), **spec_kw), IMAGE)


def test_an_image_without_a_program_is_refused():
    with pytest.raises(Unmakeable, match="neither an entrypoint nor a command"):
        docker_config(SandboxSpec("img", SandboxLimits().for_container()), {"Env": []})
