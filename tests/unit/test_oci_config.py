"""The direct backend's config rendering: what it may change in Docker's config and what it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandloop.contract import SandboxError, SandboxLimits
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.docker.hardening import container_config
from sandloop.runtime.oci.config import binds_host_tmp, parity_problems, render


def _template(tmp_mount: dict) -> dict:
    return {
        "root": {"path": "/docker/rootfs"},
        "linux": {"cgroupsPath": "/docker/x", "namespaces": [{"type": "pid"}]},
        "mounts": [
            {"destination": "/etc/hostname", "type": "bind", "source": "/docker/hostname", "options": ["rbind"]},
            tmp_mount,
        ],
    }


GVISOR_TMP = {"destination": "/tmp", "type": "bind", "source": "/var/lib/docker/volumes/v/_data", "options": ["rbind"]}
RUNC_TMP = {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nr_inodes=16384"]}


def _render(template, host_tmp=None):
    return render(
        template,
        rootfs=Path("/store/rootfs"),
        hostname_file=Path("/state/hostname"),
        cgroups_path="/sandloop/s",
        annotations={},
        host_tmp=host_tmp,
    )


def test_a_host_tmpfs_at_tmp_is_the_one_bind_besides_the_hostname_file():
    assert parity_problems(_template(GVISOR_TMP)) == []
    assert parity_problems(_template(RUNC_TMP)) == []
    other = {**GVISOR_TMP, "destination": "/data"}
    assert parity_problems(_template(other)) == ["the config binds host paths other than /etc/hostname and /tmp"]


def test_the_tmp_bind_points_at_the_runs_own_tmpfs_or_the_render_refuses():
    assert binds_host_tmp(_template(GVISOR_TMP)) and not binds_host_tmp(_template(RUNC_TMP))
    config = _render(_template(GVISOR_TMP), host_tmp=Path("/bundle/tmp"))
    tmp = next(m for m in config["mounts"] if m["destination"] == "/tmp")
    assert tmp == {**GVISOR_TMP, "source": "/bundle/tmp"}
    with pytest.raises(SandboxError, match="none was made for this run"):
        _render(_template(GVISOR_TMP))  # never Docker's volume path: that is another container's
    assert _render(_template(RUNC_TMP))["mounts"][1] == RUNC_TMP


class _Api:
    """docker-py's APIClient.create_host_config without a daemon (it only builds a dict)."""

    def create_host_config(self, **kw):
        from docker.types import HostConfig

        return HostConfig(version="1.41", **kw)


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_docker_gets_tmp_with_its_inode_cap_on_both_runtimes(runtime):
    limits = SandboxLimits(runtime=runtime, tmpfs_inodes=777, tmpfs_size="8m")
    host = container_config(_Api(), SandboxSpec("img", limits))["host_config"]
    if runtime == "runc":
        assert host["Tmpfs"] == {"/tmp": "rw,nosuid,nodev,size=8388608,nr_inodes=777,mode=1777"}
    else:  # the Sentry's tmpfs would drop nr_inodes: a host tmpfs as an anonymous volume
        assert "Tmpfs" not in host
        (mount,) = [m for m in host["Mounts"] if m["Target"] == "/tmp"]
        assert mount["Type"] == "volume" and not mount["Source"]
        assert mount["VolumeOptions"]["DriverConfig"] == {
            "Name": "local",
            "Options": {"type": "tmpfs", "device": "tmpfs", "o": "size=8388608,nr_inodes=777,mode=1777,nosuid,nodev"},
        }
