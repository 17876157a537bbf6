"""A reference forward pass of the tiny Llama (plain torch, float32, the model's own safetensors
read by hand) with chunk-isolated attention (Block-Attention's).

The definition it computes: the system segment [0, S) is causal; each chunk's load span (the
chunk and the separator leading into it) sees the system segment and itself only, computed at
the virtual positions right after the system segment (S, S + 1, ...); its K is then rotated
to the positions the span actually sits at; the rest (the separator after the last chunk and
the question) sees everything, at its actual positions. Nothing here comes from vLLM or from
`kernels`: RoPE is the Hugging Face `rotate_half` form.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V as [tokens, kv_heads, head_dim]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, as float32."""
    raw = path.read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8 : 8 + n])
    body = memoryview(raw)[8 + n :]
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        t = torch.frombuffer(bytearray(body[lo:hi]), dtype=_DTYPES[meta["dtype"]])
        out[name] = t.view(meta["shape"]).float()
    return out


class TinyLlama:
    """The model dir's Llama, float32."""

    def __init__(self, model_dir: Path) -> None:
        self.cfg = json.loads((model_dir / "config.json").read_text())
        self.w = read_safetensors(model_dir / "model.safetensors")
        self.heads = self.cfg["num_attention_heads"]
        self.kv_heads = self.cfg["num_key_value_heads"]
        self.dim = self.cfg["head_dim"]
        exps = torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim
        self.inv_freq = 1.0 / (float(self.cfg["rope_theta"]) ** exps)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`x[T, H, D]` rotated to `positions[T]` (HF `rotate_half`, NeoX pairs)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        half = self.dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.cfg["rms_norm_eps"]) * w

    def forward(
        self, ids: Sequence[int], positions: Sequence[int], past: KV | None = None
    ) -> tuple[torch.Tensor, KV]:
        """Logits of the last token and the new tokens' KV (K rotated), the new tokens
        attending to all of `past` and causally to each other."""
        w = self.w
        t = len(ids)
        pos = torch.tensor(list(positions))
        x = w["model.embed_tokens.weight"][torch.tensor(list(ids))]
        new: KV = []
        for layer in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            h = self._norm(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(t, self.heads, self.dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(t, self.kv_heads, self.dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(t, self.kv_heads, self.dim)
            q, k = self.rope(q, pos), self.rope(k, pos)
            new.append((k, v))
            pk, pv = past[layer] if past else (k[:0], v[:0])
            ks, vs = torch.cat((pk, k)), torch.cat((pv, v))
            n_past = pk.shape[0]
            group = self.heads // self.kv_heads
            ks = ks.repeat_interleave(group, dim=1)
            vs = vs.repeat_interleave(group, dim=1)
            scores = torch.einsum("thd,shd->hts", q, ks) / self.dim**0.5
            mask = torch.ones(t, n_past + t, dtype=torch.bool)
            mask[:, n_past:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
            scores = scores.masked_fill(~mask, float("-inf"))
            attn = torch.einsum("hts,shd->thd", scores.softmax(-1), vs).reshape(t, -1)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = self._norm(x, w["model.norm.weight"])
        return x[-1] @ w["lm_head.weight"].T, new

    def causal_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """Next-token log-probabilities after the whole prompt, plain causal attention."""
        logits, _ = self.forward(ids, range(len(ids)))
        return logits.log_softmax(-1)

    def chunked_logprobs(
        self, ids: Sequence[int], system_end: int, spans: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        """Next-token log-probabilities with chunk-isolated attention (the module docstring)
        for load spans `spans` (in order, contiguous from `system_end`)."""
        s = system_end
        if not s:
            raise ValueError("a chunked prompt needs a system segment")
        _, system = self.forward(ids[:s], range(s))
        cache = list(system)
        for lo, hi in spans:
            # the span sees the system segment only, at the positions right after it
            _, span_kv = self.forward(ids[lo:hi], range(s, s + hi - lo), system)
            delta = torch.full((hi - lo,), float(lo - s))
            cache = [
                (torch.cat((ck, self.rope(k, delta))), torch.cat((cv, v)))
                for (ck, cv), (k, v) in zip(cache, span_kv, strict=True)
            ]
        last = spans[-1][1]
        logits, _ = self.forward(ids[last:], range(last, len(ids)), cache)
        return logits.log_softmax(-1)
