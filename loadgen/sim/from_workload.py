"""Load-generator workloads as simulator sessions, block for block as the router and the emulator
see them.

The replay client (`loadgen.client`) sends each step's whole conversation so far: the messages
of every earlier step, each followed by its scripted assistant reply, then the step's new
messages. The emulated engine renders that with its chat template, tokenizes it and hashes the
token ids into chained block hashes (`ownerserve.hashing`) rooted at the model's chain root; the
router computes the same chain. `workload_sessions` does exactly that per step, so a simulated
turn's `chain` is the list of block hashes the emulator's prefix cache and the router's directory
hold for that request, its `input_tokens` the prompt length the engine reports, and its
`output_tokens` the step's `max_tokens` (the client sets `ignore_eos`, so the emulator writes
exactly that many tokens). Arrival times and tool gaps are the workload's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from loadgen.sim.workload import SimSession, SimTurn
from loadgen.workloads import Workload
from ownerserve.hashing import ChainHasher, chain_root
from ownerserve.tokenizer import ChatTemplate, Tokenizer, load_chat_template, load_tokenizer


@dataclass(frozen=True, slots=True)
class Rendering:
    """How prompts become blocks. The defaults are the emulated engine's (`workers.emulator.
    config.EmulatorConfig`; loadgen may not import `workers`, a test pins them equal)."""

    model: str = "ownerserve-tiny"
    block_size: int = 16
    tokenizer: str = "byte"
    chat_template: str | None = None
    salt: str = ""


def step_prompts(workload: Workload) -> list[list[list[dict[str, Any]]]]:
    """Per session, per step: the message list the replay client sends for that step."""
    out: list[list[list[dict[str, Any]]]] = []
    for session in workload.sessions:
        messages: list[dict[str, Any]] = []
        per_step: list[list[dict[str, Any]]] = []
        for step in session.steps:
            messages.extend(m.as_dict() for m in step.new_messages)
            per_step.append(list(messages))
            reply = step.reply_message()
            if reply is not None:
                messages.append(reply)
        out.append(per_step)
    return out


def workload_sessions(
    workload: Workload,
    rendering: Rendering | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    template: ChatTemplate | None = None,
) -> list[SimSession]:
    """`workload` as simulator sessions (in the workload's session order, ids 0..n-1).

    Each session's steps become turns: the chain of full-block hashes of the rendered prompt
    (a trailing partial block has no hash, as in the engine), the prompt's token count, the
    step's `max_tokens` and its gap. Sessions are independent (`fork_of` is None): the router
    keys sessions by the client's `x-session-id`, one per workload session; a subagent
    arrives when its parent's spawning turn does (`spawned_at`), as the replay client sends it.
    """
    r = rendering or Rendering()
    tok = tokenizer or load_tokenizer(r.tokenizer)
    tpl = template or load_chat_template(r.chat_template)
    root = chain_root(r.model, r.salt)
    sessions: list[SimSession] = []
    for si, (session, prompts) in enumerate(
        zip(workload.sessions, step_prompts(workload), strict=True)
    ):
        hasher = ChainHasher(r.block_size, root)
        turns: list[SimTurn] = []
        for k, (step, messages) in enumerate(zip(session.steps, prompts, strict=True)):
            ids = tok.encode(tpl.render(messages))
            chain = tuple(hasher.update(ids))
            gap = step.gap_s if k else 0.0
            turns.append(SimTurn(chain, len(ids), step.max_tokens, gap))
        sessions.append(SimSession(si, session.start_s, tuple(turns)))
    index = {s.session_id: i for i, s in enumerate(workload.sessions)}
    for si, session in enumerate(workload.sessions):
        if session.spawned_at is not None:  # a subagent arrives when its parent's step does
            parent, at = session.spawned_at
            sessions[si] = replace(sessions[si], spawned_at=(index[parent], at))
    return sessions
