"""A benchmark that starts a stack or peer servers turns SIGTERM (``timeout``, a CI cancel, ``kill``)
into an unwinding exception, so its ``finally`` stops what it started instead of leaving an API,
workers or servers loading the machine under the next run."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from bench import peers_interleaved, speculative
from bench.serve import stop_on_sigterm


class Stopped(Exception):
    pass


@pytest.fixture
def sigterm_handler() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.mark.usefixtures("sigterm_handler")
def test_a_sigterm_runs_the_finally_blocks() -> None:
    stop_on_sigterm()
    stopped = []
    with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # a point where Python runs the handler
        finally:
            stopped.append(True)
    assert stopped == [True]


@pytest.mark.usefixtures("sigterm_handler")
def test_the_peer_and_speculative_benchmarks_install_it_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise Stopped

    monkeypatch.setattr(peers_interleaved, "bench_settings", refuse)  # the first step after the handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    with pytest.raises(Stopped):
        peers_interleaved.main(["--peers", "llamacpp", "--out", ""])
    assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN, None)

    import worker.engine

    monkeypatch.setattr(worker.engine, "LLM", refuse)
    for argv, installed in ((["--out", ""], False), (["--stack", "--out", ""], True)):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with pytest.raises(Stopped):
            speculative.main(argv)
        assert (signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL) is installed
