"""A task's lifecycle on a time axis: a band per stage it went through, its
failed attempts with their retry waits, hang warnings, timeouts, a cancel
request, and its end. Drawn as the saves chart is (saves.py): SVG with
presentation attributes only (the page's CSP allows no inline style), each
mark a shape as well as a colour, with a `<title>` in words, and a legend."""

from __future__ import annotations

from dataclasses import dataclass, field

from sandhold.domain import events as ev
from sandhold.domain.envelope import Recorded
from sandhold.gateway.console.html import esc, when

# A narrow viewBox, drawn at most SHOWN px wide (the stylesheet narrows it to
# the screen's): its words stay readable on a phone and not too big on a desk.
WIDTH, SHOWN, PAD, TOP, ROW, AXIS = 440, 560, 12, 4, 30, 34
BAND_H = 10
LABEL_FONT, AXIS_FONT = 13, 12
RED, AMBER, BLUE, GREEN = "#c33", "#e90", "#48f", "#2a7"

# The legend, in the order it reads: every shape the chart may draw.
_LEGEND = {
    "band": "band: a stage, its name and time above it",
    "ongoing": "ring at a band's end: still going",
    "failed_attempt": "cross: a failed attempt",
    "retry_wait": "dashed line: its wait for the retry, up to a tick when due",
    "hang": "triangle with “!”: a hang warning",
    "timeout": "hourglass: a timeout",
    "cancel": "slashed ring: a cancel (asked for, or the end)",
    "end": "vertical line: the end (a disc: completed; a square: failed)",
}


@dataclass
class _Stage:
    name: str
    start: float
    end: float | None = None  # None: not over (yet)


@dataclass
class _Mark:
    kind: str  # a key of _LEGEND
    at: float
    row: int
    title: str
    until: float | None = None  # a retry wait: when the retry was due


@dataclass
class _Lifecycle:
    start: float
    stages: list[_Stage] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)
    end: float | None = None
    end_kind: str = ""  # completed | failed | cancelled | timed_out
    end_title: str = ""


def task_chart(records: list[Recorded], now: float) -> str:
    """The chart of a task's events (in log order, as the timeline lists them),
    up to its end, or to `now` while it has not ended; "" before it was submitted."""
    life = _lifecycle(records)
    if life is None:
        return ""
    last = max(r.envelope.time for r in records)
    finish = life.end if life.end is not None else max(now, last)
    return _draw(life, finish)


def _lifecycle(records: list[Recorded]) -> _Lifecycle | None:
    """The stages and marks, as the task's fold reads the events: from its
    submission; nothing after its first end (a later append is history)."""
    life: _Lifecycle | None = None
    for record in records:
        e, at = record.envelope.event, record.envelope.time
        if life is None:
            if isinstance(e, ev.TaskSubmitted):
                # Until a stage is entered, the task waits for an orchestrator to take it.
                life = _Lifecycle(start=at, stages=[_Stage("pending", at)])
            continue
        match e:
            case ev.TaskStageEntered(stage=stage):
                if stage != life.stages[-1].name:  # the same stage again: it goes on
                    life.stages[-1].end = at
                    life.stages.append(_Stage(stage, at))
            case ev.TaskCompleted():
                _end(life, at, "completed", "completed")
            case ev.TaskFailed(reason=reason, detail=detail, stage=stage):
                kind = "timed_out" if reason == "stage_timeout" else "failed"
                _end(life, at, kind, f"failed in {stage or '—'}: {reason}" + _more(detail))
            case ev.TaskCancelled(stage=stage):
                _end(life, at, "cancelled", f"cancelled in {stage or '—'}")
            case ev.TaskTimedOut(stage=stage, detail=detail):
                _end(life, at, "timed_out", f"timed out in {stage or '—'}" + _more(detail))
            case _:
                found = _mark(e)
                if found is not None:
                    # On the band of the stage it came in.
                    kind, title, until = found
                    title += f" (at +{_span(at - life.start)})"
                    life.marks.append(_Mark(kind, at, len(life.stages) - 1, title, until))
        if life.end is not None:
            break
    return life


def _mark(e: ev.AnyEvent) -> tuple[str, str, float | None] | None:
    """An event drawn as a mark: (its kind, what it is in words, a retry's due time)."""
    match e:
        case ev.TaskOperationFailed() as failed:
            said = f"{failed.operation} attempt {failed.attempt} failed: {failed.reason}"
            said += f" ({failed.error_class}){_more(failed.detail)}"
            if failed.retry_at is None:
                return "failed_attempt", said + "; not retried", None
            return "failed_attempt", said + "; retried", failed.retry_at
        case ev.TaskHangWarned(step_id=step_id, silent_s=silent_s):
            return "hang", f"hang warning: step {step_id} silent for {_span(silent_s)}", None
        case ev.TaskStepFailed(reason="timed_out") as step:
            said = f"step {step.step_id} attempt {step.attempt} timed out"
            return "timeout", said + _more(step.detail), None
        case ev.TaskCancelRequested():
            return "cancel", "cancel requested", None
        case _:
            return None


