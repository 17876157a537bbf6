"""Fixtures of the e2e tests.

`router_accounting` (autouse): after every test, each router that `router_cluster.proxy`
built in it (and whose block the test left cleanly) gave back everything its requests held:
no open request lease, no worker with requests in flight or queued prefill or KV tokens, no
admission charge or queued request, no session counted in flight (`router_cluster.outstanding`).
`proxy` waits for the router's last requests to finish before it stops (`settled`: on the
leases closing, within a bound), so what lands after a response was read is counted too.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.router_cluster import checked_routers, outstanding


@pytest.fixture(autouse=True)
def router_accounting() -> Iterator[None]:
    with checked_routers() as routers:
        yield
    left = [f"router {i}: {what}" for i, r in enumerate(routers) for what in outstanding(r)]
    assert not left, "requests left something held:\n" + "\n".join(left)
