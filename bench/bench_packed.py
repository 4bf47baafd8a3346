"""What keeping packed fine-tuning examples apart costs: one training micro-step (forward
and backward) of our Llama on rows that pack several examples, with the example mask
(``examples=``: attention within each example, positions from its first token; SDPA with
a boolean mask) against the same rows as one causal context (SDPA's ``is_causal``, what
packed rows got before). One process, fp32, on this machine's CPU; each round is a pair
that runs both, the order alternating (``bench/pairs.py``), after one warm-up each; the
table shows the medians and the pairs' examples/causal - 1 as median and IQR, with the
load average before and after.

    .venv/bin/python bench/bench_packed.py [--rounds 11] [--threads 2]

Writes bench/results/bench_packed.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from axonn_launch.common.models import ModelSpec  # noqa: E402
from axonn_launch.common.spec import OverlapConfig  # noqa: E402
from axonn_launch.train.models.registry import build_model  # noqa: E402
from axonn_launch.train.parallel.groups import single_process_groups  # noqa: E402
from bench import pairs as paired  # noqa: E402

SPEC = ModelSpec("llama-bench", n_layer=4, d_model=256, n_head=8, vocab_size=4096,
                 max_seq_len=1024, arch="llama", n_kv_head=4, ffn_hidden=688,
                 tie_embeddings=False)  # fmt: skip
CASES = [(512, 4, 4), (1024, 2, 8)]  # (sequence length, rows, examples per row)


def examples_of(rows: int, seq: int, per_row: int) -> torch.Tensor:
    """Each row split into ``per_row`` examples of equal length."""
    return (torch.arange(seq) * per_row // seq).expand(rows, seq).contiguous()


def step_seconds(model, inputs, targets, examples) -> float:
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    model(inputs, targets, examples=examples).backward()
    return time.perf_counter() - started


def measure(rounds: int) -> list[dict]:
    model = build_model(SPEC, groups=single_process_groups(), overlap=OverlapConfig(), seed=1)
    results = []
    for seq, rows, per_row in CASES:
        generator = torch.Generator().manual_seed(seq)
        tokens = torch.randint(0, SPEC.vocab_size, (rows, seq + 1), generator=generator)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        examples = examples_of(rows, seq, per_row)
        variants = {"causal": None, "examples": examples}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for ex in variants.values():  # warm-up
            step_seconds(model, inputs, targets, ex)
        for r in range(rounds):
            order = list(variants) if r % 2 == 0 else list(variants)[::-1]
            for name in order:
                times[name].append(step_seconds(model, inputs, targets, variants[name]))
        causal, masked = (statistics.median(times[n]) for n in ("causal", "examples"))
        overheads = [m / c - 1 for m, c in zip(times["examples"], times["causal"], strict=True)]
        results.append(dict(seq=seq, rows=rows, per_row=per_row, causal=causal, masked=masked,
                            overheads=overheads, mask_mib=rows * seq * seq / 2**20))  # fmt: skip
    return results


def write(results: list[dict], args: argparse.Namespace, loads: str) -> str:
    lines = [
        "## Packed fine-tuning examples: the cost of the example mask",
        "",
        f"Script: bench/bench_packed.py (`.venv/bin/python bench/bench_packed.py --rounds"
        f" {args.rounds} --threads {args.threads}`)",
        "",
        f"Machine: {platform.processor() or platform.machine()},"
        f" torch {torch.__version__}, {args.threads} threads. One forward+backward of a"
        f" {SPEC.n_layer}-layer Llama (hidden {SPEC.d_model}, {SPEC.n_head} heads,"
        f" {SPEC.n_kv_head} KV heads, vocab {SPEC.vocab_size}), fp32, one process; medians of"
        f" {args.rounds} interleaved pairs, the order alternating; {loads}."
        " *causal*: the rows as one causal context (SDPA"
        " `is_causal`); *examples*: attention kept within each packed example (SDPA with a"
        " boolean `[rows, 1, s, s]` mask) and positions from each example's first token.",
        "",
        "| seq | rows | examples per row | causal (s) | examples (s) | examples / causal - 1 "
        "| mask (MiB) |",
        "|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['seq']} | {r['rows']} | {r['per_row']} | {r['causal']:.3f} |"
            f" {r['masked']:.3f} | {paired.verdict(r['overheads'])} | {r['mask_mib']:.1f} |"
        )
    lines += [
        "",
        "Only micro-batches whose rows hold more than one example take the masked path;"
        " unpacked data and rows of one example keep `is_causal`. On GPUs the masked path"
        " leaves the flash kernel for the memory-efficient one; it has not been measured"
        " there (no GPU machine was available).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    before = paired.load_now()
    results = measure(args.rounds)
    text = write(results, args, paired.load_line(before, paired.load_now()))
    (REPO / "bench" / "results" / "bench_packed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
