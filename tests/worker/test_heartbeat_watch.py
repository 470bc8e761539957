"""When a worker counts as dead to the others: its heartbeat score stood still for ``dead_after``
of an unbroken watch (times are given, not slept)."""

from __future__ import annotations

import pytest

from shared.settings import Settings
from worker.heartbeat_watch import HeartbeatWatch, dead_after_s


def test_dead_after_is_the_stale_time_and_never_under_three_beats() -> None:
    assert dead_after_s(Settings()) == 3.0  # beats every second, stale after 3 s
    assert dead_after_s(Settings(heartbeat_stale_s=0.5)) == 3.0  # three missed beats at least
    assert dead_after_s(Settings(heartbeat_stale_s=0.5, heartbeat_ttl_s=0.9)) == pytest.approx(0.9)  # beats every 0.3 s
    assert dead_after_s(Settings(heartbeat_stale_s=8)) == 8.0


def test_a_worker_whose_score_stands_still_is_dead_after_dead_after() -> None:
    watch = HeartbeatWatch(dead_after=3.0, max_gap=2.0)
    for t in range(5):  # beats every second
        assert watch.look(float(t), ["a"], {"a": 100.0 + t}) == []
    # Killed after its beat at 104: the score stands still from t=4 on.
    for t in (5.0, 6.0, 6.9):
        assert watch.look(t, ["a"], {"a": 104.0}) == []
    assert watch.look(7.0, ["a"], {"a": 104.0}) == ["a"]


def test_a_worker_that_keeps_beating_is_never_dead_however_old_its_score_looks() -> None:
    watch = HeartbeatWatch(dead_after=3.0, max_gap=2.0)
    # Its clock runs an hour behind ours: only movement counts.
    for step in range(20):
        assert watch.look(step * 0.5, ["a"], {"a": -3600.0 + step // 2}) == []


def test_a_worker_without_a_heartbeat_is_dead_only_after_as_long_without_one() -> None:
    watch = HeartbeatWatch(dead_after=3.0, max_gap=2.0)
    assert watch.look(0.0, ["new"], {}) == []
    assert watch.look(1.5, ["new"], {}) == []
    assert watch.look(2.0, ["new"], {"new": 50.0}) == []  # its first beat: a new watch starts
    assert watch.look(3.5, ["new"], {"new": 50.0}) == []
    assert watch.look(4.9, ["new"], {"new": 50.0}) == []
    assert watch.look(5.0, ["new"], {"new": 50.0}) == ["new"]
    # Gone from the set (it left on SIGTERM, or the set expired): as long again.
    assert watch.look(5.5, ["new"], {}) == []
    assert watch.look(7.0, ["new"], {}) == []
    assert watch.look(8.5, ["new"], {}) == ["new"]


def test_a_gap_in_the_watch_or_a_failed_look_starts_every_watch_over() -> None:
    watch = HeartbeatWatch(dead_after=3.0, max_gap=2.0)
    watch.look(0.0, ["a"], {"a": 1.0})
    watch.look(2.0, ["a"], {"a": 1.0})
    # This worker's own thread stalled (or Redis was away) for 2.5 s: what it saw before says nothing.
    assert watch.look(4.5, ["a"], {"a": 1.0}) == []
    assert watch.look(6.0, ["a"], {"a": 1.0}) == []
    assert watch.look(7.5, ["a"], {"a": 1.0}) == ["a"]
    watch.forget()
    assert watch.look(8.0, ["a"], {"a": 1.0}) == []
    assert watch.look(9.5, ["a"], {"a": 1.0}) == []
    assert watch.look(11.0, ["a"], {"a": 1.0}) == ["a"]


def test_only_the_names_asked_about_are_watched() -> None:
    watch = HeartbeatWatch(dead_after=1.0, max_gap=2.0)
    watch.look(0.0, ["a", "b"], {"a": 1.0, "b": 1.0})
    assert watch.look(1.0, ["a"], {"a": 1.0, "b": 1.0}) == ["a"]
    # "b" was forgotten while nobody asked: its watch starts again.
    assert watch.look(1.5, ["a", "b"], {"a": 1.0, "b": 1.0}) == ["a"]
    assert watch.look(2.5, ["a", "b"], {"a": 1.0, "b": 1.0}) == ["a", "b"]
