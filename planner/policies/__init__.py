"""Every routing policy behind one protocol, `Policy.plan(request, cluster) -> Plan`.

`get_policy(name, config)` builds one by name (names in `POLICY_NAMES`, and the peer routers'
models in `PEER_POLICY_NAMES`); `Planner` holds a deployment's policies around one shared cost
model and resolves a request's policy by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from ownerserve.errors import ConfigError, InvalidRequestError
from ownerserve.kvprobe import load_measurements
from planner.candidates import ExactSubsetPolicy
from planner.cost import CostConfig, CostModel
from planner.policies.colocated import ColocatedPolicy
from planner.policies.least_loaded import LeastLoadedPolicy
from planner.policies.ownerserve import OwnerServePolicy
from planner.policies.peers import PEERS
from planner.policies.prefix_multi_owner import PrefixMultiOwnerPolicy
from planner.policies.round_robin import RoundRobinPolicy
from planner.policies.static_pd import StaticPDPolicy
from planner.types import Policy

if TYPE_CHECKING:  # pydantic stays out of the planner's import path
    from ownerserve.config import Settings

PolicyFactory = Callable[[CostConfig | None, CostModel | None], Policy]

_FACTORIES: Mapping[str, PolicyFactory] = MappingProxyType(
    {
        OwnerServePolicy.name: OwnerServePolicy,
        StaticPDPolicy.name: StaticPDPolicy,
        ColocatedPolicy.name: ColocatedPolicy,
        RoundRobinPolicy.name: RoundRobinPolicy,
        PrefixMultiOwnerPolicy.name: PrefixMultiOwnerPolicy,
        LeastLoadedPolicy.name: LeastLoadedPolicy,
    }
)

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)
"""ownerserve, static-pd, colocated, round-robin, prefix-multi-owner, least-loaded."""

PEER_POLICY_NAMES: tuple[str, ...] = tuple(PEERS)
"""The peer routers' models (planner.policies.peers), by the names `get_policy` also takes."""


def get_policy(
    name: str, config: CostConfig | None = None, model: CostModel | None = None
) -> Policy:
    """A new policy by name; `model` shares one loaded `CostModel` between policies.
    Unknown names raise `ConfigError`."""
    factory = _FACTORIES.get(name) or PEERS.get(name)
    if factory is None:
        names = ", ".join((*POLICY_NAMES, *PEER_POLICY_NAMES))
        raise ConfigError(f"planner: unknown policy {name!r} (one of {names})")
    return factory(config, model)


class Planner:
    """A deployment's policies by name, sharing one `CostModel` (profiles and KV spec loaded
    once): `default` plans every request unless the request names another. Each policy is built
    on first use and kept, so stateful baselines (round-robin turns) keep their state across
    requests. `extra` adds policies built elsewhere (the simulator's `oracle`, a test's stub).
    The ownerserve policy plans a pool of more than 64 workers over its exact candidate subset
    (`planner.candidates.ExactSubsetPolicy`: the same choice as over every worker)."""

    def __init__(
        self,
        config: CostConfig | None = None,
        *,
        model: CostModel | None = None,
        default: str = "ownerserve",
        extra: Mapping[str, Policy] | None = None,
    ) -> None:
        self.model = model or CostModel(config)
        self._policies: dict[str, Policy] = dict(extra or {})
        self.default = self.policy(default)

    @classmethod
    def from_settings(cls, settings: Settings, *, extra: Mapping[str, Policy] | None = None
                      ) -> Planner:  # fmt: skip
        """The planner of a deployment: the `planner:` section, the served model's KV spec
        (HeteroCache restore planning for cold CPU/SSD hits; one planner serves the deployment,
        so only a single-model deployment's spec is taken) and every profile its workers name."""
        kv_spec = settings.models[0].kv_spec if len(settings.models) == 1 else None
        config = CostConfig.from_settings(settings.planner, kv_spec=kv_spec)
        profiles = tuple(sorted({w.profile for w in settings.workers if w.profile}))
        if profiles:
            config = replace(config, profiles=profiles)
        path = settings.planner.kv_measurements
        model = CostModel(
            config, measurements=None if path is None else partial(load_measurements, Path(path))
        )
        return cls(model=model, default=settings.planner.policy, extra=extra)

    @property
    def names(self) -> tuple[str, ...]:
        """Every name `policy` accepts."""
        return tuple(dict.fromkeys((*POLICY_NAMES, *PEER_POLICY_NAMES, *self._policies)))

    def policy(self, name: str) -> Policy:
        """The policy named `name`, built once; an unknown name raises `ConfigError`."""
        p = self._policies.get(name)
        if p is None:
            p = get_policy(name, self.model.config, self.model)
            if isinstance(p, OwnerServePolicy):
                p = ExactSubsetPolicy(p)
            self._policies[name] = p
        return p

    def for_request(self, override: str | None) -> Policy:
        """The policy for one request: `override` (the router's `x-ownerserve-policy` header,
        when allowed) or the default. An unknown override is the client's mistake:
        `InvalidRequestError` (a 400)."""
        if not override:
            return self.default
        try:
            return self.policy(override)
        except ConfigError as exc:
            raise InvalidRequestError(
                f"unknown routing policy {override!r}; one of: {', '.join(self.names)}"
            ) from exc


__all__ = [
    "PEER_POLICY_NAMES",
    "POLICY_NAMES",
    "ColocatedPolicy",
    "LeastLoadedPolicy",
    "OwnerServePolicy",
    "Planner",
    "PrefixMultiOwnerPolicy",
    "RoundRobinPolicy",
    "StaticPDPolicy",
    "get_policy",
]
