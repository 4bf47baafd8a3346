"""Hugging Face Llama checkpoints: config.json <-> ``ModelSpec`` and the tensor names.

Login-node code (json only, never torch or transformers): the launcher checks a
``model.init_from`` directory here before anything is submitted, the job imports the
weights with ``axonn_launch.train.models.hf_import`` and ``python -m axonn_launch.export --hf``
writes them back. ``resolve_hf_model`` is the launcher's one call.

What each function checks or maps: ``docs/checkpoints.md`` ("common/hf.py").
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from axonn_launch.common.arch import LLAMA
from axonn_launch.common.models import ModelSpec

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
ROPE_TYPES = ("default", "llama3")
# safetensors dtypes a weight may be stored in (the job converts them to its own dtype);
# an integer or boolean tensor where a weight belongs would be cast silently
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on its JSON header
# tokenizer and generation files that travel with exported weights (copied when present)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
)


class HFConfigError(ValueError):
    """A Hugging Face directory or config our Llama cannot use: one line."""


def _get(config: dict, key: str, source: str, default: Any = None, kind: type = int) -> Any:
    value = config.get(key, default)
    if value is None:
        raise HFConfigError(f"{source} has no {key}; a LlamaForCausalLM config needs it")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise HFConfigError(f"{source} has {key}={value!r}; expected a positive integer")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise HFConfigError(f"{source} has {key}={value!r}; expected a number")
    return float(value) if kind is float else value


def _rope(config: dict, source: str) -> dict[str, Any]:
    """rope_theta and the llama3 scaling, from the legacy keys or transformers 5's
    ``rope_parameters`` (which may hold both)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise HFConfigError(f"{source} has a rope_parameters/rope_scaling that is not a mapping")
    merged = {**params, **scaling}
    theta = config.get("rope_theta", merged.get("rope_theta", 10000.0))
    theta = _get({"rope_theta": theta}, "rope_theta", source, kind=float)
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise HFConfigError(
            f"{source} has rope_type={rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    out: dict[str, Any] = {"rope_theta": theta}
    if rope_type == "llama3":
        key = "original_max_position_embeddings"
        out.update(
            rope_scaling_factor=_get(merged, "factor", source, kind=float),
            rope_low_freq_factor=_get(merged, "low_freq_factor", source, kind=float),
            rope_high_freq_factor=_get(merged, "high_freq_factor", source, kind=float),
            rope_original_max_seq_len=_get(merged, key, source),
        )
        if out["rope_scaling_factor"] <= 0:
            raise HFConfigError(
                f"{source} has llama3 factor={out['rope_scaling_factor']}; "
                "expected a positive number"
            )
    return out


def spec_from_hf_config(config: dict, name: str, *, source: str = CONFIG) -> ModelSpec:
    """The ``ModelSpec`` (arch llama) of a ``LlamaForCausalLM`` config.json."""
    model_type = config.get("model_type")
    if model_type != "llama":
        raise HFConfigError(
            f"{source} has model_type={model_type!r}; only 'llama' (LlamaForCausalLM) is supported"
        )
    archs = config.get("architectures") or ["LlamaForCausalLM"]
    if "LlamaForCausalLM" not in archs:
        raise HFConfigError(f"{source} has architectures={archs!r}; expected LlamaForCausalLM")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag, False):
            raise HFConfigError(
                f"{source} has {flag}={config[flag]!r}; only false is supported (no biases)"
            )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise HFConfigError(f"{source} has hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
    if config.get("pretraining_tp", 1) != 1:
        raise HFConfigError(
            f"{source} has pretraining_tp={config['pretraining_tp']!r}; only 1 is supported"
        )
    hidden = _get(config, "hidden_size", source)
    heads = _get(config, "num_attention_heads", source)
    kv = _get(config, "num_key_value_heads", source, default=heads)
    if hidden % heads:
        raise HFConfigError(
            f"{source} has hidden_size={hidden} not divisible by num_attention_heads={heads}"
        )
    if heads % kv:
        raise HFConfigError(
            f"{source} has num_key_value_heads={kv}; it must divide num_attention_heads={heads}"
        )
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        raise HFConfigError(
            f"{source} has head_dim={head_dim}; only hidden_size / "
            f"num_attention_heads = {hidden // heads} is supported"
        )
    tie = config.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise HFConfigError(f"{source} has tie_word_embeddings={tie!r}; expected true or false")
    return ModelSpec(
        name=name,
        arch="llama",
        n_layer=_get(config, "num_hidden_layers", source),
        d_model=hidden,
        n_head=heads,
        n_kv_head=kv,
        ffn_hidden=_get(config, "intermediate_size", source),
        vocab_size=_get(config, "vocab_size", source),
        max_seq_len=_get(config, "max_position_embeddings", source),
        norm_eps=_get(config, "rms_norm_eps", source, default=1e-6, kind=float),
        tie_embeddings=tie,
        **_rope(config, source),
    )


def hf_config_from_spec(spec: ModelSpec, dtype: str = "float32") -> dict[str, Any]:
    """A config.json that transformers (4.x and 5.x) loads as ``LlamaForCausalLM``."""
    if spec.arch != LLAMA.name:
        raise HFConfigError(f"model.arch={spec.arch!r}: Hugging Face export is for Llama models")
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.d_model,
        "intermediate_size": spec.d_ff,
        "num_hidden_layers": spec.n_layer,
        "num_attention_heads": spec.n_head,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_seq_len,
        "rms_norm_eps": spec.norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": spec.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
    }
    if spec.rope_scaling_factor > 0:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": spec.rope_scaling_factor,
            "low_freq_factor": spec.rope_low_freq_factor,
            "high_freq_factor": spec.rope_high_freq_factor,
            "original_max_position_embeddings": spec.rope_original_max_seq_len,
        }
    return config


