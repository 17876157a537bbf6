"""Agentic workloads as scripted chat sessions: coding agents, forked rollouts, long-document QA,
cold resume after idle, and mixes of them.

A `Workload` is plain data — sessions of steps, each step the messages it appends, its output
length and the idle gap before it — so the same seed gives the same bytes, every policy sees the
same traffic, and a workload can be exported as a Mooncake-format trace (`loadgen.trace`).
The assistant's reply is scripted (`Step.reply`, as many tokens as `max_tokens`), so the next turn's
prompt does not depend on what the server generated.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from loadgen.text import TextFactory


@dataclass(frozen=True, slots=True)
class Msg:
    """One chat message; a tool result names the assistant's tool call it answers."""

    role: str
    content: str
    tool_call_id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


TOOL_NAME = "run_tool"


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a session: wait `gap_s`, append `new_messages`, ask for `max_tokens`, then
    append the scripted `reply` as the assistant's message."""

    new_messages: tuple[Msg, ...]
    max_tokens: int
    gap_s: float = 0.0
    reply: str = ""
    label: str = "turn"
    reply_tool_call: str | None = None
    """The id of the tool call the scripted reply makes (the next step's tool result answers it)."""

    def reply_message(self) -> dict[str, Any] | None:
        """The assistant message appended after this step (None when there is none)."""
        if not self.reply and self.reply_tool_call is None:
            return None
        d: dict[str, Any] = {"role": "assistant", "content": self.reply}
        if self.reply_tool_call is not None:
            d["tool_calls"] = [
                {
                    "id": self.reply_tool_call,
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": "{}"},
                }
            ]
        return d


@dataclass(frozen=True, slots=True)
class Session:
    """An agent (or user) conversation; `group` names the shared context (repo, document, fork)."""

    session_id: str
    start_s: float
    steps: tuple[Step, ...]
    kind: str
    group: str = ""

    @property
    def idle_s(self) -> float:
        return sum(s.gap_s for s in self.steps)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    seed: int
    sessions: tuple[Session, ...]

    @property
    def n_requests(self) -> int:
        return sum(len(s.steps) for s in self.sessions)

    def scaled(self, time_scale: float) -> Workload:
        """The same traffic with every start time and gap multiplied by `time_scale`."""
        return replace(
            self,
            sessions=tuple(
                replace(
                    s,
                    start_s=s.start_s * time_scale,
                    steps=tuple(replace(st, gap_s=st.gap_s * time_scale) for st in s.steps),
                )
                for s in self.sessions
            ),
        )


IntRange = tuple[int, int]


@dataclass(frozen=True, slots=True)
class AgenticParams:
    """Coding-agent sessions: groups share a repository context; turns append tool outputs."""

    sessions: int = 24
    rate_per_s: float = 1.0
    repo_groups: int = 4
    system_tokens: int = 1_200
    repo_tokens: IntRange = (4_000, 12_000)
    task_tokens: IntRange = (40, 200)
    turns: IntRange = (3, 8)
    tool_tokens: IntRange = (80, 1_500)
    long_tool_prob: float = 0.15
    long_tool_tokens: IntRange = (3_000, 8_000)
    short_output: IntRange = (16, 64)
    long_output_prob: float = 0.25
    long_output: IntRange = (160, 400)
    tool_gap_median_s: float = 1.0
    tool_gap_sigma: float = 0.8
    tool_gap_max_s: float = 10.0
    resume_prob: float = 0.0
    resume_idle_s: float = 60.0


@dataclass(frozen=True, slots=True)
class ForkedParams:
    """Forked rollouts: `branches` sessions start together from one shared prefix."""

    groups: int = 6
    branches: int = 4
    rate_per_s: float = 0.5
    system_tokens: int = 1_200
    prefix_tokens: IntRange = (4_000, 10_000)
    branch_tokens: IntRange = (30, 120)
    turns: IntRange = (1, 3)
    tool_tokens: IntRange = (80, 800)
    output: IntRange = (32, 200)
    tool_gap_median_s: float = 0.8
    tool_gap_sigma: float = 0.6


@dataclass(frozen=True, slots=True)
class DocQAParams:
    """Long-document multi-turn QA: several users question the same long document."""

    sessions: int = 12
    rate_per_s: float = 0.5
    documents: int = 3
    doc_tokens: IntRange = (12_000, 24_000)
    turns: IntRange = (3, 6)
    question_tokens: IntRange = (20, 120)
    answer_tokens: IntRange = (48, 240)
    think_median_s: float = 3.0
    think_sigma: float = 0.5


