"""Rounds (``sja.core.rounds``): which agents count as live, when a round closes early, and how long
replies have when a round is taken late."""

from __future__ import annotations

import pytest

from sja.core.rounds import all_replied, close_by, live_agents


def test_round_closes_early_only_when_every_live_agent_replied() -> None:
    seen = {"a1": 99.0, "a2": 100.0, "dead": 50.0}
    live = live_agents(seen, now=100.5, liveness_s=3.0)
    assert live == {"a1", "a2"}
    assert not all_replied(["a1"], live)
    assert all_replied(["a1", "a2"], live)
    assert all_replied(["a2", "a1", "dead"], live)
    assert not all_replied(["a1"], set()), "no known agent: wait for the deadline"


def test_a_round_waits_past_its_deadline_only_for_a_live_agent() -> None:
    assert close_by(100.0, 0.2, live={"a1"}) == pytest.approx(100.2)
    assert close_by(100.0, 0.2, live=set()) == 100.0


def test_a_round_taken_late_still_gets_its_whole_reply_window() -> None:
    # Issued at 100 with a 50 ms window, taken by a busy clearer at 100.3: replies have until 100.35.
    assert close_by(100.05, 0.0, {"a1"}, issued_at=100.0, received_at=100.3) == pytest.approx(100.35)
    assert close_by(100.05, 0.2, {"a1"}, issued_at=100.0, received_at=100.01) == pytest.approx(100.26)
