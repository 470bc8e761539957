"""Tenants: whose share of the pool a request draws on, with which weight and queued limit.

A request that presents an API key runs as the key's tenant (``ApiKey.tenant``: the name its spec
gives, else its key id). Without a key, ``settings.tenant_source`` says where the tenant comes from:
a header (``tenant_header``), the body's ``user`` field, or nowhere. The key store gives a tenant
its weight and queued limit; a tenant no key names gets weight 1 and ``settings.tenant_max_queued``.
The tenant and weight travel in the QueuedRequest; the queued limit goes to the enqueue script."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from producer_api import metrics
from producer_api.api_keys import ApiKey
from shared.errors import ValidationError
from shared.settings import Settings
from shared.tenant_labels import OTHER, TenantLabels

MAX_TENANT_LENGTH = 128  # QueuedRequest ids' bound: a tenant is no longer than a request id


@dataclass(frozen=True)
class TenantTerms:
    weight: float
    max_queued: int | None  # requests waiting per model; None = only the model's max_queue_depth


class Tenants:
    def __init__(self, settings: Settings, keys: list[ApiKey]) -> None:
        self.settings = settings
        self.labels = TenantLabels.from_settings(settings)
        self._terms: dict[str, TenantTerms] = {}
        for key in keys:
            terms = TenantTerms(key.weight, key.max_queued or settings.tenant_max_queued)
            known = self._terms.setdefault(key.tenant, terms)
            if known != terms:
                # The message names the tenant, never a key: its entry holds the secret.
                raise ValueError(f"the API keys of tenant {key.tenant!r} give it different weights or max_queued")
        self._default = TenantTerms(1.0, settings.tenant_max_queued)
        for tenant in [*settings.tenant_metrics, OTHER]:  # at 0 from the start: a rate needs a series before a 429
            for limit in metrics.REJECTION_LIMITS:
                metrics.TENANT_REJECTIONS.labels(tenant, limit)

    def terms(self, tenant: str | None) -> TenantTerms:
        return self._terms.get(tenant or "", self._default)

    def resolve(
        self, request: Request, key: ApiKey | None, named: str | None = None, field: str = "user"
    ) -> str | None:
        """The request's tenant. ``named``: what its body names (OpenAI's ``user``; ``tenant`` on
        /v1/jobs, which names one under tenant_source=key too), ``field`` its name in errors."""
        if key is not None:
            return key.tenant
        source = self.settings.tenant_source
        if source == "header":
            named, field = request.headers.get(self.settings.tenant_header), self.settings.tenant_header
        elif source == "key" and field == "user":
            return None
        if not named:
            return None
        if len(named) > MAX_TENANT_LENGTH or not named.isprintable():
            raise ValidationError(f"{field}: a tenant is 1 to {MAX_TENANT_LENGTH} printable characters", field=field)
        return named