def hf_segments(spec: ModelSpec) -> dict[str, list[tuple[str, int]]]:
    """Our parameter name -> [(HF tensor name, rows)], concatenated along dim 0."""
    h, hd, f = spec.d_model, spec.head_dim, spec.d_ff
    kv_rows = spec.kv_heads * hd
    out: dict[str, list[tuple[str, int]]] = {
        "embedding.wte": [("model.embed_tokens.weight", spec.vocab_size)]
    }
    for i in range(spec.n_layer):
        ours, hf = f"blocks.{i}", f"model.layers.{i}"
        out[f"{ours}.ln1.weight"] = [(f"{hf}.input_layernorm.weight", h)]
        out[f"{ours}.attn.q.weight"] = [(f"{hf}.self_attn.q_proj.weight", spec.n_head * hd)]
        out[f"{ours}.attn.kv.weight"] = [
            (f"{hf}.self_attn.k_proj.weight", kv_rows),
            (f"{hf}.self_attn.v_proj.weight", kv_rows),
        ]
        out[f"{ours}.attn.proj.weight"] = [(f"{hf}.self_attn.o_proj.weight", h)]
        out[f"{ours}.ln2.weight"] = [(f"{hf}.post_attention_layernorm.weight", h)]
        out[f"{ours}.mlp.gate_up.weight"] = [
            (f"{hf}.mlp.gate_proj.weight", f),
            (f"{hf}.mlp.up_proj.weight", f),
        ]
        out[f"{ours}.mlp.down.weight"] = [(f"{hf}.mlp.down_proj.weight", h)]
    out["ln_f.weight"] = [("model.norm.weight", h)]
    if not spec.tie_embeddings:
        out["embedding.lm_head"] = [("lm_head.weight", spec.vocab_size)]
    return out


# --- the init_from directory ------------------------------------------------------------


