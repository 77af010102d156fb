"""A sandbox's saves as a timeline: a chart on a time axis and the same as a
list, each save's kind (scheduled, snapshot, final) and outcome in words as
well as in shape, the recovery point marked."""

from __future__ import annotations

from typing import Any

from sandhold.domain.views import SaveView
from sandhold.gateway.console.html import esc, state_and_reason, when

WIDTH, HEIGHT, PAD = 720, 56, 12
# Shapes tell the outcome without colour: a filled dot completed, a cross
# failed, a ring under way.
_DONE, _FAILED = "completed", frozenset({"failed", "expired"})
_UNCHANGED = "unchanged"  # found nothing changed: stored nothing (decision 067)


def saves_timeline(view: Any, saves: list[SaveView], now: float) -> str:
    if not saves:
        return '<p class="muted">No saves yet.</p>'
    point = view.last_completed_save.id if view.last_completed_save else None
    recovered = view.recovered_from.save_id if view.recovered_from else None
    items = []
    for save in reversed(saves):  # the newest first
        notes = []
        if save.id == point:
            notes.append("<strong>recovery point</strong>: what a host failure now brings back")
        if save.id == recovered:
            notes.append(
                f"<strong>recovered from</strong> after {esc(view.recovered_from.lost_host)} failed"
            )
        outcome = state_and_reason(save.state, save.reason)
        if save.state in _FAILED:
            outcome = f"<strong>✕ {outcome}</strong>"
        size = f", {save.bytes:,} bytes" if save.bytes else ""
        items.append(
            f'<li class="save-{esc(save.state)}">{when(save.requested_at)} '
            f"{esc(save.kind)}{f' “{esc(save.name)}”' if save.name else ''}: {outcome}{size}"
            f"{' — ' + '; '.join(notes) if notes else ''}"
            f' <span class="muted">{esc(save.id)}</span></li>'
        )
    return _chart(saves, point, now) + f'<ol class="saves" reversed>{"".join(items)}</ol>'


def _chart(saves: list[SaveView], point: str | None, now: float) -> str:
    """An SVG time axis from the first save to now (drawn with attributes only:
    the page's CSP allows no inline style)."""
    start = saves[0].requested_at
    span = max(now - start, 1.0)

    def x(t: float) -> float:
        return PAD + (WIDTH - 2 * PAD) * (min(t, now) - start) / span

    marks = []
    for save in saves:
        cx, cy = x(save.requested_at), HEIGHT / 2
        label = f"{save.kind} {save.state} {save.id}"
        if save.state in _FAILED:
            shape = (
                f'<path d="M{cx - 5:.1f},{cy - 5:.1f}L{cx + 5:.1f},{cy + 5:.1f}'
                f'M{cx - 5:.1f},{cy + 5:.1f}L{cx + 5:.1f},{cy - 5:.1f}" stroke="#c33" '
                'stroke-width="2.5"/>'
            )
        elif save.state == _DONE:
            radius = 7 if save.kind == "snapshot" else 5
            shape = f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{radius}" fill="#2a7"/>'
        elif save.state == _UNCHANGED:  # nothing stored: the save before holds the files
            shape = f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="2.5" fill="#2a7"/>'
        else:
            shape = (
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="5" fill="none" stroke="#888" '
                'stroke-width="2"/>'
            )
        if save.id == point:
            shape += (
                f'<path d="M{cx:.1f},{cy + 9:.1f}l-5,9h10z" fill="#48f"/>'  # a pointer under it
            )
        marks.append(f"<g><title>{esc(label)}</title>{shape}</g>")
    axis = (
        f'<line x1="{PAD}" y1="{HEIGHT / 2}" x2="{WIDTH - PAD}" y2="{HEIGHT / 2}" '
        'stroke="currentColor" stroke-opacity=".35"/>'
    )
    summary = (
        f"{len(saves)} save{'' if len(saves) == 1 else 's'} since {when(start)}: "
        f"{sum(s.state == _DONE for s in saves)} completed, "
        f"{sum(s.state == _UNCHANGED for s in saves)} unchanged, "
        f"{sum(s.state in _FAILED for s in saves)} failed"
    )
    return (
        f'<figure class="chart"><svg viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="saves on a time axis up to now" width="{WIDTH}">{axis}{"".join(marks)}</svg>'
        f"<figcaption>{summary}. Dot: completed (bigger: a snapshot; small: nothing changed, "
        "so nothing stored); cross: failed; ring: under"
        " way; pointer: the recovery point.</figcaption></figure>"
    )
