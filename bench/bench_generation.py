"""Batched greedy generation: ours (``generate_batch``, KV cache) against Hugging Face.

For each tiny Llama (random weights, fp32, built here with transformers and saved with
``save_pretrained``): one process, a batch of 16 prompts of 8..40 tokens, 64 new tokens
each, greedy. Hugging Face runs ``LlamaForCausalLM.generate`` on the batch left-padded
with an attention mask (``do_sample=False``, ``min_new_tokens=max_new_tokens``,
``eos_token_id=None``; its default attention, sdpa); ours runs ``generate_batch`` on our
Llama with the same weights imported by ``load_hf_weights``. The two must produce the
same tokens. The rounds interleave the two (HF then ours, or ours then HF, alternately)
after one warm-up call each; the table shows the medians.

    .venv/bin/python bench/bench_generation.py [--rounds 5] [--threads 1]

Writes bench/results/bench_generation.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from axonn_launch.common.hf import spec_from_hf_config  # noqa: E402
from axonn_launch.common.spec import OverlapConfig  # noqa: E402
from axonn_launch.train.inference.generation import generate_batch  # noqa: E402
from axonn_launch.train.models.hf_import import load_hf_weights  # noqa: E402
from axonn_launch.train.models.registry import build_model  # noqa: E402
from axonn_launch.train.parallel.groups import single_process_groups  # noqa: E402
from tests.hf_fixtures import tiny_llama_dir  # noqa: E402

CPU = torch.device("cpu")
PAD = 0
MODELS = {
    # the fixture's model: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 512
    "tiny": {},
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4),
}  # fmt: skip


def prompts_for(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``batch`` prompts of 8..40 tokens (evenly spread), ids 1..vocab-1 (0 pads)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [8 + round(32 * i / max(1, batch - 1)) for i in range(batch)]
    return [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in lengths]


def hf_inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def measure(name: str, config: dict, args, tmp: Path) -> dict:
    import transformers

    transformers.utils.logging.disable_progress_bar()
    directory = tiny_llama_dir(tmp / name, seed=1, tokenizer=False, eos_token_id=None,
                               max_position_embeddings=128, **config)  # fmt: skip
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = PAD
    spec = spec_from_hf_config(json.loads((directory / "config.json").read_text()), name)
    groups = single_process_groups()
    ours = build_model(spec, groups=groups, overlap=OverlapConfig())
    load_hf_weights(ours, groups, directory)
    ours.eval()
    prompts = prompts_for(args.batch, spec.vocab_size)
    ids, mask = hf_inputs(prompts)
    new = args.new_tokens

    def run_hf() -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                min_new_tokens=new, eos_token_id=None, pad_token_id=PAD,
            )  # fmt: skip
        return out[:, ids.shape[1] :].tolist()

    def run_ours() -> list[list[int]]:
        return generate_batch(ours, prompts, new, device=CPU)

    runs = {"hf": run_hf, "ours": run_ours}
    outputs = {key: fn() for key, fn in runs.items()}  # warm-up, and the outputs compared
    times: dict[str, list[float]] = {"hf": [], "ours": []}
    cpu: dict[str, list[float]] = {"hf": [], "ours": []}
    for r in range(args.rounds):
        order = ["hf", "ours"] if r % 2 == 0 else ["ours", "hf"]
        for key in order:
            started, cpu_started = time.perf_counter(), time.process_time()
            got = runs[key]()
            times[key].append(time.perf_counter() - started)
            cpu[key].append(time.process_time() - cpu_started)
            if got != outputs[key]:
                raise SystemExit(f"{name}: {key} gave different tokens in round {r}")
    rows_equal = sum(a == b for a, b in zip(outputs["hf"], outputs["ours"]))
    tokens_equal = sum(x == y for a, b in zip(outputs["hf"], outputs["ours"]) for x, y in zip(a, b))
    params = sum(p.numel() for p in hf.parameters())
    result = {
        "model": name, "spec": spec, "attn": hf.config._attn_implementation,
        "params": params, "times": times, "cpu": cpu,
        "rows_equal": rows_equal, "tokens_equal": tokens_equal,
        "tokens": len(prompts) * new, "lengths": [len(p) for p in prompts],
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "spec"}), flush=True)
    return result


def row(result: dict) -> str:
    spec, tokens = result["spec"], result["tokens"]
    hf, ours = (statistics.median(result["times"][k]) for k in ("hf", "ours"))
    ratios = [h / o for h, o in zip(result["times"]["hf"], result["times"]["ours"])]
    hf_cpu, ours_cpu = (statistics.median(result["cpu"][k]) for k in ("hf", "ours"))
    n = len(result["lengths"])
    return (
        f"| {result['model']} | {spec.n_layer} | {spec.d_model} | {spec.n_head}/{spec.kv_heads}"
        f" | {spec.vocab_size} | {result['params'] / 1e6:.2f} | {tokens / hf:,.0f} | "
        f"{tokens / ours:,.0f} | {hf / ours:.2f} | {min(ratios):.2f}-{max(ratios):.2f} | "
        f"{tokens / hf_cpu:,.0f} | {tokens / ours_cpu:,.0f} | {hf_cpu / ours_cpu:.2f} | "
        f"{result['rows_equal']}/{n} rows, {result['tokens_equal']}/{tokens} tokens |"
    )


def report(results: list[dict], args, load: tuple[float, float]) -> str:
    import transformers

    lengths = results[0]["lengths"]
    return "\n".join([
        "# Generation throughput: ours against Hugging Face `generate`",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
        "shared with other work while this ran (so absolute rates move between runs; the "
        "ratio is measured side by side); "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"{args.threads} torch thread(s), one process, fp32.",
        f"Command: `.venv/bin/python bench/bench_generation.py --rounds {args.rounds} "
        f"--threads {args.threads}`",
        f"Load average (1 min) at start {load[0]:.1f}, at end {load[1]:.1f}.",
        "",
        f"Random-weight Llamas built here with transformers; a batch of {len(lengths)} "
        f"prompts of {min(lengths)}..{max(lengths)} tokens, {args.new_tokens} new tokens "
        "each, greedy. Hugging Face: `LlamaForCausalLM.generate` on the batch left-padded "
        "with an attention mask (`do_sample=False`, `min_new_tokens=max_new_tokens`, "
        f"`eos_token_id=None`, its default attention: {results[0]['attn']}, its dynamic KV "
        "cache). Ours: "
        "`generate_batch` (left-padded batch, KV cache) on our Llama holding the same "
        "weights (`load_hf_weights`). Tokens/s = new tokens of the batch (prompt "
        f"processing included) / wall seconds of one call, median of {args.rounds} "
        "interleaved rounds after one warm-up call each; ratio = HF seconds / our seconds "
        "(> 1: ours is faster), median and range over the rounds. The same per CPU second "
        "of this process (one torch thread, so CPU time leaves out the waits for a core "
        "on the shared machine and is the steadier comparison). 'same tokens' compares "
        "the greedy continuations of the two.",
        "",
        "| model | layers | hidden | heads/KV | vocab | M params | HF tokens/s | ours "
        "tokens/s | ratio | ratio range | HF tokens/CPU s | ours tokens/CPU s | CPU ratio | "
        "same tokens |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[row(r) for r in results],
        "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "bench_generation.md"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(name, MODELS[name], args, Path(tmp)) for name in args.models]
    text = report(results, args, (load_start, os.getloadavg()[0]))
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
