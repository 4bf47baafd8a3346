"""A plain single-process GPT in ordinary PyTorch, loaded from a full state dict.

It shares no code with ``axonn_launch.train`` beyond the parameter names and full
shapes, so agreement with it checks the parallel model's layout and math.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from axonn_launch.common.models import ModelSpec


class ReferenceGPT(nn.Module):
    def __init__(self, spec: ModelSpec, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.spec = spec
        self.params = nn.ParameterDict(
            {name.replace(".", "__"): nn.Parameter(t.detach().clone()) for name, t in state.items()}
        )

    def p(self, name: str) -> torch.Tensor:
        return self.params[name.replace(".", "__")]

    def named_full(self) -> dict[str, torch.Tensor]:
        return {k.replace("__", "."): v for k, v in self.params.items()}

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.p(f"{name}.weight"), self.p(f"{name}.bias"))

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.p(f"{name}.weight"), self.p(f"{name}.bias"))

    def _attention(self, x: torch.Tensor, name: str) -> torch.Tensor:
        b, s, h = x.shape
        nh = self.spec.n_head
        q, k, v = self._linear(x, f"{name}.qkv").split(h, dim=-1)
        q, k, v = (t.view(b, s, nh, h // nh).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / (h // nh) ** 0.5
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(dim=-1) @ v
        return self._linear(out.transpose(1, 2).reshape(b, s, h), f"{name}.proj")

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        wte = self.p("embedding.wte")
        x = wte[idx] + self.p("embedding.wpe")[: idx.shape[1]]
        for i in range(self.spec.n_layer):
            x = x + self._attention(self._ln(x, f"blocks.{i}.ln1"), f"blocks.{i}.attn")
            hidden = F.gelu(self._linear(self._ln(x, f"blocks.{i}.ln2"), f"blocks.{i}.mlp.up"))
            x = x + self._linear(hidden, f"blocks.{i}.mlp.down")
        return self._ln(x, "ln_f") @ wte.t()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.logits(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
