"""Whether a model and a training configuration can run on a grid: every rule, once.

The login node (``validate``, ``plan``) and the job (``train.recheck_rules``) ask the
same functions, and each rule mirrors what the job's layers and loader require
(a test builds them to check that the two agree). Torch-free. Each rule
returns None or one line naming the field, its value and what would be valid.

The sharding the rules follow (AxoNN's): ``docs/cost-model.md`` ("common/rules.py").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from axonn_launch.common.divisors import LISTED_DIVISORS, divisors, listed, listed_divisors
from axonn_launch.common.grid import Grid
from axonn_launch.common.machine import Hardware
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import TrainConfig
from axonn_launch.common.traffic import block_linears

if TYPE_CHECKING:
    pass

# --------------------------------------------------------------------------- shard sizes


def padded_vocab(vocab_size: int, grid: Grid) -> int:
    """Token-table rows after padding to a multiple of the x*y plane."""
    plane = grid.x * grid.y
    return -(-vocab_size // plane) * plane


def local_vocab(vocab_size: int, grid: Grid) -> int:
    """Token-table rows one plane member holds (before the split over z)."""
    return padded_vocab(vocab_size, grid) // (grid.x * grid.y)


def z_blocks(model: ModelSpec, grid: Grid) -> dict[str, int]:
    """Elements of each block that is flattened and split over z, by name.

    Each Linear's block (``traffic.block_linears``; GPT: QKV [3h/y, h/x], projection
    [h/x, h/y], MLP up [f/y, h/x] and down [h/x, f/y]; Llama: query [h/y, h/x], key-value
    [2*n_kv_head*head_dim/y or 2*head_dim, h/x], projection, gate-up [2f/y, h/x] and
    down), and the token table [V_l, h] with V_l = padded vocab / (x*y) (an untied LM
    head has the same). Valid only when ``shape_problem`` finds no problem with heads,
    hidden and MLP over x and y.
    """
    blocks = {lin.label: int(lin.block_elements(grid)) for lin in block_linears(model)}
    blocks["token table block"] = local_vocab(model.vocab_size, grid) * model.d_model
    return blocks


# --------------------------------------------------------------------------- the rules


def model_problem(model: ModelSpec) -> str | None:
    """The model alone: whole heads (the QKV view in ``Attention``), then what its
    architecture requires (``Architecture.shape_problem``)."""
    if model.n_head < 1:
        return f"model.n_head={model.n_head}: must be a positive integer"
    if model.d_model % model.n_head:
        return (
            f"model.d_model={model.d_model}: must be divisible by model.n_head={model.n_head}"
            f"; valid n_head: {listed_divisors(model.d_model)}"
        )
    for key in ("n_kv_head", "ffn_hidden"):
        if getattr(model, key) < 0:
            return f"model.{key}={getattr(model, key)}: must be >= 0 (0 = the default)"
    return model.architecture.shape_problem(model)


def valid_y(model: ModelSpec) -> list[int]:
    """Every y the model's heads, KV heads and MLP can be split over."""
    return [y for y in divisors(model.n_head) if _y_problem(model, y) is None]


def _y_problem(model: ModelSpec, y: int) -> str | None:
    if model.n_head % y:
        return f"must divide model.n_head={model.n_head} (heads are split over y)"
    kv = model.kv_heads
    if kv % y and y % kv:
        return (
            f"must divide model.n_kv_head={kv} (KV heads split over y) or be a multiple of"
            " it (each y rank holds the one KV head its query heads use)"
        )
    if model.d_ff % y:
        return (
            f"must divide the MLP width {model.d_ff} (model.ffn_hidden, or"
            " model.ffn_mult*model.d_model; its units are split over y)"
        )
    return None


def shape_problem(model: ModelSpec, grid: Grid) -> str | None:
    """Why the model's tensors cannot be split over the grid's x, y and z, or None."""
    why = _y_problem(model, grid.y)
    if why:
        valid = valid_y(model)
        shown = listed_divisors(model.n_head) if valid == divisors(model.n_head) else listed(valid)
        return f"grid.y={grid.y}: {why}; valid y: {shown}"
    if model.d_model % grid.x:
        return (
            f"grid.x={grid.x}: must divide model.d_model={model.d_model} (the hidden dimension"
            f" is split over x); valid x: {listed_divisors(model.d_model)}"
        )
    blocks = z_blocks(model, grid)
    for name, elements in blocks.items():
        if elements % grid.z:
            return (
                f"grid.z={grid.z}: must divide the {name} of {elements} elements per x*y shard"
                f"{_vocab_note(model, grid) if name.startswith('token') else ''}"
                f"; valid z: {listed_divisors(math.gcd(*blocks.values()))}"
            )
    return None


def placement_problem(hardware: Hardware, grid: Grid) -> str | None:
    """x must stay inside a node: ranks are numbered x fastest, and x's collectives (two
    per layer, in the forward and the backward pass) need the node's fast links, as in
    AxoNN. So x divides the GPUs of a node. The planner rejects any other x; an explicit
    grid with one runs, slower, after a warning (``resolve.placement_warnings``)."""
    if hardware.gpus_per_node % grid.x:
        return f"grid.x={grid.x} does not divide the {hardware.gpus_per_node} GPUs of a node"
    return None


