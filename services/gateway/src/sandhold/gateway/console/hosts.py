"""The hosts page: leases, renewal age, fenced times, this tenant's sandboxes on each."""

from __future__ import annotations

from litestar import Request, Response, get
from sandhold.gateway.console.html import esc, page, table, when
from sandhold.gateway.console.kit import Console
from sandhold.gateway.routes_sandboxes import host_views


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
        return page("Hosts", _host_table(hosts, counts), session)

    return [hosts_page]


def _host_table(hosts: list, counts: dict[str, int]) -> str:
    rows = [
        [
            esc(h.host),
            esc(h.status),
            esc(h.epoch),
            f"{h.last_renewal_age_s:.1f} s ago" if h.last_renewal_age_s is not None else "—",
            when(h.fence_at),
            f"{counts.get(h.host, 0)} of {h.capacity_sandboxes}",
        ]
        for h in hosts
    ]
    head = ["Host", "Status", "Epoch", "Lease renewed", "Fenced at", "Your sandboxes"]
    return table(head, rows, "No hosts.", wide=frozenset({2, 4}))
