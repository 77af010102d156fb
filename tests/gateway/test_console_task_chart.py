"""The task page's chart (console/task_chart.py), pure: task events made by
hand, the SVG read back as XML. A band per stage in order; a failed attempt's
cross and its retry wait; a hang warning's triangle; timeouts, a cancel and
the end as marks of their own; a task still going drawn up to now; every word
escaped."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from sandhold.domain import events as ev
from sandhold.domain import task as tk
from sandhold.domain.envelope import Recorded, wrap
from sandhold.gateway.console.task_chart import SHOWN, WIDTH, task_chart

from tests.domain.test_task import TID, submit

T0 = 1_700_000_000.0


def records(*timed: tuple[float, ev.AnyEvent]) -> list[Recorded]:
    """The task's submission at T0, then each event at T0 + its offset."""
    (submitted,) = tk.decide(None, submit())
    events = [(0.0, submitted), *timed]
    return [
        Recorded(
            seq,
            wrap(
                [event],
                aggregate_id=TID,
                id_base=f"e{seq}",
                actor="orchestrator-1",
                causation_id="c",
                correlation_id="c",
                time=T0 + offset,
            )[0],
        )
        for seq, (offset, event) in enumerate(events, start=1)
    ]


def chart(recs: list[Recorded], now: float = T0 + 1000) -> ET.Element:
    out = task_chart(recs, now)
    assert out.startswith('<figure class="chart task-chart">'), out
    return ET.fromstring(out)  # well-formed: everything in it escaped


def svg(figure: ET.Element) -> ET.Element:
    found = figure.find("svg")
    assert found is not None
    return found


def groups(figure: ET.Element, cls: str) -> list[ET.Element]:
    return [g for g in svg(figure).iter("g") if g.get("class") == cls]


def title(g: ET.Element) -> str:
    return g.findtext("title") or ""


def caption(figure: ET.Element) -> str:
    return "".join(figure.find("figcaption").itertext())  # type: ignore[union-attr]


def stage(offset: float, name: str) -> tuple[float, ev.AnyEvent]:
    return offset, ev.TaskStageEntered(stage=name)  # type: ignore[arg-type]


COMPLETED = [
    stage(1, "staging"),
    stage(5, "provisioning"),
    stage(10, "running"),
    stage(40, "completing"),
    (42.0, ev.TaskCompleted()),
]


def test_a_band_per_stage_in_the_order_entered_each_to_the_next() -> None:
    figure = chart(records(*COMPLETED))
    bands = groups(figure, "stage")
    names = [(g.findtext("text") or "").split(" ")[0] for g in bands]
    assert names == ["pending", "staging", "provisioning", "running", "completing"]
    rects = [g.find("rect") for g in bands]
    xs = [(float(r.get("x", "")), float(r.get("width", ""))) for r in rects if r is not None]
    for (x, width), (next_x, _) in zip(xs, xs[1:], strict=False):
        assert abs(x + width - next_x) < 0.2  # each band ends where the next begins
    ys = [float(r.get("y", "")) for r in rects if r is not None]
    assert ys == sorted(ys) and len(set(ys)) == len(ys)  # a row each, top to bottom
    assert [g.findtext("text") for g in bands][1:] == [
        "staging 4.0 s",
        "provisioning 5.0 s",
        "running 30 s",
        "completing 2.0 s",
    ]
    assert title(bands[3]) == "running: entered at +10 s, 30 s"

    # The end: a vertical line and a disc, and the axis from 0 s to its duration.
    (end,) = groups(figure, "end")
    assert title(end) == "completed, after 42 s"
    assert end.find("line") is not None and end.find("circle") is not None
    (axis,) = groups(figure, "axis")
    assert [t.text for t in axis.iter("text")] == ["0 s", "42 s"]
    assert svg(figure).get("viewBox", "").startswith(f"0 0 {WIDTH} ")
    assert svg(figure).get("width") == str(SHOWN) and svg(figure).get("role") == "img"
    label = svg(figure).get("aria-label", "")
    assert "staging 4.0 s, provisioning 5.0 s, running 30 s" in label
    assert "completed, after 42 s" in label
    words = caption(figure)
    assert "band: a stage" in words and "vertical line: the end" in words
    assert "cross" not in words  # the legend explains the shapes drawn
    # (The page's tests find the table's "Completed" after its "Entered running".)
    assert "Completed" not in task_chart(records(*COMPLETED), T0 + 1000)


def test_a_failed_attempt_is_a_cross_with_its_retry_wait_dashed_up_to_when_it_was_due() -> None:
    failed = ev.TaskOperationFailed(
        operation="clone",
        attempt=1,
        error_class="network",
        reason="network",
        detail="connection reset",
        retry_at=T0 + 4.5,
    )
    last = ev.TaskOperationFailed(
        operation="clone", attempt=2, error_class="permanent", reason="not_found"
    )
    figure = chart(
        records(
            stage(1, "staging"),
            (2.0, failed),
            (6.0, last),
            (7.0, ev.TaskFailed(reason="clone_failed", stage="staging")),
        )
    )
    first, second = groups(figure, "failed-attempt")
    assert title(first) == (
        "clone attempt 1 failed: network (network) — connection reset; retried (at +2.0 s)"
    )
    assert title(second) == "clone attempt 2 failed: not_found (permanent); not retried (at +6.0 s)"
    cross = first.find("path")
    assert cross is not None
    (wait,) = [g for g in first.iter("g") if g.get("class") == "retry-wait"]
    assert title(wait) == "retry wait: 2.5 s, due at +4.5 s"
    dashed, tick = wait.findall("line")
    assert dashed.get("stroke-dasharray")
    cross_x = float(cross.get("d", "M0").split(",")[0][1:]) + 5  # from its top-left corner
    assert abs(float(dashed.get("x1", "")) - cross_x) < 0.2
    assert float(dashed.get("x2", "")) == float(tick.get("x1", "")) > cross_x
    assert not [g for g in second.iter("g") if g.get("class") == "retry-wait"]
    # Both on the staging band's row.
    staging = groups(figure, "stage")[1].find("rect")
    assert staging is not None
    row_mid = float(staging.get("y", "")) + float(staging.get("height", "")) / 2
    assert dashed.get("y1") == f"{row_mid:.1f}"
    (end,) = groups(figure, "end")
    assert title(end) == "failed in staging: clone_failed, after 7.0 s"
    assert end.find("rect") is not None  # a square
    words = caption(figure)
    assert "cross: a failed attempt" in words and "dashed line: its wait for the retry" in words
    assert "2 failed attempts" in words


