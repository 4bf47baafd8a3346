"""Plain typed settings shared by the launcher and the job (no torch, no Hydra).

Hydra composes YAML into these dataclasses once, in ``axonn_launch.config.compose``;
nothing below that boundary sees a DictConfig. A ``JobSpec`` is what travels to the
compute nodes (written as ``spec.json`` in the job directory).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from axonn_launch.common.grid import Grid
from axonn_launch.common.models import ModelSpec
from axonn_launch.common.tracking import MetricsConfig, ProfileConfig


@dataclass(frozen=True)
class OverlapConfig:
    """AxoNN's three communication overlaps (paper section 3.1); each switchable."""

    all_reduce: bool = True  # OAR: async input-grad all-reduce behind the weight-grad GEMM
    reduce_scatter: bool = True  # ORS: deferred weight-grad reduce-scatter over z
    all_gather: bool = True  # OAG: one-layer-ahead weight all-gather prefetch over z


WIRE_DTYPES = ("auto", "fp32", "bf16")


@dataclass(frozen=True)
class WireConfig:
    """The dtype each tensor-parallel collective sends (AxoNN sends bf16, axonn.md §3.1).

    ``auto`` follows the compute dtype: bf16 under bf16 autocast, fp32 otherwise, so
    fp32 runs stay exact. Master weights, gradient accumulation across micro-steps,
    optimizer state and the data-parallel gradient all-reduce stay fp32 whatever these say.
    """

    all_gather: str = "auto"  # weight blocks gathered over z
    reduce_scatter: str = "auto"  # weight-gradient blocks reduce-scattered over z
    all_reduce: str = "auto"  # input-gradient (dX) all-reduces over x and y

    def __post_init__(self) -> None:
        for name in ("all_gather", "reduce_scatter", "all_reduce"):
            value = getattr(self, name)
            if value not in WIRE_DTYPES:
                raise ValueError(
                    f"train.wire.{name}={value!r}: expected one of {', '.join(WIRE_DTYPES)}"
                )

    def resolved(self, computes_in_bf16: bool) -> WireConfig:
        """``auto`` replaced by the compute dtype's name: the one rule job and planner use."""
        auto = "bf16" if computes_in_bf16 else "fp32"
        return WireConfig(*(auto if v == "auto" else v for v in
                            (self.all_gather, self.reduce_scatter, self.all_reduce)))  # fmt: skip


GOLDFISH_STRATEGIES = ("hash-table", "static", "hash-avalanche")


@dataclass(frozen=True)
class GoldfishConfig:
    """The Goldfish loss (axonn.md section 7.2): drop about 1/k of the labels from the
    loss, chosen by a pure function of each label's context in the token stream."""

    k: int = 0  # 0 = off (the standard loss)
    h: int = 4  # context width of the hash strategies (tokens ending at the label)
    strategy: str = "hash-table"  # hash-table | static | hash-avalanche

    def __post_init__(self) -> None:
        if self.strategy not in GOLDFISH_STRATEGIES:
            raise ValueError(
                f"train.goldfish.strategy={self.strategy!r}: expected one of "
                f"{', '.join(GOLDFISH_STRATEGIES)}"
            )


@dataclass(frozen=True)
class WatchdogConfig:
    """Deadlines of a rank's sections (``train/health/watchdog.py``): a section that outlives its
    deadline is a hang; the rank dumps its stacks and the job ends, naming the ranks that
    stopped making progress. ``train.watchdog=off`` is ``enabled=false``."""

    enabled: bool = True
    startup_s: float = 900.0  # init, resume and the first ``startup_steps`` steps
    startup_steps: int = 2
    step_factor: float = 10.0  # a step's deadline: this times the median step so far,
    step_floor_s: float = 120.0  # and never less than this
    # a checkpoint save's deadline: its bytes at this many GB/s per node, times
    # ``checkpoint_factor``, plus ``checkpoint_floor_s``; 0 = the machine profile's
    # ``reliability.write_gbps_per_node`` (the launcher fills it in)
    checkpoint_gbps: float = 0.0
    checkpoint_factor: float = 4.0
    checkpoint_floor_s: float = 120.0
    eval_floor_s: float = 300.0  # each evaluation batch's deadline (at least; a step's if longer)
    beat_s: float = 2.0  # how often a rank's watchdog refreshes its heartbeat file
    # collectives after start-up time out after this times the step deadline (torchtitan
    # lowers its timeout after the first step too); 0 = keep the start-up timeout
    collective_factor: float = 3.0

    def __post_init__(self) -> None:
        for name in ("startup_s", "step_factor", "step_floor_s", "checkpoint_factor",
                     "checkpoint_floor_s", "eval_floor_s", "beat_s"):  # fmt: skip
            _require(f"train.watchdog.{name}", getattr(self, name), "a number > 0", positive=True)
        for name in ("startup_steps", "checkpoint_gbps", "collective_factor"):
            _require(f"train.watchdog.{name}", getattr(self, name), "a number >= 0")
        if 0 < self.collective_factor <= 2:
            raise ValueError(
                f"train.watchdog.collective_factor={self.collective_factor}: use 0 (keep the"
                " start-up timeout) or more than 2, so that the watchdog speaks before a collective"
                " times out (a section where every rank is alive gets two deadlines)"
            )