def new_tokens_problem(key: str, new_tokens: int, model: ModelSpec) -> str | None:
    """Tokens to generate must leave room for a prompt of at least one token inside the
    KV cache of ``max_seq_len`` positions (generation.py checks each batch's longest)."""
    if not 1 <= new_tokens < model.max_seq_len:
        return (
            f"{key}={new_tokens}: must be between 1 and model.max_seq_len-1="
            f"{model.max_seq_len - 1} (a prompt needs at least one token)"
        )
    return None


def prompt_length_problem(
    where: str, prompt_tokens: int, key: str, new_tokens: int, model: ModelSpec
) -> str | None:
    """A prompt and its new tokens must fit the model's ``max_seq_len`` positions (the
    KV cache and the position table); ``where`` names the prompt (file and line). The
    login node (config/resolve.py) and the job (train/inference/generation.py) both ask this."""
    if prompt_tokens + new_tokens > model.max_seq_len:
        room = model.max_seq_len - new_tokens
        return (
            f"{where}: a prompt of {prompt_tokens} tokens plus {key}={new_tokens} exceeds "
            f"model.max_seq_len={model.max_seq_len} (at most {room} prompt "
            f"token{'' if room == 1 else 's'} with {new_tokens} new)"
        )
    return None


def seq_len_problem(model: ModelSpec, train: TrainConfig) -> str | None:
    """The position table (GPT) and the rotary context (Llama) have ``max_seq_len`` rows."""
    if train.seq_len > model.max_seq_len:
        return f"train.seq_len={train.seq_len}: must be <= model.max_seq_len={model.max_seq_len}"
    return None


def micro_batch_candidates(train: TrainConfig, grid: Grid) -> list[int]:
    """Valid micro-batches for this grid and global batch, largest first."""
    if train.global_batch % grid.data:
        return []
    per_replica = train.global_batch // grid.data
    return [m for m in reversed(divisors(per_replica)) if m % grid.z == 0]


def batch_problem(train: TrainConfig, grid: Grid) -> str | None:
    """Each z rank takes micro_batch/z sequences; a step is whole micro-steps of every
    data replica. With ``train.micro_batch`` None (automatic), whether any value works."""
    if train.micro_batch is None:
        if train.global_batch % (grid.data * grid.z):
            return (
                f"train.global_batch={train.global_batch}: must be a multiple of"
                f" grid.data*grid.z={grid.data * grid.z} (each data replica's z ranks need"
                " whole sequences)"
            )
        return None
    valid = _valid_micro_batches(train, grid)
    if train.micro_batch % grid.z:
        return (
            f"train.micro_batch={train.micro_batch}: must be divisible by grid.z={grid.z}"
            f" (each z rank takes micro_batch/z sequences){valid}"
        )
    step = train.micro_batch * grid.data
    if train.global_batch % step:
        return (
            f"train.global_batch={train.global_batch}: must be a multiple of"
            f" train.micro_batch*grid.data={step}{valid}"
        )
    return None


def throughput_problem(model: ModelSpec, train: TrainConfig) -> str | None:
    """Weight caching covers whole blocks of the model; the ORS window counts blocks."""
    if train.cache_layers is not None and not 0 <= train.cache_layers <= model.n_layer:
        return (
            f"train.cache_layers={train.cache_layers}: must be between 0 and"
            f" model.n_layer={model.n_layer} (blocks whose gathered weights are kept)"
        )
    if train.ors_window < 0:
        return (
            f"train.ors_window={train.ors_window}: must be >= 0 (blocks of pending"
            " weight-grad reduce-scatters; 0 = no bound)"
        )
    return None


def job_problem(model: ModelSpec, grid: Grid, train: TrainConfig) -> str | None:
    """Every rule the job itself depends on (all but memory), first problem first."""
    return (
        model_problem(model)
        or shape_problem(model, grid)
        or seq_len_problem(model, train)
        or batch_problem(train, grid)
        or throughput_problem(model, train)
    )


# --------------------------------------------------------------------------- wording

# Letters whose spoken name begins with a vowel sound: "an H100", "an MI250X", "an A100".
VOWEL_SOUND_LETTERS = "AEFHILMNORSX"


def with_article(name: str) -> str:
    """``name`` after "a" or "an": read letter by letter when it opens with a capital and
    then a capital or digit (an initialism: A100, MI250X-GCD, GH200), else as a word."""
    spelled = len(name) > 1 and name[0].isupper() and (name[1].isupper() or name[1].isdigit())
    vowel = name[:1].upper() in (VOWEL_SOUND_LETTERS if spelled else "AEIOU")
    return f"{'an' if vowel else 'a'} {name}"


def or_list(items: list[str]) -> str:
    """Joined as: a; a or b; a, b or c."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" or {items[-1]}"


def _valid_micro_batches(train: TrainConfig, grid: Grid) -> str:
    candidates = micro_batch_candidates(train, grid)
    if not candidates:
        return ""
    shown = ", ".join(map(str, candidates[:LISTED_DIVISORS]))
    return f"; valid micro_batch: {shown}{', ...' if len(candidates) > LISTED_DIVISORS else ''}"


def _vocab_note(model: ModelSpec, grid: Grid) -> str:
    rows = local_vocab(model.vocab_size, grid)
    return (
        f" (model.vocab_size={model.vocab_size} padded to {rows} rows per member of the"
        f" x*y={grid.x * grid.y} plane, times model.d_model={model.d_model})"
    )
