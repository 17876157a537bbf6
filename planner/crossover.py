"""The load-vs-recompute crossover: the prompt length above which loading a prefix's KV over a
data path beats recomputing it, from the cost model's own formulas.

    load_s(n)      = latency_s(path) + n · K / bps(path)          (`TransportTiming.seconds`)
    recompute_s(n) = prefill_s(n, 0)                              (`TimingProfile.prefill_s`)
                   = base_s + per_token_s · n + per_token_ctx_s · n²/2
    crossover      = the least n ≥ 1 with load_s(m) < recompute_s(m) for every m ≥ n;
                     None when no such n exists (the path is slower per token than prefill)

`marginal=True` leaves base_s out of recompute_s: the prefix's recompute as part of a prompt
whose rest is computed anyway (the last prompt token always is), so only its per-token terms
are saved by loading.

K is the bytes a token's KV takes on the path: a dense model's `kv_bytes_per_token`, or a hybrid
spec's sealed rate `KVStateSpec.bytes_per_token()` (its windows and tail left out: a long prefix's
per-token rate). Scale-free: calibration scales are not applied.
"""

from __future__ import annotations

import math

from ownerserve.profiles import TimingProfile, TransportTiming


def load_beats_recompute(
    profile: TimingProfile,
    path: TransportTiming,
    bytes_per_token: float,
    tokens: int,
    *,
    marginal: bool = False,
) -> bool:
    """load_s(tokens) < recompute_s(tokens) (module docstring)."""
    recompute = profile.prefill_s(tokens, 0)
    if marginal and tokens > 0:
        recompute -= profile.prefill.base_s
    return path.seconds(tokens * bytes_per_token) < recompute


def crossover_tokens(
    profile: TimingProfile,
    path: TransportTiming,
    bytes_per_token: float,
    *,
    marginal: bool = False,
) -> int | None:
    """The least n ≥ 1 above which (n included) loading always beats recomputing (module
    docstring); None when recompute stays cheaper however long the prompt.

    recompute_s − load_s = (c/2)·n² + (a − K/bps)·n + (base_s − latency_s) with c =
    per_token_ctx_s, a = per_token_s (n ≥ 1): the larger root of that quadratic (or the linear
    term's zero when c = 0), then stepped to the exact integer on the formulas themselves."""
    if bytes_per_token <= 0:
        raise ValueError("bytes_per_token must be > 0")
    pf = profile.prefill
    qa = pf.per_token_ctx_s / 2.0
    qb = pf.per_token_s - bytes_per_token / path.bps
    qc = (0.0 if marginal else pf.base_s) - path.latency_s
    if qa > 0:
        disc = qb * qb - 4.0 * qa * qc
        root = 0.0 if disc < 0 else (-qb + math.sqrt(disc)) / (2.0 * qa)
    elif qb > 0:
        root = -qc / qb
    elif qb == 0 and qc > 0:
        root = 0.0
    else:
        return None
    n = max(1, math.floor(root) + 1)
    while n > 1 and load_beats_recompute(profile, path, bytes_per_token, n - 1, marginal=marginal):
        n -= 1
    while not load_beats_recompute(profile, path, bytes_per_token, n, marginal=marginal):
        n += 1
    return n
