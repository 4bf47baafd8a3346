"""axonn_launch.common.hf: config.json <-> ModelSpec, the init_from checks and ``model=hf``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from axonn_launch.common.hf import (
    HFConfigError,
    hf_config_from_spec,
    hf_segments,
    init_from_problem,
    resolve_hf_model,
    spec_from_hf_config,
)
from axonn_launch.common.models import ModelSpec
from axonn_launch.config.compose import ConfigError, load

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=128)  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}  # fmt: skip


def _tf():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny saved LlamaForCausalLM (config.json, model.safetensors)."""
    tf = _tf()
    directory = tmp_path_factory.mktemp("tiny_llama")
    tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE, rms_norm_eps=1e-5)).save_pretrained(directory)
    return directory


def _config(hf_dir) -> dict:
    return json.loads((hf_dir / "config.json").read_text())


def test_spec_of_a_saved_llama_config(hf_dir):
    spec = spec_from_hf_config(_config(hf_dir), "tiny")
    assert spec == ModelSpec(
        name="tiny", arch="llama", n_layer=2, d_model=64, n_head=4, n_kv_head=2,
        ffn_hidden=128, vocab_size=512, max_seq_len=128, norm_eps=1e-5, rope_theta=10000.0,
        tie_embeddings=False,
    )  # fmt: skip
    assert spec.head_dim == 16 and spec.kv_heads == 2 and spec.d_ff == 128


@pytest.mark.parametrize(
    "extra",
    [{}, {"tie_word_embeddings": True}, {"rope_theta": 500000.0, "rope_scaling": LLAMA3},
     {"num_key_value_heads": 4, "rms_norm_eps": 1e-6}],
)  # fmt: skip
def test_round_trip_through_transformers(extra, tmp_path):
    tf = _tf()
    spec = spec_from_hf_config(tf.LlamaConfig(**{**SHAPE, **extra}).to_dict(), "t")
    config = hf_config_from_spec(spec)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["torch_dtype"] == "float32"
    assert spec_from_hf_config(tf.LlamaConfig(**config).to_dict(), "t") == spec
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = tf.AutoConfig.from_pretrained(tmp_path)  # as from_pretrained reads it
    assert type(loaded).__name__ == "LlamaConfig"
    assert spec_from_hf_config(loaded.to_dict(), "t") == spec
    if "rope_scaling" in extra:
        assert spec.rope_scaling_factor == 8.0 and spec.rope_original_max_seq_len == 32


def test_transformers_5_rope_parameters_and_legacy_keys_agree():
    legacy = {**SHAPE, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": LLAMA3}
    new = {**SHAPE, "model_type": "llama", "rope_parameters": {**LLAMA3, "rope_theta": 5e5}}
    assert spec_from_hf_config(legacy, "a") == spec_from_hf_config(new, "a")
    old_style = {**legacy, "rope_scaling": {**LLAMA3, "type": "llama3"}}
    del old_style["rope_scaling"]["rope_type"]
    assert spec_from_hf_config(old_style, "a").rope_scaling_factor == 8.0


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"model_type": "mistral"}, "model_type='mistral'; only 'llama'"),
        ({"attention_bias": True}, "attention_bias=True; only false"),
        ({"mlp_bias": True}, "mlp_bias=True; only false"),
        ({"head_dim": 32}, "head_dim=32; only hidden_size / num_attention_heads = 16"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'; only 'silu'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads=3; it must divide"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'; supported"),
        ({"hidden_size": None}, "has no hidden_size"),
        ({"vocab_size": "big"}, "vocab_size='big'; expected a positive integer"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "expected LlamaForCausalLM"),
        ({"pretraining_tp": 2}, "pretraining_tp=2"),
    ],
)
def test_unsupported_configs_are_one_line_errors(change, words):
    config = {**SHAPE, "model_type": "llama", **change}
    with pytest.raises(HFConfigError) as info:
        spec_from_hf_config(config, "t", source="d/config.json")
    message = str(info.value)
    assert words in message and message.startswith("d/config.json has") and "\n" not in message


