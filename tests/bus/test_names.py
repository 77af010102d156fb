"""Subjects: a request's subject names its type and its tenant, one token each."""

from __future__ import annotations

import pytest
from sandhold.bus.names import Names, tenant_of_token, tenant_token

NAMES = Names("sh")


@pytest.mark.parametrize("tenant", ["default", "acme", "acme.corp", "a-b_c.d.e", "Z9"])
def test_a_request_subject_names_its_tenant_in_one_token(tenant: str):
    subject = NAMES.request("sandbox.create", tenant)
    assert subject.split(".")[:4] == ["sh", "req", "sandbox", "create"]
    assert len(subject.split(".")) == 5
    assert NAMES.tenant_of_request(subject, "sandbox.create") == tenant
    assert tenant_of_token(tenant_token(tenant)) == tenant


@pytest.mark.parametrize(
    "subject",
    [
        "sh.req.sandbox.create",  # no tenant (the layout before tenants)
        "sh.req.sandbox.create.",
        "sh.req.sandbox.start.acme",  # another type's
        "sh.req.sandbox.create.acme.more",
        "other.req.sandbox.create.acme",
    ],
)
def test_a_subject_of_another_shape_names_no_tenant(subject: str):
    assert NAMES.tenant_of_request(subject, "sandbox.create") is None
