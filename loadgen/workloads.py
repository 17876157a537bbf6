"""Agentic workloads as scripted chat sessions: coding agents (short ones, and long ones that fork
subagents), forked rollouts, long-document QA, cold resume after idle, and mixes of them.

A `Workload` is plain data — sessions of steps, each step the messages it appends, its output
length and the idle gap before it — so the same seed gives the same bytes, every policy sees the
same traffic, and a workload can be exported as a Mooncake-format trace (`loadgen.trace`).
The assistant's reply is scripted (`Step.reply`, as many tokens as `max_tokens`), so the next turn's
prompt does not depend on what the server generated.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from loadgen.text import TextFactory
from ownerserve.tokenizer import ChatTemplate

TOOL_NAME = "run_tool"


@dataclass(frozen=True, slots=True)
class Msg:
    """One chat message; a tool result names the assistant's tool call it answers
    (`tool_call_id`), an assistant message the tool call it makes (`calls`)."""

    role: str
    content: str
    tool_call_id: str | None = None
    calls: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.calls is not None:
            d["tool_calls"] = [
                {
                    "id": self.calls,
                    "type": "function",
                    "function": {"name": TOOL_NAME, "arguments": "{}"},
                }
            ]
        return d


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

    def reply_msg(self) -> Msg | None:
        """The assistant message appended after this step (None when there is none)."""
        if not self.reply and self.reply_tool_call is None:
            return None
        return Msg("assistant", self.reply, calls=self.reply_tool_call)

    def reply_message(self) -> dict[str, Any] | None:
        """`reply_msg` as the OpenAI message dict the client sends back."""
        msg = self.reply_msg()
        return None if msg is None else msg.as_dict()


@dataclass(frozen=True, slots=True)
class Session:
    """An agent (or user) conversation; `group` names the shared context (repo, document, fork)."""

    session_id: str
    start_s: float
    steps: tuple[Step, ...]
    kind: str
    group: str = ""
    spawned_at: tuple[str, int] | None = None
    """A subagent's (parent session id, parent step): it starts when its parent sends that
    step, since its parent's tool call spawns it — not at `start_s`, the time that step was
    planned for, which a loaded cluster may not have reached (a replay by timestamps, such
    as `export_trace`, uses `start_s`)."""

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


@dataclass(frozen=True, slots=True)
class AgenticLongParams:
    """Long coding-agent sessions shaped by public Claude Code traces (main-agent prompts of
    ~195K tokens, outputs ~317, 96% of turns reusing >= 90% of their prefix, tool gaps p50 2 s /
    p99 11.4 min, subagents forking from the parent's prefix), with contexts scaled down to what
    an emulated cluster holds. Token counts are the `TextFactory` tokenizer's count of the
    built-in chat template's rendering (`ownerserve.tokenizer.ChatTemplate`)."""

    sessions: int = 32
    """Main-agent sessions; subagents come on top."""
    rate_per_s: float = 0.2
    """Poisson arrival rate of the main sessions."""
    repo_groups: int = 4
    """Repositories; the sessions of one share its system + repository prefix."""
    system_tokens: int = 3_000
    """System prompt and tool definitions, the same in every group."""
    prefix_tokens: IntRange = (8_000, 16_000)
    """A group's whole shared prefix: system prompt plus repository context."""
    task_tokens: IntRange = (50, 400)
    turns: IntRange = (20, 60)
    """Requests per main session."""
    context_tokens: IntRange = (60_000, 120_000)
    """Bounds of the prompt of a main session's last request (a subagent's: the upper one);
    a session whose tool outputs would end outside them has them all scaled to the bound."""
    tool_median_tokens: int = 800
    """Median tool output before a session's scaling into `context_tokens`. A turn's new tokens
    (its prompt's growth) also hold the previous reply and the template's framing: their median
    is about 1.3K at the defaults."""
    tool_sigma: float = 1.0
    """Lognormal sigma of tool outputs: one in a hundred is above 10x the median."""
    tool_min_tokens: int = 16
    output_median_tokens: int = 300
    output_sigma: float = 0.6
    output_max_tokens: int = 4_000
    gap_median_s: float = 2.0
    """Median tool gap before a turn (lognormal)."""
    gap_p99_s: float = 300.0
    """99th percentile of the tool gap; with the median it sets the lognormal's sigma."""
    gap_max_s: float = 1_800.0
    fork_fraction: float = 0.15
    """Share of main sessions that fan out subagents (exactly `round(sessions * fraction)`)."""
    subagents: IntRange = (1, 3)
    """Subagents a forking session starts together from its prefix at one turn."""
    subagent_turns: IntRange = (4, 12)

    def scaled(self, scale: float) -> AgenticLongParams:
        """Token counts multiplied by `scale`; sessions, turns and times unchanged. The chat
        template's own tokens (about 100 a turn) do not shrink, so tiny scales overshoot."""

        def n(x: int) -> int:
            return max(1, round(x * scale))

        def r(lo_hi: IntRange) -> IntRange:
            return (n(lo_hi[0]), n(lo_hi[1]))

        return replace(
            self,
            system_tokens=n(self.system_tokens),
            prefix_tokens=r(self.prefix_tokens),
            task_tokens=r(self.task_tokens),
            context_tokens=r(self.context_tokens),
            tool_median_tokens=n(self.tool_median_tokens),
            tool_min_tokens=n(self.tool_min_tokens),
            output_median_tokens=n(self.output_median_tokens),
            output_max_tokens=n(self.output_max_tokens),
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


# the 99th percentile of a standard normal: a lognormal's sigma is ln(p99 / p50) / _Z99
_Z99 = 2.3263


def agentic_long(
    params: AgenticLongParams | None = None, seed: int = 0, tf: TextFactory | None = None
) -> Workload:
    """Long coding-agent sessions over a few repositories, some fanning out subagents.

    A main session sends its group's prefix and a task, then each turn appends a tool result
    answering the previous reply's tool call. Its tool outputs are drawn lognormal, and scaled
    together when its last prompt would otherwise fall outside `context_tokens`. A forking
    session's subagents start with one of its middle turns' messages, then a task of their own
    and their own tool turns; they are replayed when the session sends that turn
    (`Session.spawned_at`), their `start_s` is the time it was planned for. `scale` (in `generate`)
    shrinks the token counts only: the same seed gives the same sessions, turns and gaps."""
    return _AgenticLong(params or AgenticLongParams(), seed, tf or TextFactory(seed=seed)).build()


class _AgenticLong:
    """The draws and token accounting of one `agentic_long` workload."""

    def __init__(self, p: AgenticLongParams, seed: int, tf: TextFactory) -> None:
        self.p = p
        self.seed = seed
        self.tf = tf
        self.rng = random.Random(f"agentic-long:{seed}")
        self.tpl = ChatTemplate()
        self.gap_sigma = math.log(p.gap_p99_s / p.gap_median_s) / _Z99
        self.prompt_end = tf.count(ChatTemplate.GENERATION_PROMPT)

    def tokens(self, msgs: Iterable[Msg]) -> int:
        """Tokens of `msgs` rendered by the built-in template (one message at a time)."""
        return sum(self.tf.count(self.tpl.render_message(m.as_dict())) for m in msgs)

    def size(self, lo_hi: IntRange) -> int:
        """A token count uniform in `lo_hi`, from one `random()` call: every other draw is then
        the same at any scale, so a scaled workload is the same sessions with fewer tokens."""
        lo, hi = lo_hi
        return lo + min(hi - lo, int(self.rng.random() * (hi - lo + 1)))

    def output(self) -> int:
        x = self.p.output_median_tokens * self.rng.lognormvariate(0.0, self.p.output_sigma)
        return max(1, min(self.p.output_max_tokens, round(x)))

    def gap(self) -> float:
        x = self.p.gap_median_s * self.rng.lognormvariate(0.0, self.gap_sigma)
        return round(min(self.p.gap_max_s, x), 6)

    def tool_sizes(self, n: int, lo: int, hi: int) -> list[int]:
        """`n` lognormal tool outputs of at least `tool_min_tokens`, scaled together to sum to
        `lo` or `hi` when they would fall outside (`lo` is met only when `hi` allows)."""
        p = self.p
        raw = [p.tool_median_tokens * self.rng.lognormvariate(0.0, p.tool_sigma) for _ in range(n)]
        total = sum(raw)
        budget = min(max(total, lo), hi)
        if not raw or budget == total:
            return [max(p.tool_min_tokens, round(x)) for x in raw]
        out = [max(p.tool_min_tokens, int(budget * x / total)) for x in raw]
        out[raw.index(max(raw))] += max(0, round(budget) - sum(out))  # rounding: the sum is exact
        return out

    def turns(
        self, sid: str, first: tuple[Msg, ...], n_turns: int, call: str, lo: int
    ) -> list[Step]:
        """A session's steps: `first` opens it, then `n_turns - 1` tool turns; its last prompt
        has at least `lo` tokens and at most `context_tokens[1]`."""
        p = self.p
        outs = [self.output() for _ in range(n_turns)]
        replies = [self.tf.make(f"{sid}:reply{k}", out) for k, out in enumerate(outs)]
        calls = [f"{call}{k + 1}" if k + 1 < n_turns else None for k in range(n_turns)]
        # the last prompt holds `first`, every reply but the last and n - 1 tool results
        fixed = self.tokens(first) + self.prompt_end
        fixed += self.tokens(
            Msg("assistant", replies[k], calls=calls[k]) for k in range(n_turns - 1)
        )
        fixed += self.tokens(Msg("tool", "", f"{call}{k}") for k in range(1, n_turns))
        hi = max(0, p.context_tokens[1] - fixed)
        sizes = self.tool_sizes(n_turns - 1, min(hi, max(0, lo - fixed)), hi)
        steps = [Step(first, outs[0], 0.0, replies[0], "first", calls[0])]
        for k in range(1, n_turns):
            n_tool = sizes[k - 1]
            tool = Msg("tool", self.tf.make(f"{sid}:tool{k}", n_tool), f"{call}{k}")
            label = "long-tool" if n_tool >= 10 * p.tool_median_tokens else "tool"
            steps.append(Step((tool,), outs[k], self.gap(), replies[k], label, calls[k]))
        return steps

    def subagents(self, parent: Session) -> list[Session]:
        """Subagents forking from `parent` at one of its middle turns, all at once."""
        p, rng = self.p, self.rng
        n = len(parent.steps)
        j = rng.randint(max(1, n // 4), max(1, 3 * n // 4))
        history: list[Msg] = []
        for step in parent.steps[:j]:
            history.extend(step.new_messages)
            reply = step.reply_msg()
            if reply is not None:
                history.append(reply)
        history.extend(parent.steps[j].new_messages)
        start = round(parent.start_s + sum(st.gap_s for st in parent.steps[1 : j + 1]), 6)
        out = []
        for b in range(rng.randint(*p.subagents)):
            sid = f"{parent.session_id}-sub{b}"
            text = self.tf.make(f"{sid}:task", self.size(p.task_tokens))
            first = (*history, Msg("user", "Subagent task: " + text))
            steps = self.turns(sid, first, rng.randint(*p.subagent_turns), f"sub{b}_call_", 0)
            steps[0] = replace(steps[0], label="subagent")
            out.append(
                Session(sid, start, tuple(steps), "subagent", parent.group, (parent.session_id, j))
            )
        return out

    def build(self) -> Workload:
        p, rng, tf = self.p, self.rng, self.tf
        system = Msg("system", tf.make(SYSTEM_KEY, p.system_tokens))
        head = "Repository context:\n"
        prefixes = []
        for g in range(p.repo_groups):
            n_repo = self.size(p.prefix_tokens) - self.tokens((system, Msg("user", head)))
            prefixes.append((system, Msg("user", head + tf.make(f"long-repo{g}", n_repo))))
        forking = set(rng.sample(range(p.sessions), round(p.sessions * p.fork_fraction)))
        sessions: list[Session] = []
        for i, start in enumerate(_arrivals(rng, p.sessions, p.rate_per_s)):
            sid = f"agentic-long-{self.seed}-{i}"
            g = rng.randrange(p.repo_groups)
            n_turns = rng.randint(*p.turns)
            task = Msg("user", "Task: " + tf.make(f"{sid}:task", self.size(p.task_tokens)))
            steps = self.turns(sid, (*prefixes[g], task), n_turns, "call_", p.context_tokens[0])
            sessions.append(Session(sid, start, tuple(steps), "agentic-long", f"repo{g}"))
            if i in forking and n_turns > 1:
                sessions.extend(self.subagents(sessions[-1]))
        sessions.sort(key=lambda s: s.start_s)
        return Workload("agentic-long", self.seed, tuple(sessions))


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
    "agentic-long": lambda seed, scale: agentic_long(AgenticLongParams().scaled(scale), seed),
}
"""Named generators: `(seed, scale) -> Workload`; `scale` multiplies the session count
(`agentic-long`: its token counts, so quick runs keep the sessions' shape)."""


def generate(name: str, seed: int = 0, scale: float = 1.0) -> Workload:
    """A named workload (see `GENERATORS`)."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; choose from {sorted(GENERATORS)}") from None
    return gen(seed, scale)
