"""checkpoint/promoter.py, the one background promoter of committed steps between places: which steps it copies,
in what order, what it protects, and what a failure does (real threads, no training)."""

from __future__ import annotations

import threading

import pytest

from checkpoint.places.promoter import NEWEST, ORDERED, Promoter


def test_ordered_copies_every_step_in_order():
    copied = []
    p = Promoter("t", lambda step, job: copied.append((step, job)), mode=ORDERED)
    for s in (2, 4, 6):
        p.submit(s, f"job{s}")
    p.wait()
    assert copied == [(2, "job2"), (4, "job4"), (6, "job6")]
    assert p.protected() == set() and p.close(5)


def test_ordered_failure_is_raised_in_the_caller_and_its_steps_stay_protected():
    """A failed copy is re-raised at wait (once); a step queued behind it is not copied until then, and both stay
    protected (their source still holds them); after the report, copying goes on."""
    gate, copied = threading.Event(), []

    def copy(step, job):
        if step == 2:
            gate.wait(5)
            raise OSError("shared tier gone")
        copied.append(step)

    p = Promoter("t", copy, mode=ORDERED)
    p.submit(2)
    p.submit(4)
    gate.set()
    with pytest.raises(OSError, match="shared tier gone"):
        p.wait()
    assert copied == [] and p.protected() == {2, 4}
    p.poll()  # reported once
    p.submit(6)
    p.wait()
    assert copied == [6] and p.protected() == {2, 4}
    assert p.close(5)


def test_newest_replaces_a_waiting_step_and_protects_what_waits_or_runs():
    started, release, copied = threading.Event(), threading.Event(), []

    def copy(step, job):
        started.set()
        release.wait(5)
        copied.append(step)

    p = Promoter("t", copy, mode=NEWEST)
    p.submit(1)
    assert started.wait(5)
    p.submit(2)
    p.submit(3)  # replaces 2, still waiting
    assert p.protected() == {1, 3} and p.holds(3) and not p.holds(2) and p.skipped == 1
    release.set()
    p.wait()
    assert copied == [1, 3] and p.protected() == set()
    assert p.close(5)


def test_a_retry_gives_way_to_a_newer_step():
    seen = []

    def copy(step, job):
        seen.append(step)
        if step == 1:
            seen.append(p.newer_waiting(5))  # waits for the backoff unless a newer step arrives

    p = Promoter("t", copy, mode=NEWEST)
    p.submit(1)
    threading.Timer(0.2, p.submit, (2,)).start()
    p.close(10)
    assert seen == [1, True, 2]


def test_close_copies_what_waits_and_reports_a_copy_that_does_not_end():
    release = threading.Event()
    p = Promoter("t", lambda step, job: release.wait(10), mode=ORDERED)
    p.submit(1)
    assert p.close(0.2) is False and p.current == 1  # still copying: the caller says so
    release.set()
    assert p.close(5) is True
