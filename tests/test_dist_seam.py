"""torchrun's seam without torchrun: a `dist.Session` on a store of its own (rank 0 of 2), another
process's failure written into the store by hand. The command line's session interrupts a main
thread busy elsewhere (a KeyboardInterrupt that `stuck()` names as that failure), never exits the
process from the watchdog's thread; the Python API's waits for the main thread's next `check`."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("torch.distributed")

from embedlens.analysis import dist
from embedlens.errors import RankFailed

FAILURE = {"rank": 1, "message": "'m-not-here' is not a model", "hint": None, "code": 1}


@pytest.fixture
def session(monkeypatch: pytest.MonkeyPatch) -> Iterator[dist.Session]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    made = dist.Session(0, 2, 10.0)
    yield made
    made._stop.set()


def _busy(seconds: float) -> None:
    """The main thread at work elsewhere (loading a model): no collective call, no `check`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


@pytest.fixture
def sigint_handled() -> Iterator[None]:
    """SIGINT handled by Python, as in a command started from a shell in the foreground: a job
    started in the background without job control inherits it ignored, and then
    `interrupt_main` does nothing. (This test failed twice in suite runs this evening, not
    reproduced since; that inheritance is one cause it rules out.)"""
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def test_the_command_lines_session_interrupts_a_busy_main_thread(
    session: dist.Session, sigint_handled: None
) -> None:
    session.interrupt_when_stuck = True
    session.store.set("fail", json.dumps(FAILURE))
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        _busy(dist.GRACE_S + 10)
    assert time.monotonic() - start < dist.GRACE_S + 5
    stuck = session.stuck()
    assert isinstance(stuck, RankFailed) and stuck.message.startswith("rank 1: ")
    session.check()  # the interrupt is the failure: check() does not raise it a second time
    with pytest.raises(RankFailed, match="m-not-here"), session.guarded():
        raise KeyboardInterrupt  # guarded() turns that interrupt into the failure


def test_the_python_apis_session_waits_for_the_main_threads_check(session: dist.Session) -> None:
    session.store.set("fail", json.dumps(FAILURE))
    _busy(dist.GRACE_S + 1)  # not interrupted
    assert session.stuck() is None
    with pytest.raises(RankFailed, match="m-not-here"):
        session.check()


def test_a_failure_the_main_thread_took_up_is_not_interrupted(session: dist.Session) -> None:
    session.interrupt_when_stuck = True
    session.store.set("fail", json.dumps(FAILURE))
    deadline = time.monotonic() + 5
    while session.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(RankFailed):
        session.check()
    _busy(dist.GRACE_S + 1)  # the watchdog leaves it to the main thread: no interrupt
    assert session.stuck() is None
