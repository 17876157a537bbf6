"""Tokenizers and chat templates shared by the router and the emulated engine.

`ByteTokenizer` is the built-in default (one token per UTF-8 byte, ids 0..255, specials above);
`HFTokenizer` loads a local `tokenizer.json` with the `tokenizers` package. A chat template
renders OpenAI messages to text; the default renders each message independently, so a session's
prompt is the concatenation of its messages' renderings and only new messages need tokenizing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jinja2.sandbox

Message = Mapping[str, Any]

EOS_TOKEN_ID = 256
BOS_TOKEN_ID = 257


class Tokenizer(Protocol):
    """Text <-> token ids."""

    name: str
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """One token per UTF-8 byte; deterministic, dependency-free, real block boundaries."""

    name = "byte"
    eos_token_id = EOS_TOKEN_ID
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded from a local file or directory."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _Tok

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        self._tok = _Tok.from_file(str(file))
        self.name = str(file)
        self.vocab_size = self._tok.get_vocab_size()
        eos = None
        for cand in ("<|endoftext|>", "</s>", "<|eot_id|>", "<eos>"):
            eos = self._tok.token_to_id(cand)
            if eos is not None:
                break
        self.eos_token_id = eos if eos is not None else 0

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` for the built-in tokenizer, else a path to a tokenizer.json or its directory."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            else:
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    return json.dumps(content, sort_keys=True, separators=(",", ":"))


class ChatTemplate:
    """Renders OpenAI chat messages to a prompt string.

    Without a Jinja source it uses the built-in per-message format
    `<|role|>content[tool_calls json]<|end|>\\n` and a trailing `<|assistant|>` generation prompt.
    A Jinja source (e.g. a model's `chat_template`) is rendered in a sandbox with `messages`,
    `tools` and `add_generation_prompt`.
    """

    GENERATION_PROMPT = "<|assistant|>"

    def __init__(self, source: str | None = None) -> None:
        self.source = source
        self._template = (
            jinja2.sandbox.ImmutableSandboxedEnvironment().from_string(source) if source else None
        )

    @property
    def per_message(self) -> bool:
        """True when a prompt is the concatenation of independently rendered messages."""
        return self._template is None

    def render_message(self, message: Message) -> str:
        """One message in the built-in format."""
        role = str(message.get("role", "user"))
        text = _content_text(message.get("content"))
        extra = ""
        if message.get("tool_calls"):
            extra = json.dumps(message["tool_calls"], sort_keys=True, separators=(",", ":"))
        if role == "tool" and message.get("tool_call_id"):
            text = f"[{message['tool_call_id']}]{text}"
        return f"<|{role}|>{text}{extra}<|end|>\n"

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if self._template is not None:
            return str(
                self._template.render(
                    messages=list(messages),
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                )
            )
        head = ""
        if tools:
            head = "<|tools|>" + json.dumps(list(tools), sort_keys=True, separators=(",", ":"))
            head += "<|end|>\n"
        body = "".join(self.render_message(m) for m in messages)
        return head + body + (self.GENERATION_PROMPT if add_generation_prompt else "")


def load_chat_template(path: str | None) -> ChatTemplate:
    """The built-in template for None, else a Jinja file."""
    if path is None:
        return ChatTemplate()
    return ChatTemplate(Path(path).read_text())