def _more(detail: str) -> str:
    return f" — {detail[:200]}" if detail else ""


def _end(life: _Lifecycle, at: float, kind: str, title: str) -> None:
    life.end, life.end_kind = at, kind
    life.end_title = f"{title}, after {_span(at - life.start)}"
    life.stages[-1].end = at


def _draw(life: _Lifecycle, finish: float) -> str:
    start = life.start
    span = max(finish - start, 1e-9)
    rows = len(life.stages)
    axis_y = TOP + rows * ROW + 6
    height = axis_y + AXIS

    def x(t: float) -> float:
        return PAD + (WIDTH - 2 * PAD) * (min(max(t, start), finish) - start) / span

    def cy(row: int) -> float:
        return TOP + row * ROW + 16 + BAND_H / 2

    shapes: list[str] = []
    used: list[str] = ["band"]

    for row, stage in enumerate(life.stages):
        x1, x2 = x(stage.start), x(stage.end if stage.end is not None else finish)
        top = TOP + row * ROW
        took = _span((stage.end if stage.end is not None else finish) - stage.start)
        ongoing = stage.end is None
        label = f"{stage.name} {took}" + (" so far" if ongoing else "")
        if x1 <= WIDTH * 0.55:
            text = f'<text x="{x1:.1f}" y="{top + 12}"'
        else:  # late in the axis: the words end where the band does
            text = f'<text x="{max(x2 - 10, x1):.1f}" y="{top + 12}" text-anchor="end"'
        title = f"{stage.name}: entered at +{_span(stage.start - start)}, {took}"
        title += " so far, still going" if ongoing else ""
        band = (
            f'<rect x="{x1:.1f}" y="{top + 16}" width="{max(x2 - x1, 2):.1f}" '
            f'height="{BAND_H}" fill="{BLUE}" fill-opacity=".35" stroke="{BLUE}"/>'
            f'{text} font-size="{LABEL_FONT}" fill="currentColor">{esc(label)}</text>'
        )
        if ongoing:
            used.append("ongoing")
            band += (
                f'<circle cx="{x2:.1f}" cy="{cy(row):.1f}" r="4.5" fill="none" '
                'stroke="currentColor" stroke-width="2"/>'
            )
        shapes.append(f'<g class="stage"><title>{esc(title)}</title>{band}</g>')

    for m in life.marks:
        mx, my = x(m.at), cy(m.row)
        used.append(m.kind)
        shape = _SHAPES[m.kind](mx, my)
        if m.until is not None:
            used.append("retry_wait")
            ux = x(m.until)
            wait = (
                f'<line x1="{mx:.1f}" y1="{my:.1f}" x2="{ux:.1f}" y2="{my:.1f}" stroke="{RED}" '
                'stroke-width="2" stroke-dasharray="4 3"/>'
            )
            if m.until <= finish:  # the retry came due within the axis: a tick there
                wait += (
                    f'<line x1="{ux:.1f}" y1="{my - 6:.1f}" x2="{ux:.1f}" y2="{my + 6:.1f}" '
                    f'stroke="{RED}" stroke-width="2"/>'
                )
            due = f"retry wait: {_span(max(m.until - m.at, 0.0))}, due at +{_span(m.until - start)}"
            shape = f'<g class="retry-wait"><title>{esc(due)}</title>{wait}</g>' + shape
        shapes.append(
            f'<g class="{m.kind.replace("_", "-")}"><title>{esc(m.title)}</title>{shape}</g>'
        )

    if life.end is not None:
        used.append("end")
        ex, ey = x(life.end), cy(rows - 1)
        end = (
            f'<line x1="{ex:.1f}" y1="{TOP}" x2="{ex:.1f}" y2="{axis_y}" '
            'stroke="currentColor" stroke-width="2"/>'
        )
        if life.end_kind in ("timed_out", "cancelled"):
            used.append("timeout" if life.end_kind == "timed_out" else "cancel")
            end += _SHAPES["timeout" if life.end_kind == "timed_out" else "cancel"](ex, ey)
        elif life.end_kind == "completed":
            end += f'<circle cx="{ex:.1f}" cy="{ey:.1f}" r="6" fill="{GREEN}"/>'
        else:
            end += f'<rect x="{ex - 6:.1f}" y="{ey - 6:.1f}" width="12" height="12" fill="{RED}"/>'
        shapes.append(f'<g class="end"><title>{esc(life.end_title)}</title>{end}</g>')

    total = _span(finish - start)
    so_far = " so far" if life.end is None else ""
    axis = (
        f'<g class="axis"><line x1="{PAD}" y1="{axis_y}" x2="{WIDTH - PAD}" y2="{axis_y}" '
        'stroke="currentColor" stroke-opacity=".5"/>'
        f'<line x1="{PAD}" y1="{axis_y - 4}" x2="{PAD}" y2="{axis_y + 4}" stroke="currentColor"/>'
        f'<line x1="{WIDTH - PAD}" y1="{axis_y - 4}" x2="{WIDTH - PAD}" y2="{axis_y + 4}" '
        'stroke="currentColor"/>'
        f'<text x="{PAD}" y="{axis_y + 18}" font-size="{AXIS_FONT}" fill="currentColor">0 s'
        "</text>"
        f'<text x="{WIDTH - PAD}" y="{axis_y + 18}" font-size="{AXIS_FONT}" '
        f'text-anchor="end" fill="currentColor">{esc(total)}{so_far}</text></g>'
    )
    stages = ", ".join(
        f"{s.name} {_span((s.end if s.end is not None else finish) - s.start)}" for s in life.stages
    )
    counts = [
        _count(sum(m.kind == "failed_attempt" for m in life.marks), "failed attempt"),
        _count(sum(m.kind == "hang" for m in life.marks), "hang warning"),
    ]
    ending = life.end_title if life.end is not None else f"still going after {total}"
    summary = f"{', '.join(counts)}; {ending}"
    legend = "; ".join(_LEGEND[k] for k in _LEGEND if k in used)
    return (
        f'<figure class="chart task-chart"><svg viewBox="0 0 {WIDTH} {height}" role="img" '
        f'aria-label="{esc(f"the task on a time axis: {stages}; {summary}")}" width="{SHOWN}">'
        f"{axis}{''.join(shapes)}</svg>"
        f"<figcaption>Submitted {when(start)}; {esc(summary)}. {esc(legend)}.</figcaption>"
        "</figure>"
    )


