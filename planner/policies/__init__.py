"""Every routing policy behind one protocol, `Policy.plan(request, cluster) -> Plan`.

`get_policy(name, config)` builds one by name (names in `POLICY_NAMES`); `Planner` holds one of
each for a deployment and honours a per-request override (`RequestView.policy_override`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from ownerserve.errors import ConfigError, InvalidRequestError
from planner.cost import CostConfig, CostModel
from planner.policies.colocated import ColocatedPolicy
from planner.policies.least_loaded import LeastLoadedPolicy
from planner.policies.ownerserve import OwnerServePolicy
from planner.policies.prefix_multi_owner import PrefixMultiOwnerPolicy
from planner.policies.round_robin import RoundRobinPolicy
from planner.policies.static_pd import StaticPDPolicy
from planner.types import ClusterView, Plan, Policy, RequestView

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


def get_policy(
    name: str, config: CostConfig | None = None, model: CostModel | None = None
) -> Policy:
    """A new policy by name; `model` shares one loaded `CostModel` between policies.
    Unknown names raise `ConfigError`."""
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"planner: unknown policy {name!r} (one of {', '.join(POLICY_NAMES)})")
    return factory(config, model)


class Planner:
    """A deployment's policies: `default` plans every request unless the request names another
    (`policy_override`, from the router's header when allowed). One instance of each policy, so
    stateful baselines (round-robin turns) keep their state across requests. `extra` adds policies
    built elsewhere (the simulator's `oracle`)."""

    def __init__(
        self,
        default: str = "ownerserve",
        config: CostConfig | None = None,
        *,
        model: CostModel | None = None,
        extra: Mapping[str, Policy] | None = None,
        allow_override: bool = True,
    ) -> None:
        self.model = model or CostModel(config)
        self.allow_override = allow_override
        self._policies: dict[str, Policy] = {
            n: f(self.model.config, self.model) for n, f in _FACTORIES.items()
        }
        self._policies.update(extra or {})
        if default not in self._policies:
            raise ConfigError(
                f"planner: unknown policy {default!r} (one of {', '.join(self._policies)})"
            )
        self.default = default

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._policies)

    def policy(self, name: str) -> Policy:
        """The policy named `name`; an unknown name is the client's mistake (400)."""
        p = self._policies.get(name)
        if p is None:
            raise InvalidRequestError(
                f"unknown routing policy {name!r}; one of: {', '.join(self._policies)}"
            )
        return p

    def plan(self, request: RequestView, cluster: ClusterView) -> Plan:
        name = request.policy_override if self.allow_override else None
        return self.policy(name or self.default).plan(request, cluster)


__all__ = [
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
