from sandloop import ExecutionResult, SandboxLimits
from sandloop.contract import CellResult
from sandloop.notes import sandbox_notes


def _r(**kw):
    kw.setdefault("exit_code", 0)
    kw.setdefault("duration_seconds", 0.1)
    return ExecutionResult(**kw)


def test_clean_run_has_no_notes():
    assert sandbox_notes(_r(stdout="42\n")) == []


def test_oom_note_uses_the_applied_limit():
    notes = sandbox_notes(_r(exit_code=137, oom_killed=True, limits=SandboxLimits(memory="1g")))
    assert len(notes) == 1
    assert "killed by the sandbox (SIGKILL): it exceeded the 1g memory limit" in notes[0]
    assert "stream instead of building the whole result in memory" in notes[0]


def test_timeout_note_names_the_timeout():
    (note,) = sandbox_notes(_r(exit_code=-1, timed_out=True, timeout_seconds=2.5, stdout="x"))
    assert "after 2.5 s" in note


def test_truncation_note_says_how_much_was_dropped():
    notes = sandbox_notes(_r(stdout="x", stdout_truncated=True, stdout_dropped_bytes=3 * 1024 * 1024))
    assert any("stdout truncated" in n and "3.0 MB" in n for n in notes)


def test_silent_run_note():
    assert "printed nothing" in sandbox_notes(_r())[0]


def test_pids_network_readonly_notes():
    lim = SandboxLimits(pids=32)
    notes = sandbox_notes(
        _r(exit_code=1, stderr="BlockingIOError: [Errno 11] Resource temporarily unavailable", limits=lim)
    )
    assert any("at most 32" in n for n in notes)
    notes = sandbox_notes(_r(exit_code=1, stderr="socket.gaierror: [Errno -3] Temporary failure in name resolution"))
    assert any("this sandbox has no network" in n for n in notes)
    notes = sandbox_notes(_r(exit_code=1, stderr="OSError: [Errno 30] Read-only file system: '/etc/x'"))
    assert any("Write files under /tmp" in n for n in notes)


def test_a_cell_that_shows_a_value_or_chart_is_not_silent():
    from sandloop.contract import Artifact, CellResult

    assert sandbox_notes(CellResult(exit_code=0, duration_seconds=0.1, value="42")) == []
    art = Artifact(name="figure-1.png", mime_type="image/png", data=b"\x89PNG")
    assert sandbox_notes(CellResult(exit_code=0, duration_seconds=0.1, artifacts=[art])) == []
    # a silent cell (an assignment, an import): a notebook shows nothing either, and says nothing
    assert sandbox_notes(CellResult(exit_code=0, duration_seconds=0.1)) == []


def test_a_cell_interrupted_for_time_keeps_its_interpreter_and_says_so():
    kept = sandbox_notes(CellResult(exit_code=-1, timed_out=True, duration_seconds=1, timeout_seconds=5))
    assert "interrupted" in kept[0] and "variables are kept" in kept[0] and "killed" not in kept[0]
    gone = sandbox_notes(
        CellResult(exit_code=-1, timed_out=True, interpreter_restarted=True, duration_seconds=9, timeout_seconds=5)
    )
    assert "restarted" in gone[0] and "variables are gone" in gone[0]
    run = sandbox_notes(ExecutionResult(exit_code=-1, timed_out=True, duration_seconds=5, timeout_seconds=5))
    assert "killed the program" in run[0]


def test_a_cut_value_is_explained():
    notes = sandbox_notes(CellResult(exit_code=0, duration_seconds=0.1, value="'xx...", value_omitted_chars=500))
    assert any("value cut" in n and "500" in n for n in notes)


def test_gvisor_statx_note_only_under_runsc():
    err = "ls: cannot access '/tmp': Invalid argument\n"
    assert any("gVisor" in n for n in sandbox_notes(_r(exit_code=2, stderr=err, limits=SandboxLimits(runtime="runsc"))))
    assert not any("gVisor" in n for n in sandbox_notes(_r(exit_code=2, stderr=err)))


def test_an_artifacts_repr_names_it_instead_of_dumping_its_bytes():
    from sandloop.contract import Artifact

    art = Artifact(name="figure-1.png", mime_type="image/png", data=b"\x89PNG" + b"\0" * 50_000)
    assert repr(art) == "Artifact(name='figure-1.png', mime_type='image/png', 50,004 bytes)" == str(art)


def test_an_http_answer_as_the_model_reads_it():
    from sandloop.contract import HttpAnswer
    from sandloop.present import present_http

    answer = HttpAnswer(status=404, reason="Not Found", headers={"content-type": "text/html"}, body=b"<p>gone</p>")
    assert present_http(answer) == "HTTP 404 Not Found\ncontent-type: text/html\n\n<p>gone</p>"
    long = HttpAnswer(status=200, reason="OK", body=b"x" * 50, truncated=True)
    cut = "x" * 10 + "\n... [the body goes on past the first 10 characters]"
    assert present_http(long, body_chars=10).endswith(cut)
    assert present_http(HttpAnswer(status=204)).endswith("\n(empty body)")
