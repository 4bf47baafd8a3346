"""Batched generation with the KV cache equals Hugging Face's ``generate`` and plain
repeated forwards, for padded batches, on one rank and on 4-rank grids whose data × z
planes split the prompts; end-of-sequence stops and seeded sampling give the same
continuations on every grid and batch size."""

from __future__ import annotations

import pytest
import torch

from axonn_launch.common.grid import Grid
from axonn_launch.common.hf import spec_from_hf_config
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.spec import OverlapConfig
from axonn_launch.train.inference.generation import (
    generate,
    generate_batch,
    generate_one,
    pick_tokens,
)
from axonn_launch.train.models.gpt import GPT, load_full_state_dict
from axonn_launch.train.models.registry import build_model
from axonn_launch.train.parallel.groups import build_groups, single_process_groups
from tests.train.dist_utils import run_world
from tests.train.models.test_llama_exact import ours_from_hf, tiny_hf_config

transformers = pytest.importorskip("transformers")

CPU = torch.device("cpu")
NEW = 32
PROMPT_LENGTHS = (5, 9, 1, 12)


@pytest.fixture(scope="module")
def hf_case():
    torch.manual_seed(1)
    config = tiny_hf_config()
    hf = transformers.LlamaForCausalLM(config).float().eval()
    spec = spec_from_hf_config(config.to_dict(), "tiny-llama")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    expected = []
    for prompt in prompts:
        out = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    state = ours_from_hf(spec, {n: p.detach() for n, p in hf.named_parameters()})
    return spec, state, prompts, expected, hf


def _generate_on_rank(rank, world_size, grids, spec, state, prompts):
    """This rank's continuations on each grid of one world."""
    outputs = []
    for grid in grids:
        groups = build_groups(grid, rank=rank)
        model = build_model(spec, groups=groups, overlap=OverlapConfig())
        load_full_state_dict(model, groups, state)
        outputs.append(generate(model, prompts, NEW, batch_size=2, device=CPU))
    return outputs


def test_greedy_equals_hf_generate_on_one_rank(hf_case):
    spec, state, prompts, expected, _ = hf_case
    groups = single_process_groups()
    model = build_model(spec, groups=groups, overlap=OverlapConfig())
    load_full_state_dict(model, groups, state)
    assert generate_batch(model, prompts, NEW, device=CPU) == expected
    assert generate(model, prompts, NEW, batch_size=3, device=CPU) == expected
    assert model.training  # the mode is restored


def test_stops_at_eos_as_transformers_with_and_without_the_cache(hf_case):
    """The 3rd greedy token of the first prompt as end-of-sequence (an int, then in a list
    as Llama 3 gives it): the row equals transformers' generate token for token, ending
    right after it; the cache-less end-of-run sample (generate_one) stops there too, greedy
    and sampled. (Rows of a batch that end at different steps: the tests below.)"""
    spec, state, prompts, expected, hf = hf_case
    groups = single_process_groups()
    model = build_model(spec, groups=groups, overlap=OverlapConfig())
    load_full_state_dict(model, groups, state)
    prompt, eos = prompts[0], expected[0][2]
    cut = expected[0][: expected[0].index(eos) + 1]
    for hf_eos in (eos, [511, eos]):
        ids = [hf_eos] if isinstance(hf_eos, int) else hf_eos
        ours = generate_batch(model, [prompt], NEW, device=CPU, eos_ids=ids)[0]
        theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                             eos_token_id=hf_eos, pad_token_id=0)  # fmt: skip
        assert ours == theirs[0, len(prompt) :].tolist() == cut
    cacheless = generate_one(model, prompt, NEW, max_seq_len=spec.max_seq_len, device=CPU,
                             temperature=0.0, eos_ids=(eos,))  # fmt: skip
    assert cacheless == prompt + cut
    drawn = generate_one(model, prompt, 6, max_seq_len=spec.max_seq_len, device=CPU)
    stop = drawn[len(prompt) + 3]
    stopped = generate_one(model, prompt, 6, max_seq_len=spec.max_seq_len, device=CPU,
                           eos_ids=(stop,))  # fmt: skip
    assert stopped == drawn[: drawn.index(stop, len(prompt)) + 1]