def test_segments_cover_every_hf_tensor_once(hf_dir):
    from safetensors import safe_open

    spec = spec_from_hf_config(_config(hf_dir), "t")
    segments = hf_segments(spec)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as handle:
        shapes = {k: handle.get_slice(k).get_shape() for k in handle.keys()}  # noqa: SIM118
    named = [name for segs in segments.values() for name, _ in segs]
    assert sorted(named) == sorted(shapes)  # every HF tensor, once
    for segs in segments.values():
        for name, rows in segs:
            assert shapes[name][0] == rows, name
    assert [n for n, _ in segments["blocks.1.attn.kv.weight"]] == [
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    ]
    tied = hf_segments(replace(spec, tie_embeddings=True))
    assert "embedding.lm_head" not in tied and len(tied) == len(segments) - 1


def _preset(hf_dir, **changes) -> ModelSpec:
    spec = spec_from_hf_config(_config(hf_dir), "llama_tiny")
    return replace(spec, **{"init_from": str(hf_dir), **changes})


def test_init_from_problem_names_each_mismatching_field(hf_dir, tmp_path):
    assert init_from_problem(_preset(hf_dir)) is None
    assert init_from_problem(_preset(hf_dir, max_seq_len=64)) is None  # a shorter context
    where = f"{hf_dir}/config.json"
    message = init_from_problem(_preset(hf_dir, n_kv_head=8, d_model=128))
    assert f"model.n_kv_head=8 but {where} has num_key_value_heads=2" in message
    assert f"model.d_model=128 but {where} has hidden_size=64" in message
    assert "\n" not in message and "model=hf" in message
    assert "max_position_embeddings=128 (it may be at most that)" in init_from_problem(
        _preset(hf_dir, max_seq_len=256)
    )
    assert "tie_word_embeddings=False" in init_from_problem(_preset(hf_dir, tie_embeddings=True))
    assert "rms_norm_eps=1e-05" in init_from_problem(_preset(hf_dir, norm_eps=1e-6))
    assert "model.arch='gpt'" in init_from_problem(_preset(hf_dir, arch="gpt"))
    missing = init_from_problem(_preset(hf_dir, init_from=str(tmp_path / "nope")))
    assert missing.startswith("model.init_from=") and "no such directory" in missing
    (tmp_path / "config.json").write_text(json.dumps(_config(hf_dir)))
    assert "has no safetensors weights" in init_from_problem(
        _preset(hf_dir, init_from=str(tmp_path))
    )
    assert init_from_problem(replace(_preset(hf_dir), init_from="")) is None


def test_model_hf_takes_the_shape_from_config_json(hf_dir):
    raw = ModelSpec("hf", 0, 0, 0, 0, 0, arch="llama", init_from=str(hf_dir))  # conf/model/hf.yaml
    model = resolve_hf_model(raw)
    assert model == replace(_preset(hf_dir), name="hf")
    short = resolve_hf_model(replace(raw, max_seq_len=64))
    assert short.max_seq_len == 64 and short.n_layer == 2
    with pytest.raises(HFConfigError, match="max_position_embeddings=128"):
        resolve_hf_model(replace(raw, max_seq_len=4096))
    with pytest.raises(HFConfigError, match=r"model.init_from='': model=hf .* set model.init"):
        resolve_hf_model(replace(raw, init_from=""))
    preset = _preset(hf_dir)
    assert resolve_hf_model(preset) is preset  # a matching preset is kept as it is
    with pytest.raises(HFConfigError, match="model.n_layer=3 but"):
        resolve_hf_model(replace(preset, n_layer=3))
    gpt = load([]).model
    assert resolve_hf_model(gpt) is gpt  # no init_from: nothing to do


def test_the_launcher_config_resolves_model_hf(hf_dir):
    """``config.load`` (the launcher's conversion) calls ``resolve_hf_model``."""
    cfg = load(["model=hf", f"model.init_from={hf_dir}", "model.max_seq_len=64"])
    assert cfg.model == replace(_preset(hf_dir), name="hf", max_seq_len=64)
    with pytest.raises(ConfigError, match="model=hf takes its shape") as info:
        load(["model=hf"])
    assert "\n" not in str(info.value)


def test_the_module_is_login_node_safe():
    code = (
        "import sys, axonn_launch.common.hf; "
        "print(sorted(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_relative_init_from_becomes_absolute(hf_dir, monkeypatch):
    monkeypatch.chdir(hf_dir.parent)
    raw = ModelSpec("hf", 0, 0, 0, 0, 0, arch="llama", init_from=hf_dir.name)
    assert resolve_hf_model(raw).init_from == str(hf_dir)
    preset = replace(_preset(hf_dir), init_from=hf_dir.name)
    assert resolve_hf_model(preset).init_from == str(hf_dir)
