"""GPT (``train/models/gpt.py``): learned positions, pre-LN blocks, a GeLU MLP of
``ffn_mult * h`` units, biases, tied embeddings.

Four Linears per block (QKV, attention projection, MLP up, MLP down; the second and
fourth transposed, so x and y swap roles) and two LayerNorms whose statistics travel
over x when x > 1.
"""

from __future__ import annotations

from axonn_launch.common.arch.base import (
    ADD_PASSES,
    ALL_GATHER,
    ALL_REDUCE,
    BACKWARD,
    COPY_PASSES,
    FP32,
    NORM,
    Architecture,
    Collective,
    LinearShape,
    ModelShape,
    SmallParam,
)
from axonn_launch.common.grid import Grid

# Element passes per token: a fused LayerNorm reads and writes once (2); the x-exact
# LayerNorm of x > 1 squares, sums twice, subtracts, scales, multiplies by the weight and
# adds the bias (12). GeLU reads and writes (2). Q, K, V and the attention output are
# copied between layouts. The attention core is fused (flash attention).
LN_FUSED_PASSES, LN_EXACT_PASSES, GELU_PASSES = 2, 12, 2


class GPTArchitecture(Architecture):
    name = "gpt"
    learned_positions = True

    def block_linears(self, model: ModelShape) -> tuple[LinearShape, ...]:
        h, f = model.d_model, model.d_ff
        mlp, qkv = "MLP weight block", "QKV weight block"
        return (
            LinearShape("qkv", h, 3 * h, inner="x", outer="y", segments=3, label=qkv),
            LinearShape("proj", h, h, inner="y", outer="x", label="attention projection block"),
            LinearShape("fc1", h, f, inner="x", outer="y", label=mlp),
            LinearShape("fc2", f, h, inner="y", outer="x", label=mlp),  # axonn.md §4.3 corrected
        )

    def norm_statistics(self, tokens: float, phase: str, x: int) -> tuple[Collective, ...]:
        """Two LayerNorms, fp32 over x: forward, an all-gather of three numbers per token
        and rank (shift, mean correction, M2: Chan's merge, exact); backward, an
        all-reduce of two per token (sums of g and g * x_hat)."""
        if phase == BACKWARD:
            one = Collective(ALL_REDUCE, "x", 2 * tokens, FP32, phase, NORM)
        else:
            one = Collective(ALL_GATHER, "x", 3 * tokens * x, FP32, phase, NORM)
        return one, one

    def layer_small_params(self, model: ModelShape) -> tuple[SmallParam, ...]:
        """QKV bias 3h over y, projection bias h over x, MLP biases f over y and h over
        x, two LayerNorms (weight and bias) h each over x."""
        h, f = model.d_model, model.d_ff
        return (
            SmallParam(3 * h, "y", segments=3),
            SmallParam(h, "x"),
            SmallParam(f, "y"),
            SmallParam(h, "x"),
            SmallParam(h, "x", count=4),
        )

    def model_small_params(self, model: ModelShape) -> tuple[SmallParam, ...]:
        """The position table S*h over x and the final LayerNorm 2h over x."""
        h = model.d_model
        return SmallParam(model.max_seq_len * h, "x"), SmallParam(h, "x", count=2)

    def layer_activation_bytes(
        self, model: ModelShape, grid: Grid, tokens: float, half: int
    ) -> float:
        """Sharded over x, fp32 (the residual stream is fp32 under autocast): the two
        LayerNorm inputs and the two LayerNorm outputs saved by QKV and MLP-up (with x > 1
        the LayerNorm is an autograd function of its own that saves only its input and its
        per-token statistics, recomputing the rest in backward). Sharded over y: q, k, v
        and the attention output (autocast dtype), the GeLU input and output (fp32, f
        each); the fused attention kernel adds a log-sum-exp per head (fp32) instead of
        the s^2 score matrices that Korthikanti et al. (2022) count without one. Per token
        and LayerNorm: mean and inverse deviation (fp32), three numbers when x > 1."""
        h, f = model.d_model, model.d_ff
        hidden = tokens * h / grid.x * 4 * 4
        wide = tokens * (4 * h * half + 2 * f * 4) / grid.y
        lse = tokens * model.n_head / grid.y * 4
        norms = tokens * 2 * (3 if grid.x > 1 else 2) * 4
        return hidden + wide + lse + norms

    def elementwise_passes(self, model: ModelShape, grid: Grid) -> float:
        """Two LayerNorms and residual adds over h/x; over y, the layout copies of q, k, v
        and the attention output, and GeLU."""
        h, f = model.d_model, model.d_ff
        ln = LN_FUSED_PASSES if grid.x == 1 else LN_EXACT_PASSES
        per_layer = (2 * ln + 2 * ADD_PASSES) * h / grid.x
        per_layer += COPY_PASSES * 4 * h / grid.y + GELU_PASSES * f / grid.y
        return per_layer

    def shape_problem(self, model: ModelShape) -> str | None:
        if model.kv_heads != model.n_head:
            return (
                f"model.n_kv_head={model.n_kv_head}: grouped-query attention needs"
                f" model.arch=llama; valid for arch=gpt: 0 or model.n_head={model.n_head}"
            )
        return None


GPT = GPTArchitecture()
