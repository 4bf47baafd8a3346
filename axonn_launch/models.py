"""GPT shapes: parameter and FLOP counts computed from the shape, never typed in.

Shapes up to 160B are the ones in Megatron-AxoNN's ``launch_per_comm_model.py``
(see the AxoNN reference, section 5.3). 320B and 640B keep head dimension 128 and
choose (layers, hidden) so that the count lands within 3% of the name; the test
``tests/test_models.py`` checks that bound.
"""

from __future__ import annotations

from dataclasses import dataclass


ARCHITECTURES = ("gpt", "llama")


@dataclass(frozen=True)
class ModelSpec:
    """A transformer shape.

    ``arch=gpt``: learned positions, LayerNorm, GeLU MLP of ``ffn_mult * h`` units,
    biases, tied embeddings. ``arch=llama``: rotary positions (``rope_theta``, and Llama
    3's frequency scaling when ``rope_scaling_factor`` > 0), RMSNorm, SwiGLU MLP of
    ``ffn_hidden`` units, grouped-query attention with ``n_kv_head`` KV heads, no biases,
    embeddings tied only when ``tie_embeddings``.
    """

    name: str
    n_layer: int
    d_model: int
    n_head: int
    vocab_size: int
    max_seq_len: int
    ffn_mult: int = 4
    arch: str = "gpt"
    n_kv_head: int = 0  # 0: as many as n_head (multi-head attention)
    ffn_hidden: int = 0  # 0: ffn_mult * d_model
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3 rope scaling (HF rope_scaling {"rope_type": "llama3", ...}); factor 0 = none
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    tie_embeddings: bool = True
    init_from: str = ""  # a Hugging Face model directory whose weights start the job

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"model.arch={self.arch!r}: expected one of {', '.join(ARCHITECTURES)}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def d_ff(self) -> int:
        return self.ffn_hidden or self.ffn_mult * self.d_model

    @property
    def is_llama(self) -> bool:
        return self.arch == "llama"

    def n_params(self) -> int:
        """Exact count of the model as built by ``axonn_launch.train.model``."""
        h, f = self.d_model, self.d_ff
        attn = h * 3 * h + 3 * h + h * h + h  # qkv and output projection, with biases
        mlp = h * f + f + f * h + h
        norms = 2 * 2 * h
        per_layer = attn + mlp + norms
        embed = self.vocab_size * h + self.max_seq_len * h  # token (tied with LM head) + positions
        return self.n_layer * per_layer + embed + 2 * h  # final LayerNorm

    def flops_per_token(self, seq_len: int, *, recompute: bool) -> float:
        """Training FLOPs per token, Narayanan et al. (SC'21), as Megatron's get_flops.

        96*l*h^2*(1 + s/(6h) + V/(16*l*h)) with full activation recompute (one extra
        forward), 72*l*h^2*(1 + s/(6h) + V/(12*l*h)) without. Assumes ffn_mult == 4,
        as the formula does.
        """
        l, h, v, s = self.n_layer, self.d_model, self.vocab_size, seq_len
        if recompute:
            return 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        return 72 * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
