"""The bwrap path's seccomp program is libseccomp's binary tree (``CTL_OPTIMIZE=2``), not its
linear chain of comparisons: cheaper per syscall, and it must give the same verdict for every
syscall. Both programs are run here by a small classic-BPF interpreter over every syscall number
of both architectures the profile names, with the argument values its conditional rules test."""

from __future__ import annotations

import struct

import pytest

from sandloop import SandboxLimits
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.oci import bwrap
from sandloop.runtime.oci.generate import docker_config

pyseccomp = pytest.importorskip("pyseccomp")

AUDIT_ARCH = {"x86_64": 0xC000003E, "x86": 0x40000003, "x32": 0xC000003E}
X32_BIT = 0x40000000


def decode(program: bytes) -> list[tuple[int, int, int, int]]:
    return [struct.unpack_from("<HBBI", program, i) for i in range(0, len(program), 8)]


def run_bpf(insns: list[tuple[int, int, int, int]], nr: int, arch: int, args: tuple[int, ...]) -> int:
    """Classic BPF as the kernel runs a seccomp filter over ``struct seccomp_data``."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *args)
    a = x = 0
    mem = [0] * 16
    pc = 0
    for _ in range(len(insns) + 1):  # classic BPF only jumps forward
        code, jt, jf, k = insns[pc]
        cls = code & 0x07
        if cls == 0x00:  # LD
            a = struct.unpack_from("<I", data, k)[0] if code & 0xE0 == 0x20 else mem[k] if code & 0xE0 == 0x60 else k
        elif cls == 0x01:  # LDX
            x = mem[k] if code & 0xE0 == 0x60 else k
        elif cls == 0x02:  # ST
            mem[k] = a
        elif cls == 0x03:  # STX
            mem[k] = x
        elif cls == 0x04:  # ALU
            v = x if code & 0x08 else k
            op = code & 0xF0
            if op == 0x50:
                a &= v
            elif op == 0x40:
                a |= v
            elif op == 0x00:
                a = (a + v) & 0xFFFFFFFF
            elif op == 0x10:
                a = (a - v) & 0xFFFFFFFF
            elif op == 0xA0:
                a ^= v
            elif op == 0x60:
                a = (a << v) & 0xFFFFFFFF
            elif op == 0x70:
                a >>= v
            else:
                raise AssertionError(f"ALU op {op:#x} not interpreted here")
        elif cls == 0x05:  # JMP
            if code & 0xF0 == 0x00:  # JA
                pc += 1 + k
                continue
            v = x if code & 0x08 else k
            op = code & 0xF0
            if op == 0x10:
                taken = a == v
            elif op == 0x20:
                taken = a > v
            elif op == 0x30:
                taken = a >= v
            elif op == 0x40:
                taken = bool(a & v)
            else:
                raise AssertionError(f"JMP op {op:#x} not interpreted here")
            pc += 1 + (jt if taken else jf)
            continue
        elif cls == 0x06:  # RET
            return a if code & 0x18 == 0x10 else k
        elif cls == 0x07:  # MISC
            if code & 0xF8 == 0x00:
                x = a
            else:
                a = x
        pc += 1
    raise AssertionError("the program did not end")


def _compiled(profile: dict, optimize: bool) -> bytes:
    bwrap._compiled.clear()
    if optimize:
        return bwrap.compile_seccomp(profile)
    real = pyseccomp.SyscallFilter.set_attr

    def no_tree(self, attr, value):
        if attr != pyseccomp.Attr.CTL_OPTIMIZE:
            real(self, attr, value)

    pyseccomp.SyscallFilter.set_attr = no_tree
    try:
        return bwrap.compile_seccomp(profile)
    finally:
        pyseccomp.SyscallFilter.set_attr = real
        bwrap._compiled.clear()


def test_the_tree_gives_the_linear_programs_verdict_for_every_syscall():
    profile = docker_config(SandboxSpec("image", SandboxLimits()), {"Env": [], "Cmd": ["true"]})["linux"]["seccomp"]
    tree_bpf, linear_bpf = _compiled(profile, True), _compiled(profile, False)
    assert tree_bpf != linear_bpf  # a different program...
    tree, linear = decode(tree_bpf), decode(linear_bpf)
    # every syscall with no argument, and those the profile's rules test with each value they test
    values = {0, 0xFFFFFFFF}
    tested: set[int] = set()
    for rule in profile["syscalls"]:
        for arg in rule.get("args") or []:
            values |= {arg.get("value", 0), arg.get("value", 0) + 1}
        for name in rule["names"] if rule.get("args") else ():
            for arch in (pyseccomp.Arch.X86_64, pyseccomp.Arch.X86):
                try:
                    tested.add(pyseccomp.resolve_syscall(arch, name))
                except Exception:  # noqa: BLE001 - a name this architecture lacks
                    continue
    assert tested  # clone, personality, ...
    archs = (AUDIT_ARCH["x86_64"], AUDIT_ARCH["x86"])
    cases = [(arch, nr, 0) for arch in archs for nr in range(-1, 460)]
    cases += [(arch, nr, v) for arch in archs for nr in tested for v in values]
    cases += [(AUDIT_ARCH["x86_64"], nr, 0) for nr in range(X32_BIT, X32_BIT + 560, 3)]  # x32's numbers
    cases += [(0xDEADBEEF, nr, 0) for nr in range(0, 460, 9)]  # an architecture the profile does not name
    for arch, nr, v in cases:
        args = (v,) * 6
        verdict = run_bpf(tree, nr, arch, args)
        assert verdict == run_bpf(linear, nr, arch, args), (hex(arch), nr, v)  # ...the same verdicts
    # and the interpreter is not vacuous: allowed, denied (errno) and other-arch verdicts differ
    verdicts = {run_bpf(tree, nr, AUDIT_ARCH["x86_64"], (0,) * 6) for nr in range(0, 460)}
    assert 0x7FFF0000 in verdicts and any(v & 0xFFFF0000 == 0x00050000 for v in verdicts)
