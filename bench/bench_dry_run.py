"""Login-node latency: a full dry run for Frontier/gpt_320b against `import torch`.

Both commands run alternately in one process tree, so machine noise hits both alike;
the ratio of medians is what we report. Target: at most 0.4.

    python bench/bench_dry_run.py [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "bench_dry_run.md"


def timed(cmd: list[str], cwd: str) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        dry = [
            sys.executable,
            "-m",
            "axonn_launch",
            "machine=frontier",
            "model=gpt_320b",
            "dry_run=true",
            f"hydra.run.dir={tmp}/job",
        ]
        torch = [sys.executable, "-c", "import torch"]
        timed(dry, tmp), timed(torch, tmp)  # warm the file cache
        dry_s, torch_s = [], []
        for _ in range(args.repeats):
            dry_s.append(timed(dry, tmp))
            torch_s.append(timed(torch, tmp))
    d, t = statistics.median(dry_s), statistics.median(torch_s)
    text = "\n".join(
        [
            "## Login-node dry run vs `import torch`",
            "",
            "Command: `python bench/bench_dry_run.py --repeats "
            f"{args.repeats}` (medians of alternating runs, wall clock)",
            "",
            "| command | median s | min s | max s |",
            "|---|---|---|---|",
            f"| `python -m axonn_launch machine=frontier model=gpt_320b dry_run=true` | {d:.3f} |"
            f" {min(dry_s):.3f} | {max(dry_s):.3f} |",
            f'| `python -c "import torch"` | {t:.3f} | {min(torch_s):.3f} | {max(torch_s):.3f} |',
            "",
            f"Ratio dry run / import torch: **{d / t:.2f}** (target <= 0.4)",
            "",
        ]
    )
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
