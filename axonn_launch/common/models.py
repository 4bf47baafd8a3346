"""Transformer shapes: parameter and FLOP counts computed from the shape, never typed in.

GPT shapes up to 160B are the ones in Megatron-AxoNN's ``launch_per_comm_model.py``
(see the AxoNN reference, section 5.3). 320B and 640B keep head dimension 128 and
choose (layers, hidden) so that the count lands within 3% of the name; the test
``tests/config/test_model_presets.py`` checks that bound. Llama shapes are those of the published
``config.json`` of each model (the presets name their source); their counts land
within 1% of the model cards' (``tests/common/test_llama_shapes.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from axonn_launch.common.arch import ARCHITECTURES, Architecture


@dataclass(frozen=True)
class ModelSpec:
    """A transformer shape. ``arch`` names an architecture of ``common/arch``, whose
    strategy (``architecture``) answers every architecture-specific question.

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
        return self.d_model // self.n_head if self.n_head else 0  # 0: a shape not read yet (hf)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def architecture(self) -> Architecture:
        """The strategy every architecture-specific formula asks (``common/arch/``)."""
        return ARCHITECTURES[self.arch]

    @property
    def d_ff(self) -> int:
        return self.architecture.mlp_width(self)

    @property
    def vocab_tables(self) -> int:
        """Vocabulary-sized tables: the token table, and the LM head's unless tied."""
        return 1 if self.tie_embeddings else 2

    @property
    def kv_dim(self) -> int:
        """Output features of the key (or of the value) projection."""
        return self.kv_heads * self.head_dim

    def linear_params_per_layer(self) -> int:
        """Weight elements of one block's Linears (biases excluded)."""
        return sum(lin.fan_in * lin.fan_out for lin in self.architecture.block_linears(self))

    def n_params(self) -> int:
        """Exact count of the model as the training core builds it."""
        arch = self.architecture
        small = sum(p.total for p in arch.layer_small_params(self))  # biases, norms
        per_layer = self.linear_params_per_layer() + small
        outside = sum(p.total for p in arch.model_small_params(self))  # positions, final norm
        tables = self.vocab_tables * self.vocab_size * self.d_model
        return self.n_layer * per_layer + tables + outside

    def flops_per_token(self, seq_len: int, *, recompute: bool) -> float:
        """Training FLOPs per token, Narayanan et al. (SC'21), as Megatron's get_flops,
        generalized to any block: passes * l * (2 * P + 4 * s * h) + 6 * V * h, with P the
        Linear weights of one block, 4 passes (forward, recompute, backward = 2) with full
        activation recompute and 3 without; the LM head runs once forward, twice backward.

        For GPT (P = 12h^2 when f = 4h) this is 96*l*h^2*(1 + s/(6h) + V/(16*l*h)) with
        recompute and 72*l*h^2*(1 + s/(6h) + V/(12*l*h)) without.
        """
        l, h, v, s = self.n_layer, self.d_model, self.vocab_size, seq_len
        passes = 4 if recompute else 3
        return float(passes * l * (2 * self.linear_params_per_layer() + 4 * s * h) + 6 * v * h)
