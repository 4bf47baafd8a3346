"""Memorization measured in the training job, with the trained model still in memory.

With ``memorization.data`` set, after the last step every rank reads the documents
(``axonn_launch.memorization.read_documents``), cuts each to the model's context and
splits it into prompt and truth (the last ``memorization.continuation`` tokens), the
prompts are continued greedily with ``generation.generate`` on the job's grid, and
rank 0 scores them (exact match, token match, ROUGE-L) and writes
``<job_dir>/memorization.json`` in the format ``python -m axonn_launch.memorization``
writes. The job's summary gets the three means.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from axonn_launch.common import memorization_metric as memo
from axonn_launch.common.jobdir import JobPaths
from axonn_launch.common.spec import JobSpec
from axonn_launch.train.inference.generation import generate
from axonn_launch.train.models.optim import compute_dtype

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("exact_match_rate", "token_match", "rouge_l")


def data_repetitions(data: str) -> int | None:
    """The repetition count the study's data declares (``<file>.bin.json``), if any."""
    sidecar = Path(data).with_name(Path(data).name + ".json")
    if not data.endswith(".bin") or not sidecar.is_file():
        return None
    value = json.loads(sidecar.read_text()).get("repetitions")
    return int(value) if isinstance(value, int) else None


def run_memorization(spec: JobSpec, model, device: torch.device, rank: int) -> dict:
    """Generate, score and (rank 0) write ``memorization.json``; returns the summary keys."""
    cfg = spec.memorization
    job_dir = Path(spec.job_dir)
    tokenizer = memo.load_tokenizer(job_dir)  # bytes for byte-level models (spec.json)
    settings = memo.Settings(
        source=str(job_dir),
        data=cfg.data,
        out=str(JobPaths(job_dir).memorization),
        continuation=cfg.continuation,
        max_documents=cfg.max_documents,
        max_length=min(memo.DEFAULT_MAX_LENGTH, spec.model.max_seq_len),
    )
    prompts, skipped = memo.build_prompts(
        memo.read_documents(
            Path(cfg.data), tokenizer, chunk=settings.max_length, model_vocab=spec.model.vocab_size
        ),
        settings,
    )
    started = time.perf_counter()
    new = generate(
        model, [p["ids"] for p in prompts], cfg.continuation, batch_size=cfg.batch_size,
        device=device, dtype=compute_dtype(spec.train, device),
    )  # fmt: skip
    outputs = [{"output_ids": tokens} for tokens in new]
    seconds = time.perf_counter() - started
    result = {"source": str(job_dir), "data": cfg.data, "continuation": cfg.continuation}
    repetitions = data_repetitions(spec.train.data)
    if repetitions is not None:
        result["repetitions"] = repetitions
    result |= memo.evaluate(prompts, outputs, tokenizer, skipped)
    result["seconds"] = seconds
    if rank == 0:
        memo.write_json(Path(settings.out), result)
        log.info(
            "memorization of %s: %d documents, exact match %.3f, token match %.3f,"
            " ROUGE-L %.3f (%.1f s)",
            cfg.data, result["n_documents"], result["exact_match_rate"] or 0.0,
            result["token_match"] or 0.0, result["rouge_l"] or 0.0, seconds,
        )  # fmt: skip
    return {key: result[key] for key in SUMMARY_KEYS} | {
        "memorization_documents": result["n_documents"]
    }