def test_a_hang_warning_is_a_triangle_with_an_exclamation_mark_and_its_title() -> None:
    warned = ev.TaskHangWarned(step_id="agent", command_id="cmd-1", silent_s=60.0)
    figure = chart(records(stage(1, "running"), (70.0, warned)), now=T0 + 90)
    (hang,) = groups(figure, "hang")
    assert title(hang) == "hang warning: step agent silent for 60 s (at +70 s)"
    assert hang.find("path") is not None and hang.findtext("text") == "!"
    assert "triangle with “!”: a hang warning" in caption(figure)
    assert "1 hang warning" in caption(figure)


def test_a_task_still_going_is_drawn_up_to_now_with_its_last_stage_open() -> None:
    recs = records(stage(1, "staging"), stage(3, "running"))
    figure = chart(recs, now=T0 + 20)
    *_, running = groups(figure, "stage")
    assert running.findtext("text") == "running 17 s so far"
    assert title(running).endswith("still going")
    assert running.find("circle") is not None  # the ring: not over
    assert not groups(figure, "end")
    (axis,) = groups(figure, "axis")
    assert [t.text for t in axis.iter("text")] == ["0 s", "20 s so far"]
    assert "still going after 20 s" in caption(figure)
    # As of a point in its history, "now" is that point: never before its last event.
    then = chart(recs, now=T0 + 2)
    (axis,) = groups(then, "axis")
    assert [t.text for t in axis.iter("text")] == ["0 s", "3.0 s so far"]


def test_timeouts_and_a_cancel_are_marks_of_their_own_and_end_the_task_as_such() -> None:
    step_out = ev.TaskStepFailed(step_id="agent", attempt=1, reason="timed_out", detail="limit")
    timed_out = chart(
        records(
            stage(1, "running"),
            (30.0, step_out),
            (30.0, ev.TaskTimedOut(stage="running", detail="the task's limit of 30s passed")),
        )
    )
    (step,) = groups(timed_out, "timeout")
    assert title(step) == "step agent attempt 1 timed out — limit (at +30 s)"
    (end,) = groups(timed_out, "end")
    assert title(end) == "timed out in running — the task's limit of 30s passed, after 30 s"
    assert "hourglass: a timeout" in caption(timed_out)

    cancelled = chart(
        records(
            stage(1, "running"),
            (10.0, ev.TaskCancelRequested(request_key="k", request_digest="d")),
            (11.0, ev.TaskCancelled(stage="running")),
            (12.0, ev.TaskCompleted()),  # after the end: history, as the fold has it
        )
    )
    (asked,) = groups(cancelled, "cancel")
    assert title(asked) == "cancel requested (at +10 s)"
    (end,) = groups(cancelled, "end")
    assert title(end) == "cancelled in running, after 11 s"
    assert "slashed ring: a cancel" in caption(cancelled)

    stage_limit = chart(
        records(
            stage(1, "provisioning"),
            (
                9.0,
                ev.TaskFailed(
                    reason="stage_timeout",
                    detail="the provisioning stage's limit passed",
                    stage="provisioning",
                ),
            ),
        )
    )
    (end,) = groups(stage_limit, "end")
    assert end.find("path") is not None  # an hourglass, not a failure's square
    assert "hourglass" in caption(stage_limit)


def test_every_word_in_the_chart_is_escaped() -> None:
    evil = "<script>alert(1)</script>"
    out = task_chart(
        records(
            stage(1, evil),
            (
                2.0,
                ev.TaskOperationFailed(
                    operation='<img src=x onerror="y">',
                    attempt=1,
                    error_class="network",
                    reason=evil,
                    detail=evil,
                    retry_at=T0 + 3,
                ),
            ),
            (4.0, ev.TaskHangWarned(step_id=evil, command_id="c", silent_s=1)),
            (5.0, ev.TaskFailed(reason=evil, detail=evil, stage=evil)),
        ),
        T0 + 10,
    )
    assert "<script" not in out and "<img" not in out
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in out
    assert "&lt;img src=x onerror=&quot;y&quot;&gt;" in out
    figure = ET.fromstring(out)
    texts = [g.findtext("text") for g in groups(figure, "stage")]
    assert texts[1] == f"{evil} 4.0 s"  # the words as they were, once unescaped
    assert title(groups(figure, "hang")[0]).startswith(f"hang warning: step {evil} silent")


def test_no_chart_before_the_task_was_submitted() -> None:
    assert task_chart([], T0) == ""
    only_later = records(stage(1, "staging"))[1:]  # no task.submitted: no task yet
    assert task_chart(only_later, T0) == ""
