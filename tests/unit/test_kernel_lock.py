"""The session's kernel lock (``sessions/kernel.py``): ``try_locked``, which the idle pause takes,
never waits for a holder, and a thread that holds it already enters again."""

from __future__ import annotations

import threading

from sandloop.sessions.kernel import Kernel, lock_file


def kernel(tmp_path) -> Kernel:  # type: ignore[no-untyped-def]
    return Kernel(None, None, "s-0", lock_file(tmp_path), lifetime=60)  # type: ignore[arg-type]


def test_try_locked_yields_false_at_once_while_another_holds_the_lock(tmp_path):
    holder, other = kernel(tmp_path), kernel(tmp_path)  # two handles: two open files, as two processes
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with holder.locked():
            inside.set()
            leave.wait(60)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(60)
    with other.try_locked() as held:
        assert held is False
    leave.set()
    t.join(60)
    with other.try_locked() as held:
        assert held is True
        with holder.try_locked() as second:  # held by `other` now: another handle gets False
            assert second is False
    with holder.try_locked() as held:  # let go at the end of the block
        assert held is True


def test_a_thread_holding_the_lock_enters_try_locked_again(tmp_path):
    k = kernel(tmp_path)
    with k.locked(), k.try_locked() as held:
        assert held is True
        with k.locked():
            pass
    with k.try_locked() as held:
        assert held is True