@pytest.mark.slow
def test_greedy_equals_hf_generate_on_4_rank_grids(hf_case):
    spec, state, prompts, expected, _ = hf_case
    grids = [Grid(x=2, y=2), Grid(y=4), Grid(y=2, z=2), Grid(data=2, x=2), Grid(data=2, z=2)]
    per_rank = run_world(_generate_on_rank, 4, grids, spec, state, prompts)
    for outputs in per_rank:
        assert outputs == [expected] * len(grids)


def test_gpt_cache_equals_repeated_forwards_with_padding():
    spec = ModelSpec("g", n_layer=2, d_model=32, n_head=4, vocab_size=64, max_seq_len=40)
    model = GPT(spec, groups=single_process_groups(), overlap=OverlapConfig(), seed=3)
    prompts = [[1, 2, 3], [7], [4, 5, 6, 7, 8, 9]]
    got = generate_batch(model, prompts, 12, device=CPU)
    for prompt, new in zip(prompts, got):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                tokens.append(int(model(torch.tensor([tokens]))[0].argmax()))
        assert new == tokens[len(prompt) :]


def test_eos_ends_a_row_and_sampling_is_seeded():
    spec = ModelSpec("g", n_layer=1, d_model=32, n_head=4, vocab_size=64, max_seq_len=40)
    model = GPT(spec, groups=single_process_groups(), overlap=OverlapConfig(), seed=3)
    greedy = generate_batch(model, [[1, 2]], 10, device=CPU)[0]
    eos = greedy[3]
    cut = generate_batch(model, [[1, 2]], 10, device=CPU, eos_ids=(eos,))[0]
    assert cut == greedy[: greedy.index(eos) + 1]

    def sample(seed: int, batch_size: int = 2) -> list[list[int]]:
        return generate(model, [[5], [6, 7]], 12, batch_size=batch_size, device=CPU,
                        temperature=1.0, top_k=8, seed=seed)  # fmt: skip

    assert sample(1) == sample(1) == sample(1, batch_size=1) != sample(2)


def test_top_k_keeps_only_the_k_most_likely():
    logits = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    generator = torch.Generator().manual_seed(0)
    picks = {int(pick_tokens(logits, 100.0, 2, [generator])) for _ in range(200)}
    assert picks == {1, 3}
    assert int(pick_tokens(logits, 0.0, 0, None)) == 1


def test_too_long_is_refused():
    spec = ModelSpec("g", n_layer=1, d_model=32, n_head=4, vocab_size=64, max_seq_len=8)
    model = GPT(spec, groups=single_process_groups(), overlap=OverlapConfig())
    with pytest.raises(ValueError, match="max_seq_len=8"):
        generate_batch(model, [[1, 2, 3]], 6, device=CPU)


GPT_SPEC = ModelSpec("g", n_layer=2, d_model=32, n_head=4, vocab_size=64, max_seq_len=40)
FIVE_PROMPTS = [[1, 2, 3], [7], [4, 5, 6, 7, 8, 9], [9, 9], [3, 1, 4, 1, 5]]


def _continue(
    groups, eos: tuple[int, ...], temperature: float, batch_size: int = 2
) -> list[list[int]]:
    model = GPT(GPT_SPEC, groups=groups, overlap=OverlapConfig(), seed=3)
    return generate(model, FIVE_PROMPTS, 12, batch_size=batch_size, device=CPU, eos_ids=eos,
                    temperature=temperature, top_k=0, seed=4)  # fmt: skip


def _continue_on_rank(rank, world_size, grids, eos, temperature):
    return [_continue(build_groups(grid, rank=rank), eos, temperature, 1) for grid in grids]


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_planes_split_the_prompts_and_every_grid_gives_one_rank_s_continuations(temperature):
    """5 prompts over 2 or 4 planes, one per batch: planes get unequal shares (a plane
    out of prompts runs a filler row) and rows stop at an end-of-sequence token at
    different steps."""
    greedy = _continue(single_process_groups(), (), temperature)
    eos = (greedy[0][4],)  # some rows end early, others run to 12 tokens
    expected = _continue(single_process_groups(), eos, temperature)
    lengths = {len(row) for row in expected}
    assert len(lengths) > 1 and max(lengths) == 12
    grids = [Grid(data=4), Grid(data=2, z=2), Grid(z=4), Grid(data=2, y=2)]
    for outputs in run_world(_continue_on_rank, 4, grids, eos, temperature):
        assert outputs == [expected] * len(grids)