def _require(field_name: str, value: float, valid: str, positive: bool = False) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or value < 0
        or (positive and value == 0)
    ):
        raise ValueError(f"{field_name}={value!r}: expected {valid}")


@dataclass(frozen=True)
class StragglerConfig:
    """Ranks share their compute time per step every ``every`` steps; a rank whose time is
    ``threshold`` robust deviations above the median, and ``min_ratio`` times it, is named."""

    every: int = 50  # 0 = off
    threshold: float = 6.0  # (t - median) / (1.4826 * MAD), MAD at least 2 % of the median
    min_ratio: float = 2.0

    def __post_init__(self) -> None:
        _require("train.stragglers.every", self.every, "a number of steps >= 0 (0: off)")
        _require("train.stragglers.threshold", self.threshold, "a number > 0", positive=True)
        if not self.min_ratio >= 1:
            raise ValueError(f"train.stragglers.min_ratio={self.min_ratio!r}: expected >= 1")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    global_batch: int = 16  # sequences per optimizer step, whole job
    # sequences per micro-step per data replica (split over z); None = automatic: the
    # launcher picks the largest valid one that fits in memory (rules.py) and the job
    # always gets a number
    micro_batch: int | None = None
    seq_len: int = 64
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    schedule: str = "cosine"  # cosine | constant
    # the step the warmup + cosine start from: 0, or where an extension of a finished run
    # resumed (``jobs resubmit <dir> train.steps=N`` sets it; train/loop.learning_rate)
    schedule_start: int = 0
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    # steps; 0 = only at the end and on a requeue signal; None = auto (``auto`` in the config):
    # the launcher picks Daly's interval (cost/expected_goodput.py) and the job always gets a number
    checkpoint_every: int | None = 0
    keep_checkpoints: int = 2
    data: str = "shakespeare"  # shakespeare | synthetic | path to a uint16/uint32 .bin token file
    activation_checkpointing: bool = False
    overlap: OverlapConfig = field(default_factory=OverlapConfig)
    wire: WireConfig = field(default_factory=WireConfig)
    # transformer blocks (the first N) whose gathered weights are kept from forward to
    # backward, saving the re-gathers for memory (AxoNN's CACHE_LAYERS); None = automatic:
    # the launcher asks the planner (the most blocks that fit, when that is faster)
    cache_layers: int | None = 0
    # ORS: transformer blocks whose weight-grad reduce-scatters may be in flight at once;
    # older ones are waited for, in order. 0 = no bound (every block's until the end)
    ors_window: int = 2
    gemm_tuning: bool = True  # time equivalent GEMM layouts per shape in the first steps
    goldfish: GoldfishConfig = field(default_factory=GoldfishConfig)
    eval_every: int = (
        0  # steps between validation losses; 0 = only at the end when eval_batches > 0
    )
    eval_batches: int = 2  # global batches of the validation data per evaluation; 0 = none
    eval_data: str = ""  # "" = the validation split of train.data; else a source like train.data
    log_every: int = 1
    sample_tokens: int = 0  # >0: print a generated sample of this many tokens at the end
    progress: bool = True  # a bar on a terminal; elsewhere a line every log_every_s
    log_every_s: float = 30.0  # seconds between progress lines when stdout is no terminal
    # CPU threads per rank; 0 = the node's cores shared among its ranks (a Slurm-bound
    # task: its own cores). Jobs that share cores (a local sweep with n_jobs > 1) set it
    # so their thread pools do not oversubscribe the cores.
    threads: int = 0
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    # agree every step on whether the loss and the gradient norm are finite, and stop
    # before an optimizer step that is not (class non_finite)
    check_finite: bool = True
    profile: ProfileConfig = field(default_factory=ProfileConfig)  # a torch.profiler window
    # emulated ranks (train/emulate/): the control path without the model, for scale
    # rehearsals; each host task carries emulate_host_ranks ranks (0: its node's), each
    # step's compute is emulate_step_s of sleep
    emulate: bool = False
    emulate_host_ranks: int = 0
    emulate_step_s: float = 0.2

    def __post_init__(self) -> None:
        start = self.schedule_start
        if start != 0 and not (isinstance(start, int) and 0 < start < self.steps):
            raise ValueError(
                f"train.schedule_start={start!r}: expected a step from 0 to train.steps-1"
                f" ({self.steps - 1})"
            )

    def computes_in_bf16(self, on_gpu: bool) -> bool:
        """train.dtype bf16, or auto on a GPU (auto is fp32 on a CPU)."""
        return self.dtype == "bf16" or (self.dtype == "auto" and on_gpu)

    def accumulation_steps(self, grid: Grid) -> int:
        """Micro-steps per optimizer step; the launcher validates divisibility."""
        if self.micro_batch is None:
            raise ValueError("train.micro_batch is automatic: the launcher resolves it first")
        return self.global_batch // (self.micro_batch * grid.data)


