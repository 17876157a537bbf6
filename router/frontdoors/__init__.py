"""The front doors agents use besides chat completions: the Anthropic Messages API and the
OpenAI Responses API (with stored conversations), both served over the workers' chat
completions through the router's request pipeline."""

from router.frontdoors.doors import DoorWriter, FrontDoors
from router.frontdoors.store import (
    ConversationStore,
    InMemoryConversationStore,
    RedisConversationStore,
    open_store,
)

__all__ = [
    "ConversationStore",
    "DoorWriter",
    "FrontDoors",
    "InMemoryConversationStore",
    "RedisConversationStore",
    "open_store",
]
