"""The direct OCI backend against Docker on the same host: the same config, the same isolation seen
from inside, OOM told apart from a program's own SIGKILL, nothing left behind (states, cgroups,
bundles), the reaper after the owner is SIGKILLed, and the read-only root file system store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandloop import SandboxLimits
from sandloop.contract import SandboxError
from sandloop.runner import build_request
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.docker import DockerBackend
from sandloop.runtime.oci import DirectSandbox, OCIBackend
from sandloop.runtime.oci.config import PER_RUN_FIELDS, diff, docker_bundle_config
from sandloop.settings import runtime_image

STATE = Path("/run/sandloop/oci")


@pytest.fixture(scope="module")
def oci():
    backend = OCIBackend(DockerBackend())
    problem = backend.host_problem()
    assert problem is None, problem
    yield backend
    backend.close()


def _leftovers(sandbox_ids, runtime="runc") -> list[str]:
    out = []
    states = list((STATE / "runtime" / runtime).glob("*")) if (STATE / "runtime" / runtime).is_dir() else []
    for sid in sandbox_ids:
        if (STATE / "bundles" / sid).exists():
            out.append(f"bundle {sid}")
        out += [f"state {p.name}" for p in states if sid in p.name]
        out += [str(p) for p in Path("/sys/fs/cgroup").glob(f"*/sandloop/{sid}")]
        out += [f"mount {line.split()[1]}" for line in Path("/proc/mounts").read_text().splitlines() if sid in line]
    return out


def _request(code, timeout=30, limits=None, **kw):
    return build_request(code, "python", timeout, limits=limits or SandboxLimits(), image=runtime_image(), **kw)


@pytest.mark.parametrize(
    "limits",
    [
        SandboxLimits(),
        SandboxLimits(memory="128m", cpus=1.0, pids=32, open_files=256, tmpfs_size="16m"),
        SandboxLimits(runtime="runsc", tmpfs_inodes=1000),  # /tmp: a host tmpfs of the bundle's
    ],
    ids=["defaults", "other-limits", "runsc"],
)
def test_the_config_is_dockers_own_but_for_the_per_run_fields(oci, limits):
    spec = SandboxSpec(runtime_image(), limits.for_container())
    live = oci.docker.launch(spec, purpose="run", lifetime_seconds=60)
    try:
        docker_config = docker_bundle_config(live.id)
    finally:
        oci.docker.destroy(live)
    direct = oci.launch(spec, purpose="run", lifetime_seconds=60)
    try:
        assert isinstance(direct, DirectSandbox)
        ours = json.loads((direct.bundle / "config.json").read_text())
    finally:
        oci.destroy(direct)
    assert docker_config is not None
    assert diff(ours, docker_config) == []
    # and the per-run fields are what they should be
    changed = set(diff(ours, docker_config, ignore=()))
    assert changed and all(any(c == f or c.startswith(f + ".") for f in PER_RUN_FIELDS) for c in changed)
    assert ours["root"] == {"path": str(oci.store.rootfs(runtime_image())), "readonly": True}
    assert ours["linux"]["cgroupsPath"] == f"/sandloop/{direct.id}"
    assert ours["annotations"]["sandloop.purpose"] == "run"
    assert ours["linux"]["resources"]["memory"]["limit"] == limits.memory_bytes
    assert ours["process"]["user"]["uid"] == 65534 and ours["process"]["capabilities"] == {}
    tmp = next(m for m in ours["mounts"] if m["destination"] == "/tmp")
    if limits.runtime == "runsc":
        assert tmp["type"] == "bind" and tmp["source"] == str(direct.bundle / "tmp")
    else:
        assert tmp["type"] == "tmpfs" and f"nr_inodes={limits.tmpfs_inodes}" in tmp["options"]


PROBES = textwrap.dedent(
    r"""
    import errno, json, os, resource, socket
    out = {}
    status = dict(l.split(":\t", 1) for l in open("/proc/self/status").read().splitlines() if ":\t" in l)
    for k in ("Uid", "Gid", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs", "Seccomp"):
        out[k] = status.get(k, "-").split()
    out["hostname"] = socket.gethostname()
    out["ifaces"] = sorted(name for _, name in socket.if_nameindex())
    out["nofile"] = resource.getrlimit(resource.RLIMIT_NOFILE)
    mounts = {}
    # (and the file descriptors gVisor's 9p mounts happen to get)
    overlay = ("lowerdir", "upperdir", "workdir", "xino", "index", "metacopy", "redirect", "rfdno", "wfdno")
    for line in open("/proc/self/mounts"):
        dev, target, fstype, opts = line.split()[:4]
        if target in ("/", "/tmp", "/dev", "/dev/shm", "/proc", "/sys", "/etc/hostname"):
            kept = sorted(o for o in opts.split(",") if not o.startswith(overlay))
            mounts[target] = (fstype if target != "/" else "-", kept)
    out["mounts"] = mounts
    def attempt(f):
        try:
            f()
            return "ok"
        except OSError as e:
            return errno.errorcode[e.errno]
    out["write_root"] = attempt(lambda: open("/usr/evil", "w"))
    out["write_proc_sys"] = attempt(lambda: open("/proc/sys/kernel/hostname", "w").write("x"))
    out["kcore"] = attempt(lambda: open("/proc/kcore", "rb").read(1))
    out["unshare"] = attempt(lambda: os.unshare(os.CLONE_NEWUSER)) if hasattr(os, "unshare") else "-"
    out["setuid"] = attempt(lambda: os.setuid(0))
    with open("/tmp/x.sh", "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod("/tmp/x.sh", 0o755)
    out["exec_tmp"] = attempt(lambda: __import__("subprocess").run(["/tmp/x.sh"]))
    out["devices"] = sorted(os.listdir("/dev"))
    print(json.dumps(out, sort_keys=True))
    """
)


def test_isolation_probes_give_the_same_answers_as_docker(oci, runtime):
    request = _request(PROBES, limits=SandboxLimits(runtime=runtime))
    through_docker = oci.docker.run(request)
    direct = oci.run(request)
    assert through_docker.ok and direct.ok, (through_docker.stderr, direct.stderr)
    a, b = json.loads(through_docker.stdout), json.loads(direct.stdout)
    mounts_a, mounts_b = a.pop("mounts"), b.pop("mounts")
    assert a == b
    assert mounts_a.keys() == mounts_b.keys()
    for target in mounts_a:
        if target == "/":  # a read-only overlay under Docker, a read-only bind of the store here
            assert "ro" in mounts_a[target][1] and "ro" in mounts_b[target][1]
        else:
            assert mounts_a[target] == mounts_b[target], target
    assert b["Uid"][0] == "65534" and b["CapEff"] == ["0000000000000000"]
    assert b["NoNewPrivs"] == (["1"] if runtime == "runc" else ["-"])  # gVisor does not show it
    assert b["ifaces"] == ["lo"] and b["write_root"] in ("EROFS", "EACCES")  # gVisor: EACCES
    assert b["Seccomp"] == (["2"] if runtime == "runc" else ["0"])  # gVisor: its own syscall surface


@pytest.mark.parametrize(
    "code, exit_code, oom",
    [
        ("x = bytearray(400 * 1024 * 1024)", 137, True),
        ("import os\nos.kill(os.getpid(), 9)", 137, False),
        ("import sys\nsys.exit(137)", 137, False),
        ("import sys\nsys.exit(3)", 3, False),
    ],
    ids=["oom", "own-sigkill", "exit-137", "exit-3"],
)
def test_oom_is_told_apart_from_a_programs_own_kill(oci, runtime, code, exit_code, oom):
    r = oci.run(_request(code, limits=SandboxLimits(memory="128m", runtime=runtime)))
    assert r.backend == "oci"
    assert (r.exit_code, r.oom_killed, r.timed_out) == (exit_code, oom, False), r


def test_a_timeout_kills_and_leaves_nothing(oci, runtime):
    limits = SandboxLimits(runtime=runtime)
    sandbox = oci.launch(_request("x", limits=limits).spec, purpose="run", lifetime_seconds=60)
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    r = oci.execute(sandbox, _request(code, timeout=1.5, limits=limits))
    assert r.timed_out and r.exit_code == -1 and r.stdout == "started\n" and r.duration_seconds < 10
    oci.destroy(sandbox)
    assert oci.drain(30)
    assert _leftovers([sandbox.id], runtime) == []


@pytest.mark.serial  # counts the host's zombies and runtime states: other workers' runs would be among them
def test_many_runs_leave_no_state_cgroup_bundle_or_zombie(oci, runtime):
    ids = []
    limits = SandboxLimits(runtime=runtime)
    for i in range(50 if runtime == "runc" else 10):
        sandbox = oci.launch(_request("x", limits=limits).spec, purpose="run", lifetime_seconds=60)
        ids.append(sandbox.id)
        try:
            assert oci.execute(sandbox, _request(f"print({i})", limits=limits)).stdout == f"{i}\n"
        finally:
            oci.destroy(sandbox)
    assert oci.drain(60)
    assert _leftovers(ids, runtime) == []
    # ours, or runsc's sandbox and gofer (``exe``) left to the host's init: none
    rows = [
        r.split()
        for r in subprocess.run(["ps", "-eo", "stat=,ppid=,comm="], capture_output=True, text=True).stdout.splitlines()
    ]
    zombies = [r for r in rows if r[0].startswith("Z") and (r[1] == str(os.getpid()) or r[2] == "exe")]
    assert zombies == []


def test_the_runtime_parent_killed_mid_run_gives_a_result_and_leaves_nothing(oci):
    sandbox = oci.launch(_request("x").spec, purpose="run", lifetime_seconds=60)
    assert isinstance(sandbox, DirectSandbox)
    sandbox.proc.kill()  # runc's own process, not the sandbox
    try:
        r = oci.execute(sandbox, _request("print('still answers')", timeout=10))
    except SandboxError as exc:  # killed before the container was made
        assert "was killed (signal 9)" in str(exc) and "run it again" in str(exc)
    else:  # killed after: the container lives on without its parent and still answers
        assert r.stdout == "still answers\n" and r.ok, r
    oci.destroy(sandbox)
    assert oci.drain(30)
    assert _leftovers([sandbox.id]) == []


def test_an_owner_killed_mid_run_is_reaped_in_one_pass(oci, runtime):
    script = textwrap.dedent(
        """
        import sys, time
        from sandloop import SandboxLimits
        from sandloop.runtime.docker import DockerBackend
        from sandloop.runtime.oci import OCIBackend
        from sandloop.runner import build_request
        from sandloop.settings import runtime_image
        b = OCIBackend(DockerBackend())
        r = build_request("import time\\nprint('up', flush=True)\\ntime.sleep(300)", "python", 300,
                          limits=SandboxLimits(runtime=sys.argv[1]), image=runtime_image())
        s = b.launch(r.spec, purpose="run", lifetime_seconds=300)
        print(s.id, flush=True)
        b.execute(s, r)
        """
    )
    owner = subprocess.Popen([sys.executable, "-c", script, runtime], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    sandbox_id = owner.stdout.readline().strip()
    time.sleep(1.0)
    assert (STATE / "bundles" / sandbox_id).is_dir()
    if runtime == "runsc":  # its /tmp is a host tmpfs in the bundle (runtime/tmpfs.py): reaped too
        assert (STATE / "bundles" / sandbox_id / "tmp").is_mount()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    from sandloop.pool.reaper import reap

    assert sandbox_id.startswith("sandloop-")
    reap(oci)
    assert _leftovers([sandbox_id], runtime) == []


def test_the_exported_root_is_read_only_on_the_host_too(oci):
    rootfs = oci.store.rootfs(runtime_image())
    with pytest.raises(OSError) as caught:
        (rootfs / "usr" / "evil").write_text("x")
    assert caught.value.errno == 30  # EROFS: a read-only bind of the store onto itself
    assert (rootfs / "etc" / "hostname").is_file() and (rootfs / "proc").is_dir()


def test_what_the_backend_does_not_run_directly_goes_to_docker(oci):
    for limits in (SandboxLimits(network=True), SandboxLimits(network=True, runtime="runsc")):
        reason = oci.why_not_direct(SandboxSpec(runtime_image(), limits))
        assert reason and ("Docker" in reason)
        sandbox = oci.launch(SandboxSpec(runtime_image(), limits), purpose="run", lifetime_seconds=60)
        try:
            assert not isinstance(sandbox, DirectSandbox)
        finally:
            oci.destroy(sandbox)
    info = oci.info()
    assert info.name == "oci" and info.details["direct runs"] == "runc, runsc"


def test_stores_of_gone_images_and_half_written_bundles_are_collected(tmp_path):
    backend = OCIBackend(DockerBackend(), store=tmp_path / "store", state=tmp_path / "state")
    try:
        gone = tmp_path / "store" / "images" / ("0" * 64) / "rootfs"
        used = tmp_path / "store" / "images" / ("1" * 64) / "rootfs"
        for rootfs in (gone, used):
            (rootfs / "usr").mkdir(parents=True)
        bundle = tmp_path / "state" / "bundles" / "sandloop-live"
        bundle.mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps({"root": {"path": str(used)}, "annotations": {}}))
        half = tmp_path / "state" / "bundles" / ".sandloop-half"
        half.mkdir()
        os.utime(half, (time.time() - 3600, time.time() - 3600))
        emptied = tmp_path / "state" / "bundles" / "sandloop-emptied"  # a removal cut short
        emptied.mkdir()
        os.utime(emptied, (time.time() - 3600, time.time() - 3600))
        removed = backend.collect_garbage()
        assert set(removed) == {"0" * 64, ".sandloop-half", "sandloop-emptied"}
        assert not gone.exists() and used.is_dir() and bundle.is_dir() and not half.exists()
        assert not emptied.exists()
    finally:
        backend.close()


def test_a_runsc_sandboxes_tmp_left_dangling_is_reaped(oci):
    """Under gVisor /tmp is an anonymous tmpfs volume (runtime/tmpfs.py), removed with its
    container; one whose container went without it (a crash, a `docker rm -f` by hand) is found by
    its label and removed by the reaper (before: 17 were found left on this machine)."""
    from sandloop.pool.reaper import reap

    docker_backend = oci.docker
    live = docker_backend.launch(
        _request("x", limits=SandboxLimits(runtime="runsc")).spec, purpose="run", lifetime_seconds=60
    )
    (volume,) = [
        m["Name"] for m in docker_backend.api.inspect_container(live.id)["Mounts"] if m["Destination"] == "/tmp"
    ]
    docker_backend.api.remove_container(live.id, force=True)  # without v=True
    assert docker_backend.api.inspect_volume(volume)["Labels"] == {"sandloop.tmpfs": "1"}
    reaped = reap(oci)
    assert ("tmpfs", volume) in [(r.kind, r.id) for r in reaped] and not [r for r in reaped if r.error]
    assert volume not in [v["Name"] for v in docker_backend.api.volumes().get("Volumes") or []]