def _cross(cx: float, cy: float) -> str:
    return (
        f'<path d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}'
        f'M{cx - 5:.1f},{cy + 5:.1f}L{cx + 5:.1f},{cy - 5:.1f}" stroke="{RED}" '
        'stroke-width="2.5"/>'
    )


def _warning(cx: float, cy: float) -> str:
    return (
        f'<path d="M{cx:.1f},{cy - 8:.1f}L{cx + 7:.1f},{cy + 5:.1f}H{cx - 7:.1f}Z" '
        f'fill="{AMBER}" stroke="#000" stroke-width="1"/>'
        f'<text x="{cx:.1f}" y="{cy + 4:.1f}" font-size="10" font-weight="bold" '
        'text-anchor="middle" fill="#000">!</text>'
    )


def _hourglass(cx: float, cy: float) -> str:
    return (
        f'<path d="M{cx - 5:.1f},{cy - 7:.1f}H{cx + 5:.1f}L{cx - 5:.1f},{cy + 7:.1f}'
        f'H{cx + 5:.1f}Z" fill="{AMBER}" stroke="currentColor" stroke-width="1.5"/>'
    )


def _slashed_ring(cx: float, cy: float) -> str:
    return (
        f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="6" fill="none" stroke="currentColor" '
        'stroke-width="2"/>'
        f'<path d="M{cx - 4.2:.1f},{cy + 4.2:.1f}L{cx + 4.2:.1f},{cy - 4.2:.1f}" '
        'stroke="currentColor" stroke-width="2"/>'
    )


_SHAPES = {
    "failed_attempt": _cross,
    "hang": _warning,
    "timeout": _hourglass,
    "cancel": _slashed_ring,
}


def _count(n: int, what: str) -> str:
    return f"{'no' if n == 0 else n} {what}{'' if n == 1 else 's'}"


def _span(seconds: float) -> str:
    """A duration in words as short as will do: 3.2 s, 42 s, 3 min 5 s, 2 h 5 min."""
    if seconds < 10:
        return f"{seconds:.1f} s" if seconds >= 0.05 else "0 s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        minutes, secs = divmod(round(seconds), 60)
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(round(seconds) // 60, 60)
    return f"{hours} h {minutes} min"
