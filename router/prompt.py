"""`Prompt`: one request as the router knows it once the `tokenize` stage ran (the body the
workers get, its session, token ids and block hashes, chunks, whether it forks its session):
what every later stage of the request path reads."""

from __future__ import annotations

from dataclasses import dataclass

from ownerserve.chunks import ChunkedPrompt
from ownerserve.records import fast_init
from router.requests import CompletionRequest
from router.session import SessionInfo, SessionKey
from router.tokens import Tokenized


@fast_init
@dataclass(frozen=True, slots=True)
class Prompt:
    """A tokenized request (`router.stages.tokenize`)."""

    req: CompletionRequest
    """As the workers get it: a chunked prompt's body carries its chunk layout."""
    session: SessionKey
    """Its session; an unkeyed raw prompt's is derived from its chain."""
    tok: Tokenized
    block_size: int
    """The model's KV block size in tokens."""
    chunks: ChunkedPrompt | None
    """Its chunks, when its model has chunk reuse on and it has some."""
    info: SessionInfo | None
    """What the router remembered of its session before this request (None: a new one)."""
    is_fork: bool
    """`n > 1`, another request of its session in flight, or a prompt that does not extend
    the session's previous one."""

    @property
    def tokens(self) -> int:
        """Prompt tokens."""
        return len(self.tok.token_ids)
