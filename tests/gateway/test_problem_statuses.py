"""Every code the bus can answer with has the right HTTP status."""

from __future__ import annotations

from sandhold.gateway.problems import ProblemError


def test_a_dead_lettered_request_is_a_server_error_not_a_conflict():
    error = ProblemError("not_handled", "the request failed 10 attempts at being handled")
    assert error.status == 500
    assert error.problem("/api/v1/sandboxes").title == "Request could not be handled"