def read_hf_config(directory: str, field: str = "model.init_from") -> dict:
    """config.json of a Hugging Face directory that also holds safetensors weights."""
    path = Path(directory)
    if not path.is_dir():
        raise HFConfigError(
            f"{field}={directory!r}: no such directory (a Hugging Face "
            "model directory with config.json and safetensors weights)"
        )
    if not (path / CONFIG).is_file():
        raise HFConfigError(f"{field}={directory!r}: has no {CONFIG}")
    if not (path / SINGLE).is_file() and not (path / INDEX).is_file():
        raise HFConfigError(
            f"{field}={directory!r}: has no safetensors weights ({SINGLE} or "
            f"{INDEX}); .bin checkpoints are not supported"
        )
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise HFConfigError(f"{path / CONFIG}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise HFConfigError(f"{path / CONFIG}: expected a JSON object")
    return config


# (our field, HF key, our value, HF value) for every field that must agree
def _comparisons(model: ModelSpec, hf: ModelSpec) -> list[tuple[str, str, Any, Any, bool]]:
    rows = [
        ("n_layer", "num_hidden_layers", model.n_layer, hf.n_layer),
        ("d_model", "hidden_size", model.d_model, hf.d_model),
        ("n_head", "num_attention_heads", model.n_head, hf.n_head),
        ("n_kv_head", "num_key_value_heads", model.kv_heads, hf.kv_heads),
        ("ffn_hidden", "intermediate_size", model.d_ff, hf.d_ff),
        ("vocab_size", "vocab_size", model.vocab_size, hf.vocab_size),
        ("norm_eps", "rms_norm_eps", model.norm_eps, hf.norm_eps),
        ("rope_theta", "rope_theta", model.rope_theta, hf.rope_theta),
        ("rope_scaling_factor", "rope_scaling.factor", model.rope_scaling_factor,
         hf.rope_scaling_factor),
        ("tie_embeddings", "tie_word_embeddings", model.tie_embeddings, hf.tie_embeddings),
    ]  # fmt: skip
    if hf.rope_scaling_factor > 0:
        rows += [
            ("rope_low_freq_factor", "rope_scaling.low_freq_factor",
             model.rope_low_freq_factor, hf.rope_low_freq_factor),
            ("rope_high_freq_factor", "rope_scaling.high_freq_factor",
             model.rope_high_freq_factor, hf.rope_high_freq_factor),
            ("rope_original_max_seq_len", "rope_scaling.original_max_position_embeddings",
             model.rope_original_max_seq_len, hf.rope_original_max_seq_len),
        ]  # fmt: skip
    return [(*row, _same(row[2], row[3])) for row in rows]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _shown(model: ModelSpec, field: str) -> str:
    value = getattr(model, field)
    if field == "n_kv_head" and value == 0:
        return f"0 (= n_head, {model.kv_heads})"
    if field == "ffn_hidden" and value == 0:
        return f"0 (= ffn_mult*d_model, {model.d_ff})"
    return repr(value) if isinstance(value, str) else str(value)


def init_from_problem(model: ModelSpec) -> str | None:
    """Why ``model.init_from`` cannot start ``model`` (one line), or None."""
    if not model.init_from:
        return None
    try:
        if model.arch != LLAMA.name:
            return (
                f"model.init_from={model.init_from!r}: Hugging Face weights are for Llama "
                f"models; model.arch={model.arch!r} (use model.arch=llama or model=hf)"
            )
        config = read_hf_config(model.init_from)
        where = str(Path(model.init_from) / CONFIG)
        hf = spec_from_hf_config(config, model.name, source=where)
    except HFConfigError as exc:
        return str(exc)
    problems = [
        f"model.{field}={_shown(model, field)} but {where} has {key}={theirs}"
        for field, key, _, theirs, same in _comparisons(model, hf)
        if not same
    ]
    if model.max_seq_len > hf.max_seq_len:
        problems.append(
            f"model.max_seq_len={model.max_seq_len} but {where} has "
            f"max_position_embeddings={hf.max_seq_len} (it may be at most that)"
        )
    if problems:
        return "; ".join(problems) + " (or use model=hf to take the shape from config.json)"
    return weights_problem(model.init_from, hf_segments(model))


def resolve_hf_model(model: ModelSpec) -> ModelSpec:
    """The model the launcher runs. ``model=hf`` (``n_layer`` 0): the shape of
    ``model.init_from``'s config.json (keeping ``name`` and a smaller ``max_seq_len``);
    any other preset with ``init_from``: checked against the config.json. ``init_from``
    is made absolute (the job may run elsewhere). Raises ``HFConfigError`` (one line)."""
    if model.init_from:
        absolute = os.path.abspath(os.path.expanduser(model.init_from))
        if absolute != model.init_from:
            model = replace(model, init_from=absolute)
    if model.n_layer == 0:
        if not model.init_from:
            raise HFConfigError(
                "model.init_from='': model=hf takes its shape from a Hugging Face Llama "
                "directory; set model.init_from=DIR (with config.json and safetensors weights)"
            )
        config = read_hf_config(model.init_from)
        where = str(Path(model.init_from) / CONFIG)
        hf = spec_from_hf_config(config, model.name, source=where)
        seq = model.max_seq_len or hf.max_seq_len
        if seq > hf.max_seq_len:
            raise HFConfigError(
                f"model.max_seq_len={seq} but {where} has max_position_embeddings="
                f"{hf.max_seq_len} (it may be at most that)"
            )
        model = replace(hf, init_from=model.init_from, max_seq_len=seq)
        problem = weights_problem(model.init_from, hf_segments(model))
        if problem:
            raise HFConfigError(problem)
        return model
    problem = init_from_problem(model)
    if problem:
        raise HFConfigError(problem)
    return model


# --- the weights, from the safetensors headers ------------------------------------------------


def safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {dtype, shape, data_offsets} of a safetensors file, from its header
    (an 8-byte little-endian length, then that much JSON); ``__metadata__`` left out.
    Raises HFConfigError when the file is not one, or is shorter than its header says."""
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            text = handle.read(length) if 0 < length <= min(MAX_HEADER_BYTES, size - 8) else b""
        header = json.loads(text) if text else None
    except (OSError, ValueError) as exc:
        raise HFConfigError(f"{path}: not a readable safetensors file ({exc})") from exc
    if not isinstance(header, dict):
        raise HFConfigError(f"{path}: not a safetensors file (no JSON header)")
    header.pop("__metadata__", None)
    end = max((_data_end(entry) for entry in header.values()), default=0)
    if end > size - 8 - length:
        raise HFConfigError(
            f"{path}: truncated ({size:,} bytes; its header needs {8 + length + end:,})"
        )
    return header


def _data_end(entry: object) -> int:
    """Where a header entry's data ends (bytes after the header); 0 when it names none."""
    offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
    ok = isinstance(offsets, list) and len(offsets) == 2 and isinstance(offsets[1], int)
    return offsets[1] if ok else 0


def weight_files(directory: str) -> dict[str, str]:
    """HF tensor name -> the file holding it (relative to ``directory``): the index's
    ``weight_map``, or every tensor of the single file."""
    path = Path(directory)
    if not (path / INDEX).is_file():
        return dict.fromkeys(safetensors_header(path / SINGLE), SINGLE)
    try:
        files = json.loads((path / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HFConfigError(f"{path / INDEX}: no readable weight_map ({exc!r})") from exc
    if not isinstance(files, dict):
        raise HFConfigError(f"{path / INDEX}: weight_map is not a JSON object")
    return {str(name): str(file) for name, file in files.items()}


def weights_problem(directory: str, segments: dict[str, list[tuple[str, int]]]) -> str | None:
    """Why the safetensors weights of ``directory`` cannot start the model whose tensors
    ``segments`` (``hf_segments``) names, in one line, or None: a shard the index names
    that is missing or unreadable, a needed tensor no shard holds, or one stored in a
    dtype that is not floating point. Headers only: no tensor data is read (the job
    refuses non-finite values as it loads them, ``train/models/hf_import.py``)."""
    field, folder = f"model.init_from={directory!r}", Path(directory)
    try:
        files = weight_files(directory)
        missing = sorted(f for f in set(files.values()) if not (folder / f).is_file())
        if missing:
            return f"{field}: {INDEX} names {missing[0]!r}, which is not in the directory"
        headers = {f: safetensors_header(folder / f) for f in sorted(set(files.values()))}
    except HFConfigError as exc:
        return f"{field}: {exc}"
    for name in (hf for pieces in segments.values() for hf, _ in pieces):
        if name not in files:
            return f"{field}: no tensor {name!r} in the weights"
        entry = headers[files[name]].get(name)
        if not isinstance(entry, dict):
            return f"{field}: {INDEX} puts {name!r} in {files[name]}, which does not hold it"
        if entry.get("dtype") not in FLOAT_DTYPES:
            return (
                f"{field}: tensor {name!r} in {files[name]} is stored as {entry.get('dtype')};"
                f" valid: a floating-point dtype ({', '.join(FLOAT_DTYPES)})"
            )
    return None