@dataclass(frozen=True, slots=True)
class ResumeParams:
    """Cold resume: an agent works a few turns, idles long enough to go cold, then resumes."""

    sessions: int = 8
    agentic: AgenticParams = field(
        default_factory=lambda: AgenticParams(sessions=8, turns=(4, 8), resume_prob=1.0)
    )


SYSTEM_KEY = "system"


def _lognormal_gap(rng: random.Random, median_s: float, sigma: float, cap_s: float) -> float:
    return min(cap_s, median_s * math.exp(rng.gauss(0.0, sigma)))


def _arrivals(rng: random.Random, n: int, rate_per_s: float) -> list[float]:
    t = 0.0
    out = []
    for i in range(n):
        if i:
            t += rng.expovariate(rate_per_s) if rate_per_s > 0 else 0.0
        out.append(round(t, 6))
    return out


def agentic(
    params: AgenticParams | None = None, seed: int = 0, tf: TextFactory | None = None
) -> Workload:
    """Coding-agent sessions arriving as a Poisson process (first session at t=0)."""
    p = params or AgenticParams()
    tf = tf or TextFactory(seed=seed)
    rng = random.Random(f"agentic:{seed}")
    system = Msg("system", tf.make(SYSTEM_KEY, p.system_tokens))
    repo_sizes = [rng.randint(*p.repo_tokens) for _ in range(p.repo_groups)]
    repos = [
        Msg("user", "Repository context:\n" + tf.make(f"repo{g}", size))
        for g, size in enumerate(repo_sizes)
    ]
    sessions = []
    for i, start in enumerate(_arrivals(rng, p.sessions, p.rate_per_s)):
        sid = f"agentic-{seed}-{i}"
        g = rng.randrange(p.repo_groups)
        n_turns = rng.randint(*p.turns)
        resume_at = (
            rng.randint(1, n_turns - 1) if n_turns > 1 and rng.random() < p.resume_prob else 0
        )
        steps: list[Step] = []
        for k in range(n_turns):
            out = (
                rng.randint(*p.long_output)
                if rng.random() < p.long_output_prob
                else rng.randint(*p.short_output)
            )
            reply = tf.make(f"{sid}:reply{k}", out)
            call = f"call_{k + 1}" if k + 1 < n_turns else None
            if k == 0:
                task = Msg("user", "Task: " + tf.make(f"{sid}:task", rng.randint(*p.task_tokens)))
                steps.append(Step((system, repos[g], task), out, 0.0, reply, "first", call))
                continue
            long_tool = rng.random() < p.long_tool_prob
            n_tool = rng.randint(*(p.long_tool_tokens if long_tool else p.tool_tokens))
            tool = Msg("tool", tf.make(f"{sid}:tool{k}", n_tool), f"call_{k}")
            gap = _lognormal_gap(rng, p.tool_gap_median_s, p.tool_gap_sigma, p.tool_gap_max_s)
            label = "long-tool" if long_tool else "tool"
            if k == resume_at:
                gap, label = p.resume_idle_s, "resume"
            steps.append(Step((tool,), out, round(gap, 6), reply, label, call))
        sessions.append(
            Session(sid, start, tuple(steps), "resume" if resume_at else "agentic", f"repo{g}")
        )
    return Workload("agentic", seed, tuple(sessions))


def forked(
    params: ForkedParams | None = None, seed: int = 0, tf: TextFactory | None = None
) -> Workload:
    """Groups of `branches` rollouts that share one prefix and start at the same moment."""
    p = params or ForkedParams()
    tf = tf or TextFactory(seed=seed)
    rng = random.Random(f"forked:{seed}")
    system = Msg("system", tf.make(SYSTEM_KEY, p.system_tokens))
    sessions = []
    for g, start in enumerate(_arrivals(rng, p.groups, p.rate_per_s)):
        prefix = Msg("user", "Problem:\n" + tf.make(f"fork{g}", rng.randint(*p.prefix_tokens)))
        for b in range(p.branches):
            sid = f"forked-{seed}-{g}-{b}"
            steps = []
            n_turns = rng.randint(*p.turns)
            for k in range(n_turns):
                out = rng.randint(*p.output)
                reply = tf.make(f"{sid}:reply{k}", out)
                call = f"call_{k + 1}" if k + 1 < n_turns else None
                if k == 0:
                    hint = Msg(
                        "user",
                        f"Attempt {b}: " + tf.make(f"{sid}:hint", rng.randint(*p.branch_tokens)),
                    )
                    steps.append(Step((system, prefix, hint), out, 0.0, reply, "branch", call))
                else:
                    n_tool = rng.randint(*p.tool_tokens)
                    tool = Msg("tool", tf.make(f"{sid}:tool{k}", n_tool), f"call_{k}")
                    gap = _lognormal_gap(rng, p.tool_gap_median_s, p.tool_gap_sigma, 10.0)
                    steps.append(Step((tool,), out, round(gap, 6), reply, "tool", call))
            sessions.append(Session(sid, start, tuple(steps), "forked", f"fork{g}"))
    return Workload("forked", seed, tuple(sessions))


