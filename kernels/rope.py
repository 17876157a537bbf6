"""Rotary position embedding (RoPE) as the kernels use it: the frequency table, and rotation of a
vector by a per-token angle, for the GPT-J (interleaved pairs) and NeoX (half-split) layouts.

RoPE at position p is a rotation R(p) of each pair; R(p + d) = R(d) R(p), so re-rotating a cached K
from position p to p + d is the rotation by the delta d alone. Angles are computed in float32 as
`position * inv_freq`, as Hugging Face models do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.layouts import LayoutError


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """A model's RoPE: `neox=True` rotates pairs (i, i + rotary_dim/2) (NeoX, Llama in HF), else
    interleaved pairs (2i, 2i + 1) (GPT-J, Llama's original). Dimensions past `rotary_dim` pass
    through unrotated; `rotary_dim=None` means the whole head."""

    head_dim: int
    neox: bool = True
    base: float = 10000.0
    rotary_dim: int | None = None

    @property
    def rot_dim(self) -> int:
        r = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if r % 2 or not 0 < r <= self.head_dim:
            raise LayoutError(f"rotary_dim {r} must be even and within head_dim {self.head_dim}")
        return r

    def inv_freq(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """`base ** (-2i / rotary_dim)` for i < rotary_dim / 2, float32."""
        r = self.rot_dim
        exps = torch.arange(0, r, 2, dtype=torch.float32, device=device) / r
        return 1.0 / (self.base**exps)


def rotate(
    x: torch.Tensor, angle_pos: torch.Tensor, spec: RopeSpec, inv_freq: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotate `x[..., tokens, heads, head_dim]`-shaped data by `angle_pos[tokens]` (a position or a
    position delta per token) and return it in x's dtype; the arithmetic is float32.

    `x` has shape `[..., T, H, D]` and `angle_pos` shape `[T]`."""
    r = spec.rot_dim
    freq = spec.inv_freq(x.device) if inv_freq is None else inv_freq.to(x.device, torch.float32)
    angle = angle_pos.to(device=x.device, dtype=torch.float32)[:, None] * freq[None, :]  # [T, r/2]
    cos = torch.cos(angle)[:, None, :]  # [T, 1, r/2] broadcast over heads
    sin = torch.sin(angle)[:, None, :]
    xf = x.float()
    rot, rest = xf[..., :r], xf[..., r:]
    if spec.neox:
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
        out = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        pairs = rot.unflatten(-1, (r // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
    return torch.cat((out, rest), dim=-1).to(x.dtype)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, inv_freq: torch.Tensor | None = None
) -> torch.Tensor:
    """RoPE of raw `x[..., T, H, D]` at `positions[T]`: the rotation by the position itself."""
    return rotate(x, positions, spec, inv_freq)


def token_deltas(delta: int | torch.Tensor, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Per-token position delta as float32 `[num_tokens]`, from one int or a per-token tensor."""
    if isinstance(delta, torch.Tensor):
        d = delta.to(device=device, dtype=torch.float32).reshape(-1)
        if d.numel() != num_tokens:
            raise LayoutError(f"need one delta per token ({num_tokens}), got {d.numel()}")
        return d
    return torch.full((num_tokens,), float(delta), dtype=torch.float32, device=device)
