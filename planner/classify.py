"""The request classes (planner/README.md): what kind of agent step a request is, and each class's
default action (the cost model may override it when another action is cheaper)."""

from __future__ import annotations

from types import MappingProxyType

from planner.cost import CostConfig
from planner.types import Action, RequestClass, RequestView

DEFAULT_ACTION = MappingProxyType(
    {
        RequestClass.NEW_LONG_PREFIX: Action.REMOTE_PREFILL,
        RequestClass.SMALL_INCREMENTAL_TURN: Action.COLOCATED_PREFILL,
        RequestClass.LONG_TOOL_OUTPUT: Action.REMOTE_PREFILL,
        RequestClass.DECODE_CONTINUATION: Action.DECODE_CONTINUATION,
        RequestClass.FORKED_ROLLOUT: Action.ARTIFACT_FETCH,
        RequestClass.COLD_RESUME: Action.TAIL_RECOMPUTE,
    }
)
"""The default action per class: new long prefix → remote P; small incremental turn →
colocated on the D owner; long tool output → remote P (or hybrid, by cost); decode continuation →
stay on the D owner; forked rollout → shared prefix artifact read by many D workers (fetch);
cold resume → load the artifact from its tier and recompute the tail."""


# members bound once (a class-attribute lookup of an enum member costs ~0.1 µs)
_FORK, _COLD = RequestClass.FORKED_ROLLOUT, RequestClass.COLD_RESUME
_CONT, _SMALL = RequestClass.DECODE_CONTINUATION, RequestClass.SMALL_INCREMENTAL_TURN
_TOOL, _LONG = RequestClass.LONG_TOOL_OUTPUT, RequestClass.NEW_LONG_PREFIX


def new_tokens(request: RequestView) -> int:
    """Tokens of the prompt not known from before: N − min(N, max(previous_prompt_tokens,
    owner_blocks · block_size))."""
    known = max(request.previous_prompt_tokens, request.owner_blocks * request.block_size)
    return request.prompt_tokens - min(known, request.prompt_tokens)


def has_history(request: RequestView) -> bool:
    """The request continues a session the router has seen before."""
    return request.session_owner is not None or request.previous_prompt_tokens > 0


def classify(request: RequestView, config: CostConfig) -> RequestClass:
    """First rule that matches:
    1. `is_fork` or n > 1                                           → FORKED_ROLLOUT
    2. history, and idle_s ≥ cold_resume_idle_s or no session owner → COLD_RESUME
    3. history, new_tokens ≤ continuation_tokens                    → DECODE_CONTINUATION
    4. history, new_tokens ≤ small_turn_tokens                      → SMALL_INCREMENTAL_TURN
    5. history                                                       → LONG_TOOL_OUTPUT
    6. no history, new_tokens ≥ long_prefix_tokens                  → NEW_LONG_PREFIX
    7. otherwise                                                     → SMALL_INCREMENTAL_TURN
    """
    if request.is_fork or request.n > 1:
        return _FORK
    delta = new_tokens(request)
    if has_history(request):
        if request.session_owner is None or request.idle_s >= config.cold_resume_idle_s:
            return _COLD
        if delta <= config.continuation_tokens:
            return _CONT
        if delta <= config.small_turn_tokens:
            return _SMALL
        return _TOOL
    if delta >= config.long_prefix_tokens:
        return _LONG
    return _SMALL