def docqa(
    params: DocQAParams | None = None, seed: int = 0, tf: TextFactory | None = None
) -> Workload:
    """Users asking several questions about one of a few long documents."""
    p = params or DocQAParams()
    tf = tf or TextFactory(seed=seed)
    rng = random.Random(f"docqa:{seed}")
    system = Msg("system", "Answer questions about the document. Quote the relevant lines.")
    docs = [
        Msg("user", "Document:\n" + tf.make(f"doc{d}", rng.randint(*p.doc_tokens)))
        for d in range(p.documents)
    ]
    sessions = []
    for i, start in enumerate(_arrivals(rng, p.sessions, p.rate_per_s)):
        sid = f"docqa-{seed}-{i}"
        d = rng.randrange(p.documents)
        steps = []
        for k in range(rng.randint(*p.turns)):
            out = rng.randint(*p.answer_tokens)
            question = Msg("user", "Q: " + tf.make(f"{sid}:q{k}", rng.randint(*p.question_tokens)))
            reply = tf.make(f"{sid}:a{k}", out)
            if k == 0:
                steps.append(Step((system, docs[d], question), out, 0.0, reply, "first"))
            else:
                gap = _lognormal_gap(rng, p.think_median_s, p.think_sigma, 30.0)
                steps.append(Step((question,), out, round(gap, 6), reply, "question"))
        sessions.append(Session(sid, start, tuple(steps), "docqa", f"doc{d}"))
    return Workload("docqa", seed, tuple(sessions))


def resume(
    params: ResumeParams | None = None, seed: int = 0, tf: TextFactory | None = None
) -> Workload:
    """Agent sessions that each go idle for `resume_idle_s` once, then continue."""
    p = params or ResumeParams()
    w = agentic(replace(p.agentic, sessions=p.sessions), seed, tf)
    return replace(w, name="resume")


def merge(name: str, *workloads: Workload) -> Workload:
    """One workload running several side by side (sessions sorted by start time)."""
    sessions = sorted((s for w in workloads for s in w.sessions), key=lambda s: s.start_s)
    seed = workloads[0].seed if workloads else 0
    return Workload(name, seed, tuple(sessions))


def mixed(seed: int = 0, scale: float = 1.0, tf: TextFactory | None = None) -> Workload:
    """The benchmark's agentic mix: coding agents (some resuming cold), forked rollouts, doc QA.

    `scale` multiplies the number of sessions (at least one of each kind)."""
    tf = tf or TextFactory(seed=seed)

    def n(x: int) -> int:
        return max(1, round(x * scale))

    return merge(
        "mixed",
        agentic(AgenticParams(sessions=n(16), resume_prob=0.25, resume_idle_s=20.0), seed, tf),
        forked(ForkedParams(groups=n(3)), seed, tf),
        docqa(DocQAParams(sessions=n(6), documents=2), seed, tf),
    )


GENERATORS: dict[str, Callable[[int, float], Workload]] = {
    "agentic": lambda seed, scale: agentic(AgenticParams(sessions=max(1, round(24 * scale))), seed),
    "forked": lambda seed, scale: forked(ForkedParams(groups=max(1, round(6 * scale))), seed),
    "docqa": lambda seed, scale: docqa(DocQAParams(sessions=max(1, round(12 * scale))), seed),
    "resume": lambda seed, scale: resume(ResumeParams(sessions=max(1, round(8 * scale))), seed),
    "mixed": lambda seed, scale: mixed(seed, scale),
}
"""Named generators: `(seed, scale) -> Workload`; `scale` multiplies the session count."""


def generate(name: str, seed: int = 0, scale: float = 1.0) -> Workload:
    """A named workload (see `GENERATORS`)."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(GENERATORS)}") from None
    return gen(seed, scale)
