"""The pure parts of continuity, with data."""

from __future__ import annotations

from kernelhub.session.continuity import hibernate_deadline, idle_wait


def test_a_session_that_failed_to_hibernate_waits_longer_each_time() -> None:
    assert [idle_wait(30.0, n) for n in range(4)] == [30.0, 60.0, 120.0, 240.0]
    assert idle_wait(30.0, 6) == idle_wait(30.0, 100) == 30.0 * 64  # bounded


def test_a_hibernation_is_bounded_by_the_lower_timeout_and_names_it() -> None:
    assert hibernate_deadline(300.0, 600.0) == (300.0, "KERNELHUB_GATEWAY__HIBERNATE_TIMEOUT")
    assert hibernate_deadline(300.0, 20.0) == (20.0, "KERNELHUB_GATEWAY__SNAPSHOT_TIMEOUT")
