"""The names Prometheus metrics give tenants: bounded, however many tenants call.

The configured tenants (``settings.tenant_metrics``) keep their names; so do the first
``settings.tenant_metrics_max`` others a process meets; every later one counts as ``other``, and a
request without a tenant as ``none``. API and workers label with the same rule."""

from __future__ import annotations

from collections.abc import Iterable

from shared.settings import Settings

OTHER = "other"
NO_TENANT = "none"


class TenantLabels:
    def __init__(self, named: Iterable[str], more: int) -> None:
        self._named = frozenset(named)
        self._more = more
        self._met: set[str] = set()

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantLabels:
        return cls(settings.tenant_metrics, settings.tenant_metrics_max)

    def __call__(self, tenant: str | None) -> str:
        """The label of ``tenant``: its name while the bound allows, else ``other``."""
        if not tenant:
            return NO_TENANT
        if tenant in self._named or tenant in self._met:
            return tenant
        if len(self._met) < self._more:
            self._met.add(tenant)
            return tenant
        return OTHER

    def top(self, counts: dict[str, int], n: int) -> dict[str, int]:
        """``counts`` (tenant -> count) folded into at most the configured tenants plus the ``n``
        largest others plus ``other``: for values read whole at each scrape (queue depth). The
        configured tenants and ``other`` are always there, at 0 when nothing counts for them, so a
        series never vanishes while its tenant is idle."""
        folded: dict[str, int] = dict.fromkeys([*self._named, OTHER], 0)
        others = sorted(
            ((count, tenant) for tenant, count in counts.items() if tenant not in self._named and tenant),
            reverse=True,
        )
        for tenant, count in counts.items():
            if not tenant:
                folded[NO_TENANT] = folded.get(NO_TENANT, 0) + count
            elif tenant in self._named:
                folded[tenant] = folded.get(tenant, 0) + count
        for rank, (count, tenant) in enumerate(others):
            label = tenant if rank < n else OTHER
            folded[label] = folded.get(label, 0) + count
        return folded
