"""Llama (``train/models/llama.py``): rotary positions (with Llama 3's scaling), RMSNorm, a SwiGLU
MLP of ``ffn_hidden`` units, grouped-query attention, no biases, an untied LM head
unless ``tie_embeddings``.

Five Linears per block (query, key-value, attention projection, SwiGLU gate-up, down;
the third and fifth transposed) and two RMSNorms. With more y ranks than KV heads each
y rank holds the one KV head its query heads use (``LinearShape.out_groups``).
"""

from __future__ import annotations

from axonn_launch.common.arch.base import (
    ADD_PASSES,
    ALL_REDUCE,
    COPY_PASSES,
    FP32,
    NORM,
    Architecture,
    Collective,
    LinearShape,
    ModelShape,
    SmallParam,
)
from axonn_launch.common.divisors import divisors, listed, listed_divisors
from axonn_launch.common.grid import Grid

# Element passes per token: the RMSNorm (unfused, at any x) squares (2), sums (1), scales
# (3) and multiplies by the weight (3); the rotary embedding of q and k reads and writes
# the halves swapped, two products and their sum (10); SwiGLU's SiLU (2 on the gate's f)
# and product (3 on f).
RMS_PASSES, ROPE_PASSES, SWIGLU_PASSES = 9, 10, 5


class LlamaArchitecture(Architecture):
    name = "llama"
    learned_positions = False

    def block_linears(self, model: ModelShape) -> tuple[LinearShape, ...]:
        h, f = model.d_model, model.d_ff
        kv, groups = 2 * model.kv_dim, model.kv_heads  # k rows then v rows, whole KV heads
        return (
            LinearShape("q", h, h, inner="x", outer="y", label="query weight block"),
            LinearShape("kv", h, kv, "x", "y", groups, segments=2, label="key-value weight block"),
            LinearShape("proj", h, h, inner="y", outer="x", label="attention projection block"),
            LinearShape(
                "gate_up", h, 2 * f, "x", "y", segments=2, label="MLP gate-up weight block"
            ),
            LinearShape("down", f, h, inner="y", outer="x", label="MLP down weight block"),
        )

    def norm_statistics(self, tokens: float, phase: str, x: int) -> tuple[Collective, ...]:
        """Two RMSNorms, fp32 over x: an all-reduce of one number per token each way (the
        sum of squares forward, the sum of g * x_hat backward)."""
        one = Collective(ALL_REDUCE, "x", tokens, FP32, phase, NORM)
        return one, one

    def layer_small_params(self, model: ModelShape) -> tuple[SmallParam, ...]:
        """Two RMSNorm weights, h each over x."""
        return (SmallParam(model.d_model, "x", count=2),)

    def model_small_params(self, model: ModelShape) -> tuple[SmallParam, ...]:
        """The final RMSNorm's weight, h over x."""
        return (SmallParam(model.d_model, "x"),)

    def layer_activation_bytes(
        self, model: ModelShape, grid: Grid, tokens: float, half: int
    ) -> float:
        """Sharded over x, fp32: per RMSNorm its input, its normalized input and its
        output (what the next Linears save), and one number per token (the inverse root
        mean square). Sharded over y, in the autocast dtype: the rotated q and k, v and
        the attention output, k and v at the query width (copied per query head), and
        SwiGLU's gate-up output (2f), SiLU output and product (f each). Per head a
        log-sum-exp, and the rotary cosines and sines (head_dim each), fp32."""
        h, f = model.d_model, model.d_ff
        norms = tokens * 2 * (3 * h / grid.x + 1) * 4
        wide = tokens * (4 * h + 4 * f) / grid.y * half
        lse = tokens * model.n_head / grid.y * 4
        rope = tokens * 2 * model.head_dim * 4
        return norms + wide + lse + rope

    def elementwise_passes(self, model: ModelShape, grid: Grid) -> float:
        """Two RMSNorms and residual adds over h/x; over y, the rotation of q and k (k at
        this rank's KV width), the copies of k and v to the query width when a KV head
        serves several local query heads, the attention output's layout copy, and
        SwiGLU."""
        h, f = model.d_model, model.d_ff
        heads = h / grid.y  # query width of this rank
        kv = next(lin for lin in self.block_linears(model) if lin.name == "kv").rows(grid) / 2
        copies = heads + (2 * heads if kv < heads else 0)
        per_layer = (2 * RMS_PASSES + 2 * ADD_PASSES) * h / grid.x
        per_layer += COPY_PASSES * copies + ROPE_PASSES * (heads + kv)
        return per_layer + SWIGLU_PASSES * f / grid.y

    def shape_problem(self, model: ModelShape) -> str | None:
        """KV heads that each serve a whole group of query heads, rotary pairs, and
        Llama 3's rope scaling."""
        if model.n_head % model.kv_heads:
            return (
                f"model.n_kv_head={model.n_kv_head}: must divide model.n_head={model.n_head}"
                f" (each KV head serves a group of query heads); valid n_kv_head:"
                f" {listed_divisors(model.n_head)}"
            )
        if model.head_dim % 2:
            valid = [n for n in divisors(model.d_model) if (model.d_model // n) % 2 == 0]
            return (
                f"model.n_head={model.n_head}: the head dimension model.d_model/model.n_head="
                f"{model.head_dim} must be even (rotary positions turn pairs of features)"
                f"; valid n_head: {listed(valid)}"
            )
        for key in ("norm_eps", "rope_theta"):
            if not getattr(model, key) > 0:
                return f"model.{key}={getattr(model, key)}: must be > 0"
        return _rope_scaling_problem(model) if model.rope_scaling_factor > 0 else None


def _rope_scaling_problem(model: ModelShape) -> str | None:
    low, high = model.rope_low_freq_factor, model.rope_high_freq_factor
    if not 0 < low < high:
        return (
            f"model.rope_high_freq_factor={high}: must exceed"
            f" model.rope_low_freq_factor={low} > 0 (Llama 3 rope scaling)"
        )
    if model.rope_original_max_seq_len < 1:
        return (
            f"model.rope_original_max_seq_len={model.rope_original_max_seq_len}:"
            " must be a positive integer (Llama 3 rope scaling)"
        )
    return None


LLAMA = LlamaArchitecture()
