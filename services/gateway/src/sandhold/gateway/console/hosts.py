"""The hosts page: leases, renewal age, fenced times, this tenant's sandboxes on each."""

from __future__ import annotations

from litestar import Request, Response, get
from sandhold.gateway.console.html import esc, fragment, page, table, when
from sandhold.gateway.console.kit import Console
from sandhold.gateway.routes_sandboxes import host_views

REFRESH_S = 5


def handlers(console: Console) -> list:
    ctx = console.ctx

    @get("/hosts", include_in_schema=False)
    async def hosts_page(request: Request) -> Response:
        session = console.signed_in(request)
        if isinstance(session, Response):
            return session
        hosts = await host_views(ctx)
        # This tenant's sandboxes on each host (other tenants' are not its business).
        counts = dict(
            await ctx.read_model.query(
                "SELECT host, count(*) FROM sandboxes WHERE tenant = ? AND host IS NOT NULL "
                "AND phase NOT IN ('stopped', 'deleted', 'failed') GROUP BY host",
                (session.tenant,),
            )
        )
        table_ = _host_table(hosts, counts)
        if request.query_params.get("part") == "table":
            return fragment(table_)
        # Leases are renewed, not logged: the table is fetched again every few seconds.
        body = (
            f'<div id="hosts" data-refresh="/hosts?part=table" data-every="{REFRESH_S}">'
            f"{table_}</div>"
            '<p class="muted">Status: live, suspect or down from the lease\'s age; lost or '
            "fenced as recovery declared it. Refreshed every few seconds.</p>"
        )
        return page("Hosts", body, session)

    return [hosts_page]


def _cache(c) -> str:
    if c is None:
        return "none"
    ratio = "—" if c.hit_ratio is None else f"{c.hit_ratio:.0%} hits"
    return esc(f"{c.bytes / 2**20:.0f} of {c.limit_bytes / 2**20:.0f} MiB, {ratio}")


def _host_table(hosts: list, counts: dict[str, int]) -> str:
    rows = [
        [
            esc(h.host),
            esc(h.status),
            esc(h.epoch),
            f"{h.last_renewal_age_s:.1f} s ago" if h.last_renewal_age_s is not None else "—",
            when(h.registered_at),
            when(h.fence_at),
            f"{counts.get(h.host, 0)} of {h.capacity_sandboxes}",
            _cache(h.chunk_cache),
        ]
        for h in hosts
    ]
    head = [
        "Host", "Status", "Epoch", "Lease renewed", "Registered", "Fenced at",
        "Your sandboxes", "Chunk cache",
    ]  # fmt: skip
    return table(head, rows, "No hosts.", wide=frozenset({2, 4, 5, 7}))