@dataclass(frozen=True)
class GenerateConfig:
    """A generation job (``python -m axonn_launch.generate``) instead of training:
    ``prompts`` set makes the job continue each prompt and write ``out``."""

    prompts: str = ""  # JSONL of {"text": ...} or {"ids": [...]}; "" = a training job
    out: str = ""  # JSONL, one {"prompt_ids", "output_ids", "text"} per prompt, in order
    max_new_tokens: int = 32
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # with temperature > 0: sample among the k most likely; 0 = all
    batch_size: int = 16  # prompts per batch (similar lengths together, output in order)
    checkpoint: str = ""  # a checkpoints/step_N directory to take the weights from
    tokenizer: str = ""  # tokenizer.json or HF dir; "" = model.init_from's, or bytes
    stop_at_eos: bool = True  # end at the HF config's or tokenizer's end-of-sequence id


@dataclass(frozen=True)
class MemorizationConfig:
    """After training, continue documents of ``data`` greedily and score them against the
    truth (``axonn_launch.memorization``; the job writes ``memorization.json``);
    ``data`` "" = off."""

    data: str = ""  # .jsonl of {"ids": [...]} or {"text": ...}, or a token .bin (+ .idx)
    continuation: int = 50  # the last N tokens of each document are the truth
    max_documents: int = 500
    batch_size: int = 32  # prompts per generation batch


@dataclass(frozen=True)
class RuntimeConfig:
    """How the job side finds its rank, device and backend."""

    backend: str = "auto"  # auto (nccl if GPUs else gloo) | gloo | nccl
    device: str = "auto"  # auto | cpu | cuda
    device_index: str = "local_rank"  # local_rank | zero (one visible GPU per task, e.g. Frontier)
    peak_tflops_per_gpu: float = 0.0  # for MFU; 0 = unknown (CPU)
    master_port: int = 29500
    preflight: bool = False  # check GEMM speed, bandwidth and network plugin before training


@dataclass(frozen=True)
class JobSpec:
    name: str
    job_dir: str
    model: ModelSpec
    grid: Grid
    train: TrainConfig
    runtime: RuntimeConfig
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    memorization: MemorizationConfig = field(default_factory=MemorizationConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # common/tracking.py

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        raw = json.loads(text)
        train = dict(raw["train"])
        train["overlap"] = OverlapConfig(**train["overlap"])
        train["wire"] = WireConfig(**train.get("wire", {}))
        train["goldfish"] = GoldfishConfig(**train.get("goldfish", {}))
        train["watchdog"] = WatchdogConfig(**train.get("watchdog", {}))
        train["stragglers"] = StragglerConfig(**train.get("stragglers", {}))
        train["profile"] = ProfileConfig(**train.get("profile", {}))
        return cls(
            name=raw["name"],
            job_dir=raw["job_dir"],
            model=ModelSpec(**raw["model"]),
            grid=Grid(**raw["grid"]),
            train=TrainConfig(**train),
            runtime=RuntimeConfig(**raw["runtime"]),
            generate=GenerateConfig(**raw.get("generate", {})),
            memorization=MemorizationConfig(**raw.get("memorization", {})),
            metrics=MetricsConfig.from_dict(raw.get("metrics", {})),
        )

    def save(self, path: Path) -> None:
        path.write_text(self.to_json())

    @classmethod
    def load(cls, path: Path) -> JobSpec:
        return cls.from_json(Path(path).read_text())
