"""Typed configuration of a training run.

The command line (``sparknet train``), the Spark trainer and the Spark ML ``Params`` all map
onto these dataclasses instead of restating them. Each checks itself in ``__post_init__``;
the docstring under each field is its ``--help`` text.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from sparknet._enums import CompressionKind, DataMode, Monitor, Task, parse_enum
from sparknet._fields import changed, flag
from sparknet.faults import faults_from
from sparknet.link import LinkModel
from sparknet.solvers import LRPolicy, SolverConfig, SolverType

__all__ = ["Engine", "Strategy", "CompressionKind", "Precision", "Compute", "WorkerConfig", "RunConfig",
           "DistributedConfig", "EngineOptions", "CaffeTrainFlags", "TrainConfig", "parse_enum",
           "parse_plan", "column_names"]


class Engine(str, enum.Enum):
    """Where training runs."""

    LOCAL = "local"
    """One process, no Spark."""
    ROUNDS = "rounds"
    """SparkNet's scheme: one Spark job per round, weights out by broadcast, back by aggregation."""
    BARRIER = "barrier"
    """One barrier stage whose tasks form a gloo process group and average by allreduce."""


class Strategy(str, enum.Enum):
    """How workers combine what they learn."""

    AVERAGE = "average"
    """SparkNet: tau local steps (or T seconds), then a sample-weighted average."""
    SYNC = "sync"
    """Gradients allreduced every step (large-batch SGD); barrier engine only."""
    DILOCO = "diloco"
    """Averaged parameter change as the gradient of a Nesterov outer step."""
    EASGD = "easgd"
    """Elastic averaging with a center variable."""
    ASYNC = "async"
    """Asynchronous pushes and pulls through a parameter server on the driver."""


def model_name(name: str) -> str:
    """A zoo model's name as the zoo spells it (``char-lstm`` is ``char_lstm``)."""
    return str(name).strip().lower().replace("-", "_")


ZOO_MODELS = ("lenet", "mlp", "cifar_cnn", "alexnet", "char_lstm", "gpt_char")
"""The zoo's models by name, in :data:`sparknet.zoo.MODELS`'s order (which maps each to its function; a test holds
the two alike): ``--model`` checks its value against them before torch, which the zoo needs, is loaded."""

DATASETS = ("mnist", "mnist-small", "extended-mnist", "shakespeare", "synthetic", "synthetic-sequences",
            "imagenet-synthetic")
"""The data sets ``--dataset`` takes, as :data:`sparknet.datasets.DATASET_NAMES` lists them (a test holds the two
alike), read without loading the data sets' modules."""


def model_names() -> list[str]:
    """The zoo's model names, sorted."""
    return sorted(ZOO_MODELS)


def dataset_name(name: str) -> str:
    """A data set's name as :func:`sparknet.datasets.load_dataset` lists it (``mnist_small`` is ``mnist-small``)."""
    return str(name).strip().lower().replace("_", "-")


def dataset_names() -> list[str]:
    """The data sets ``--dataset`` takes."""
    return list(DATASETS)


def check_device(device: str) -> None:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto``; a clear ``ValueError`` otherwise."""
    if device not in ("cpu", "cuda", "auto") and not str(device).startswith("cuda:"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")


EVAL_EVERY_STEPS = 1000
"""One process's steps between evaluations when no target asks for more (``RunConfig.eval_every``)."""


def check_at_least(low: int, **values) -> None:
    """A ``ValueError`` naming the first of ``values`` (name=value; ``None``: not given) below ``low``."""
    for name, value in values.items():
        if value is not None and value < low:
            raise ValueError(f"{name} must be at least {low}, got {value}")


def check_outer_step(outer_lr: float, outer_momentum: float) -> None:
    """DiLoCo's outer step (:class:`~sparknet.strategies.DiLoCo`): a positive rate, a momentum in [0, 1)."""
    if not outer_lr > 0:
        raise ValueError(f"outer_lr must be positive, got {outer_lr}")
    if not 0 <= outer_momentum < 1:
        raise ValueError(f"outer_momentum must be in [0, 1), got {outer_momentum}")


def check_gpu_share(gpus: float | None) -> None:
    """A worker's GPU share as Spark takes one: a whole number, or a fraction 1/n of one GPU (n workers share it).

    Raises
    ------
    ValueError
        For zero, a negative or non-finite number, or a fraction Spark cannot split a GPU into.
    """
    if gpus is None:
        return
    if not (math.isfinite(gpus) and gpus > 0):
        raise ValueError(f"gpus_per_worker must be a positive number, got {gpus}")
    if gpus >= 1 and gpus != int(gpus):
        raise ValueError(f"gpus_per_worker above 1 must be a whole number of GPUs, got {gpus}")
    if gpus < 1 and not math.isclose(1 / gpus, round(1 / gpus), rel_tol=1e-9):
        raise ValueError(f"gpus_per_worker below 1 shares one GPU among n workers and must be 1/n (0.5, 0.25, ...), "
                         f"got {gpus}")


def check_per_step_strategy(dist: DistributedConfig, what: str, *, on_spark: bool = False) -> None:
    """The rules of a strategy that allreduces gradients every step (``sync``), checked for every caller.

    ``what`` names the strategy in the error; ``on_spark``: it trains on Spark whatever the number of
    workers (one worker alone trains in one process, where sync is plain training). It needs the barrier
    engine (a process group), the
    same number of steps on every worker (a fixed tau, no time budget), and it exchanges full
    gradients, so neither compression nor automatic tau applies to it.
    """
    if dist.engine is Engine.ROUNDS and (dist.workers > 1 or on_spark):
        raise ValueError(f"{what} allreduces gradients every step and needs --engine barrier")
    if dist.compression is not CompressionKind.NONE:
        raise ValueError(f"{what} allreduces full gradients every step; compression applies to the updates of "
                         "average, diloco and easgd: drop --compression or choose another strategy")
    if dist.auto_tau:
        raise ValueError(f"{what} allreduces full gradients every step whatever tau is (tau only spaces its metric "
                         "rounds); drop --auto-tau or choose another strategy")
    if dist.round_seconds is not None:
        raise ValueError(f"{what} allreduces gradients every step and needs a fixed tau, not --round-seconds "
                         "(workers would run different numbers of steps)")


class Precision(str, enum.Enum):
    """The arithmetic of a net's forward pass."""

    FLOAT32 = "float32"
    """Everything in float32 (seeded runs are bit-identical)."""
    BF16 = "bf16"
    """torch.autocast to bfloat16: matrix products and convolutions in bfloat16, the weights, their gradients
    and the solver in float32."""


@dataclass(frozen=True)
class Compute:
    """How a net computes on its device, beside what it computes: the GPU-speed options of a worker
    (:class:`~sparknet.net.Net` applies them).

    The default is plain float32 eager PyTorch, bit-identical to a net built without it.
    """

    precision: Precision = Precision.FLOAT32
    """float32, or bf16 (autocast)."""
    compile: bool = False
    """torch.compile the net's forward pass and loss (the first steps pay for the compilation)."""
    channels_last: bool = False
    """Keep 4-d weights and input batches in channels-last memory order (what GPU convolutions run fastest on)."""

    def __post_init__(self):
        object.__setattr__(self, "precision", parse_enum(Precision, self.precision, "precision"))


@dataclass(frozen=True)
class Profile:
    """Which of a worker's rounds torch's profiler traces, and where the traces go (``--profile-dir``): each worker
    writes ``<name>-round<R>.json``, a Chrome trace of its local work in that round (its steps, its update taken and
    compressed; TensorBoard's profiler, Perfetto and ``chrome://tracing`` read it), and ``<name>-round<R>.txt``, its
    ops by their own CPU time. ``name`` is ``worker-<i>`` (``rank-<r>`` for the barrier engine's processes). The
    parameter server's workers trace an epoch (their steps, pulls and pushes): ``ps-worker-<i>-epoch<E>``."""

    folder: str
    """A folder every worker can write: a path (on each worker's host), or a URI (``s3a://``, ``hdfs://``...)."""
    round: int = 1
    """The round traced (the parameter server's: the epoch), counted from 0 over the fit (default the second: the
    first pays for warming up)."""

    def __post_init__(self):
        if not str(self.folder).strip():
            raise ValueError("--profile-dir names a folder for the traces, got an empty name")
        check_at_least(0, profile_round=self.round)


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    """What every worker does on its own: its update rule, minibatch, seed, threads and device, and how many
    local steps it makes at most. :class:`~sparknet.spark.SparkTrainer` and the parameter server's session take
    it; :meth:`RunConfig.worker` is what ``sparknet train`` gives them."""

    solver: SolverConfig = field(default_factory=SolverConfig)
    """Each worker's local update rule."""
    batch_size: int = 64
    """Minibatch size of every worker."""
    seed: int = 0
    """Seeds the initial weights, every worker's data order and the warm-up."""
    threads: int = 1
    """Torch threads per worker."""
    device: str = "cpu"
    """cpu, cuda, cuda:N or auto (a task uses the GPU Spark assigned it, else the CPU, saying why)."""
    steps: int | None = None
    """Local steps per worker in all (a stopping rule beside the rounds, epochs and target accuracy of
    :class:`DistributedConfig`; the first one reached stops training). Warm-up steps are not counted."""
    gpus_per_worker: float | None = None
    """GPUs each worker asks Spark for, on the training stage only (1/n: n workers share one GPU)."""
    compute: Compute = field(default_factory=Compute)
    """Mixed precision, compilation and memory order of every worker's net."""
    profile: Profile | None = None
    """Trace one round of every worker with torch's profiler (:class:`Profile`)."""

    def __post_init__(self):
        check_at_least(1, batch_size=self.batch_size, threads=self.threads, steps=self.steps)
        check_device(self.device)
        check_gpu_share(self.gpus_per_worker)


_CLI_TASKS = ("classification", "regression", "multilabel")
"""What ``sparknet train --task`` learns (a net without labels is a library's or a Caffe file's)."""


@dataclass(kw_only=True)
class RunConfig:
    """What to train, on what, for how long (one process or many)."""

    model: str = field(default="lenet", metadata={"choices": model_names, "type": model_name})
    """Model zoo name."""
    dataset: str = field(default="mnist", metadata={"choices": dataset_names, "type": dataset_name})
    """Data set name (downloaded once and cached; --data trains on a Parquet table instead)."""
    data: str | None = None
    """Parquet file or folder with 'features' and 'label' columns (overrides --dataset): a path is read on the
    driver; a URI (file://, s3a://, hdfs://, gs://, abfs://...) Spark's workers read where it lives (one process
    reads it with pyarrow)."""
    validation_data: str | None = None
    """Parquet of held-out rows to evaluate on, with --data's columns (default: --data's last tenth of rows; of a
    --data URI on Spark, a seeded sample of a tenth of its rows, at most 10,000)."""
    features_col: str = "features"
    """--data's feature column: an array of numbers or an ML vector; or several columns (numbers, arrays or
    vectors), comma-separated, joined in that order into one array."""
    label_col: str = "label"
    """--data's label column; with --task regression or multilabel, several number columns, comma-separated, joined
    in that order into one array a row."""
    weight_col: str | None = None
    """--data's column of sample weights (numbers >= 0): a row of weight w counts w times in its batch's loss (0: not
    at all); the test scores stay unweighted."""
    task: Task = field(default=Task.CLASSIFICATION, metadata={"choices": lambda: _CLI_TASKS})
    """What a --data table's label column holds: class ids (classification), numbers or a list of them to predict
    (regression: the mlp's last layer as wide as a label, a Euclidean loss, scored by R-squared, the score
    --target-accuracy sets), or a 0 or 1 for each output (multilabel: a sigmoid cross-entropy loss, scored by the
    accuracy over every label)."""
    steps: int = 10000
    """Solver updates in all (per worker when training in parallel)."""
    batch_size: int = 64
    """Minibatch size of each worker."""
    solver_type: SolverType = SolverType.SGD
    """Update rule."""
    lr: float = 0.01
    """Base learning rate."""
    momentum: float = 0.9
    """Momentum (Adam's beta1)."""
    momentum2: float = 0.999
    """Adam's and AdamW's beta2."""
    weight_decay: float = 5e-4
    """L2 weight decay."""
    lr_policy: LRPolicy = LRPolicy.INV
    """Learning-rate policy (Caffe's names, plus cosine)."""
    gamma: float = 1e-4
    """Policy factor (Caffe's LeNet solver: inv with gamma 1e-4, power 0.75)."""
    power: float = 0.75
    """Policy exponent."""
    lr_warmup: int = 0
    """Steps over which the learning rate rises linearly to the policy's (0: none)."""
    min_lr: float = 0.0
    """The cosine policy's floor: the rate falls from --lr to this over --steps."""
    clip_gradients: float = -1.0
    """Clip the gradient's global L2 norm to this, where positive (as Caffe's clip_gradients)."""
    seed: int = 0
    """Seed of the weights and of the data order."""
    threads: int | None = None
    """Torch threads per process (default: all cores in one process, 1 per Spark worker)."""
    device: str = "cpu"
    """cpu, cuda or auto."""
    gpus_per_worker: float | None = None
    """GPUs each Spark worker asks for, on the training stage only, through a stage-level resource profile
    (0.5: two workers share one GPU; a worker of G processes asks for 1/G of it for each); the stages that read the
    data ask for none."""
    precision: Precision = Precision.FLOAT32
    """float32, or bf16 (autocast: products and convolutions in bfloat16, weights and solver in float32)."""
    compile: bool = False
    """torch.compile each worker's net (the first steps pay for the compilation)."""
    channels_last: bool = False
    """Keep convolution weights and image batches in channels-last memory order (faster on GPUs)."""
    eval_every: int | None = None
    """Steps between evaluations on the test set (in one process; rounded up to whole rounds of --tau steps). By
    default every round toward --target-accuracy or --target-loss (within --eval-budget, as on Spark), else 1,000."""
    metrics_out: str | None = None
    """JSON-lines metrics file."""
    quiet: bool = False
    """No progress line and no log lines but errors; the final JSON result line is still printed."""
    model_dir: str | None = None
    """Save the trained model folder here (what predict, export and sample read with --model-dir)."""
    tensorboard: str | None = None
    """Also write TensorBoard event files to this folder."""
    mlflow: str | None = None
    """Also log to MLflow at this tracking URI or path ('': the run active in the program, else ./mlflow.db)."""
    profile_dir: str | None = None
    """Trace one round of every worker with torch's profiler into this folder (a path on each worker's host, or a
    URI): <worker>-round<R>.json, a Chrome trace (TensorBoard, Perfetto), and <worker>-round<R>.txt, its ops by
    their own CPU time (with --strategy async, ps-worker-<i>-epoch<E>: an epoch of each worker)."""
    profile_round: int = 1
    """The round --profile-dir traces, counted from 0 (default the second: the first pays for warming up; with
    --strategy async, the epoch)."""

    def __post_init__(self):
        self.solver_type = SolverType.parse(self.solver_type)
        self.lr_policy = LRPolicy.parse(self.lr_policy)
        self.precision = parse_enum(Precision, self.precision, "precision")
        if str(getattr(self.task, "value", self.task)).lower() not in _CLI_TASKS:
            raise ValueError(f"task must be one of {', '.join(_CLI_TASKS)}, got {self.task!r}")
        self.task = parse_enum(Task, self.task, "task")
        check_gpu_share(self.gpus_per_worker)
        check_at_least(1, steps=self.steps)
        if self.task is not Task.CLASSIFICATION:
            if self.data is None:
                raise ValueError(f"--task {self.task.value} learns the labels of a --data table; the data sets "
                                 "hold classes")
            if model_name(self.model) != "mlp":
                raise ValueError(f"--task {self.task.value} trains --model mlp (its last layer as wide as a label); "
                                 f"{self.model} is a classifier")
        if self.data is None and ((self.features_col, self.label_col) != ("features", "label")
                                  or self.weight_col is not None):
            raise ValueError("--features-col, --label-col and --weight-col name the columns of a --data table: give "
                             "--data too")
        columns, labels = self.feature_columns, self.label_columns
        if not all(columns) or not all(labels) or (self.weight_col is not None and not self.weight_col.strip()):
            raise ValueError(f"--features-col, --label-col and --weight-col name columns, got {self.features_col!r}, "
                             f"{self.label_col!r} and {self.weight_col!r}")
        if len(labels) > 1 and not self.task.float_labels:
            raise ValueError(f"--label-col {self.label_col} names several columns: the numbers of --task regression "
                             "or the 0s and 1s of --task multilabel, joined into one array a row; class ids are one "
                             "column")
        named = [*columns, *labels, *([self.weight_col] if self.weight_col is not None else [])]
        if len(set(named)) != len(named):
            raise ValueError(f"--features-col {self.features_col}, --label-col {self.label_col} and --weight-col "
                             f"{self.weight_col} name a column twice; each column is a feature, the label or the "
                             "weight")
        if self.validation_data is not None and self.data is None:
            raise ValueError("--validation-data holds the held-out rows of a --data table: give --data too")
        if self.batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {self.batch_size}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"learning rate must be a positive number, got {self.lr}")
        check_at_least(1, threads=self.threads, eval_every=self.eval_every)
        check_device(self.device)
        self.model = model_name(self.model)
        if self.model not in model_names():
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(model_names())}")
        self.dataset = dataset_name(self.dataset)
        if self.data is None and self.dataset not in dataset_names():
            raise ValueError(f"unknown data set {self.dataset!r}; choose one of {', '.join(dataset_names())}, or "
                             "train on a Parquet table with --data")
        if self.profile_round != 1 and self.profile_dir is None:
            raise ValueError("--profile-round says which round --profile-dir traces: give --profile-dir too")
        self.worker()  # the solver's own checks (--min-lr with --lr-policy cosine...) and the profile's, up front

    @property
    def feature_columns(self) -> tuple[str, ...]:
        """The feature columns --features-col names, in order."""
        return column_names(self.features_col)

    @property
    def label_columns(self) -> tuple[str, ...]:
        """The label columns --label-col names, in order (several: one array of numbers a row)."""
        return column_names(self.label_col)

    def solver(self) -> SolverConfig:
        """The solver these settings describe."""
        return SolverConfig(type=self.solver_type, base_lr=self.lr, momentum=self.momentum,
                            weight_decay=self.weight_decay, lr_policy=self.lr_policy, gamma=self.gamma,
                            power=self.power, max_iter=self.steps, lr_warmup=self.lr_warmup, min_lr=self.min_lr,
                            momentum2=self.momentum2, clip_gradients=self.clip_gradients)

    def worker(self) -> WorkerConfig:
        """What each worker does under these settings (one thread per worker unless --threads says)."""
        return WorkerConfig(solver=self.solver(), batch_size=self.batch_size, seed=self.seed,
                            threads=self.threads or 1, device=self.device, steps=self.steps,
                            gpus_per_worker=self.gpus_per_worker,
                            compute=Compute(self.precision, self.compile, self.channels_last),
                            profile=None if self.profile_dir is None else Profile(self.profile_dir,
                                                                                  self.profile_round))


def column_names(text: str) -> tuple[str, ...]:
    """The columns a flag such as ``--features-col a,b,c`` names, in order."""
    return tuple(name.strip() for name in text.split(","))


@dataclass(frozen=True)
class Streaming:
    """How an exchange may run late or in parts (``--overlap``, ``--fragments``).

    - ``overlap``: round r's exchange runs behind round r+1's local steps. Each worker goes on from
      its own weights; when round r's average arrives (at the end of round r+1) the worker's
      weights become the new global weights plus its own progress since it sent round r's update.
      The outer step so comes one round late; the first round applies nothing, and the last one
      waits for the update in flight and its own (the run returns every worker's work).
    - ``fragments``: the flat weights are cut into F contiguous parts and round r exchanges part
      r mod F only, so each exchange moves 1/F of the model; between its exchanges a part keeps
      training on every worker. The last round exchanges whatever is left of every part.

    Both as in streaming DiLoCo (Douillard et al. 2025): each worker's side is a :class:`WorkerStream`.
    """

    overlap: bool = False
    fragments: int = 1

    def __post_init__(self):
        if self.fragments < 1:
            raise ValueError(f"fragments must be at least 1, got {self.fragments}")

    def part(self, round_index: int, numel: int, last: bool = False) -> slice:
        """The weights round ``round_index`` (counted from 0) exchanges: the last round's, every one."""
        if last or self.fragments == 1:
            return slice(0, numel)
        f = round_index % self.fragments
        return slice(f * numel // self.fragments, (f + 1) * numel // self.fragments)


def parse_plan(text: str) -> dict[str, str | None]:
    """``"ip1=column,ip2=row,ip3=none"`` -> ``{"ip1": "column", "ip2": "row", "ip3": None}``."""
    plan: dict[str, str | None] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, mode = item.partition("=")
        mode = mode.strip().lower()
        if not sep or not name.strip() or mode not in ("column", "row", "none"):
            raise ValueError(f"--parallel-plan: {item!r} is not LAYER=column, LAYER=row or LAYER=none "
                             "(e.g. --parallel-plan ip1=column,ip2=row)")
        plan[name.strip()] = None if mode == "none" else mode
    if not plan:
        raise ValueError("--parallel-plan is empty; give LAYER=column|row|none pairs separated by commas")
    return plan


@dataclass(kw_only=True)
class DistributedConfig:
    """How training is spread over Spark workers."""

    workers: int = 1
    """Number of workers K (1 trains in one process without Spark)."""
    engine: Engine = Engine.ROUNDS
    """rounds or barrier (local when workers is 1)."""
    strategy: Strategy = Strategy.AVERAGE
    """How workers combine their work."""
    tau: int | None = 50
    """Local steps per round."""
    round_seconds: float | None = None
    """Seconds per round; a round ends after tau steps or this, whichever comes first."""
    warmup_steps: int = 0
    """Steps run on the driver before going parallel."""
    rounds: int | None = None
    """Stop after this many rounds (default: when --steps are used up)."""
    epochs: float | None = None
    """Stop after this many passes over the training data."""
    target_accuracy: float | None = None
    """Stop as soon as test accuracy reaches this."""
    target_loss: float | None = None
    """Stop as soon as the loss on the whole test set is at most this (a language model's target, e.g. 1.5)."""
    patience: int | None = None
    """Early stopping: stop once this many evaluations in a row have not bettered the best so far (each scores the
    whole test set); the run returns the best weights it scored, and its summary says their round (best_round)."""
    monitor: Monitor = Monitor.LOSS
    """What --patience watches: the test loss (lower is better) or the task's score (accuracy, R-squared; higher)."""
    min_delta: float = 0.0
    """How much better than the best so far an evaluation must be to count as better (--patience)."""
    master: str | None = None
    """Spark master URL (default local[K])."""
    eval_every_rounds: int = 1
    """Rounds between evaluations of the global weights."""
    eval_screen_rows: int = 2000
    """Between full evaluations, score only this fixed random sample of validation rows; the whole set is
    scored when the sample comes near --target-accuracy, every 10th evaluation and at the end (0: always
    the whole set)."""
    eval_budget: float | None = None
    """Largest share of the run's wall time evaluations may take: a due evaluation is put off to a later
    round while they have taken more (1: never put off). By default 0.25 with --target-accuracy or
    --target-loss, where an evaluation is what ends the run, and 0.05 without."""
    eval_overlap: bool = False
    """Rounds engine: score each round's weights on the driver in a thread while the next round trains, off the
    round's critical path; records come out, and the target is judged, one round late."""
    eval_sharded: bool = False
    """Rounds engine: keep the validation rows in Spark, cached in a partition a task slot, and score each evaluation
    as one Spark job over them on the executors; the driver never holds the held-out rows (for a validation set
    larger than the driver's memory, or faster on executors with cores of their own)."""
    weight_ema: float | None = None
    """Keep a moving average of the global weights over rounds with this decay per round (in (0, 1), e.g. 0.9;
    the first rounds use min(decay, (1 + r) / (10 + r))): every evaluation also scores it (val_ema_<metric>),
    the target accuracy is judged on it, and the fit returns it (its summary says returned_weights "ema", with
    the last global weights' scores as test_global_<metric>)."""
    auto_tau: bool = False
    """Choose tau while training so synchronization stays under --auto-tau-target of wall time."""
    auto_tau_target: float = 0.1
    """Largest fraction of wall time spent synchronizing that --auto-tau aims for."""
    auto_tau_min: int = 1
    """Smallest tau --auto-tau may choose."""
    auto_tau_max: int = 1000
    """Largest tau --auto-tau may choose."""
    auto_tau_every: int = 3
    """Rounds between two choices of --auto-tau (each from the medians of the last 5 rounds)."""
    data_mode: DataMode = DataMode.AUTO
    """How each worker holds its partition: memory (every row, shuffled as a whole each epoch), stream (the rows
    stay on the executor's disk and pass through a shuffle window of --stream-buffer-mb), or auto: streamed when
    the largest partition takes more than half the memory one task has (spark.executor.pyspark.memory, else the
    executor's memory, over its task slots)."""
    stream_buffer_mb: int = 64
    """Streamed partitions: most MiB of rows a worker holds at once (its shuffle window)."""
    compression: CompressionKind = CompressionKind.NONE
    """Encoding of the updates workers send: none, fp16, bf16 or int8 (with error feedback)."""
    link_latency: str | None = None
    """Simulated slow network: every exchange of the Spark engines waits this latency (e.g. 50ms)."""
    link_bandwidth: str | None = None
    """Simulated slow network: and its bytes over this bandwidth (e.g. 100Mbit; bits per second)."""
    outer_lr: float = 0.7
    """DiLoCo's outer learning rate (with SGD workers, 1 and an outer momentum of 0.5-0.7: averaging with slow
    momentum)."""
    outer_momentum: float = 0.9
    """DiLoCo's outer Nesterov momentum."""
    easgd_beta: float = 0.9
    """EASGD's moving rate times the number of workers (alpha = beta / K)."""
    overlap: bool = False
    """Overlap each round's exchange with the next round's local steps (barrier engine; average or diloco): workers
    go on from their own weights and take each round's average one round late."""
    fragments: int = 1
    """Streaming synchronisation: cut the weights into this many parts and exchange one part a round, in turn, so
    each exchange moves 1/fragments of the model (barrier engine; average or diloco)."""
    model_parallel: int = 1
    """M: processes each copy of the net is split across, its layers cut in parts (barrier engine). Alone, --workers
    counts processes (a multiple of M: workers / M copies average every tau steps); with --procs-per-worker G (a
    multiple of M), each worker's G processes hold G / M copies, whose gradients are averaged every step."""
    procs_per_worker: int = 1
    """G: processes (barrier tasks) each worker is made of. They average their gradients every step, training as
    one process with G times the batch; the strategy runs every tau steps between the workers (barrier engine; the
    stage runs workers x G tasks, a worker's ranks on one host where the cluster has several)."""
    shard_replica: bool = False
    """Shard each worker's weights and solver state over its --procs-per-worker processes (PyTorch's FSDP2; with
    --model-parallel M, each copy's parts over the worker's G / M copies), so a net larger than one process's share
    trains; the exchange between workers then runs shard by shard (overlapped or streamed too: each rank exchanges
    its values of the fragment a whole replica would)."""
    parallel_plan: str | None = None
    """Which layers split under --model-parallel, LAYER=column|row|none,... (default: the net's parallel= fields,
    else consecutive Linear layers in column/row pairs)."""
    max_weight_bytes: float | None = None
    """Bytes of weights one worker may hold (e.g. 16e6); a run over it is refused before training, naming the
    --model-parallel that fits."""
    checkpoint_dir: str | None = None
    """Write checkpoints to this folder or filesystem URI (weights, solver, strategy and RNG state, data position)."""
    checkpoint_every: int = 10
    """Rounds between checkpoints (one is also written at the end)."""
    checkpoint_keep: int = 3
    """How many of the newest checkpoints to keep."""
    resume: bool = False
    """Continue from the newest checkpoint in --checkpoint-dir (a fresh start when it holds none)."""

    def __post_init__(self):
        self.engine = parse_enum(Engine, self.engine, "engine")
        self.compression = parse_enum(CompressionKind, self.compression, "compression")
        self.data_mode = parse_enum(DataMode, self.data_mode, "data mode")
        self.monitor = parse_enum(Monitor, self.monitor, "monitor")
        check_at_least(1, workers=self.workers, stream_buffer_mb=self.stream_buffer_mb, rounds=self.rounds,
                       eval_every_rounds=self.eval_every_rounds, checkpoint_keep=self.checkpoint_keep)
        if not 0 < self.auto_tau_target < 1:
            raise ValueError(f"auto_tau_target is a fraction in (0, 1), got {self.auto_tau_target}")
        if not 1 <= self.auto_tau_min <= self.auto_tau_max:
            raise ValueError(f"need 1 <= auto_tau_min <= auto_tau_max, got {self.auto_tau_min}, {self.auto_tau_max}")
        if self.auto_tau_every < 1:
            raise ValueError(f"auto_tau_every must be at least 1 round, got {self.auto_tau_every}")
        self.link()  # a bad latency or bandwidth fails here, saying how to write it
        self.strategy = parse_enum(Strategy, self.strategy, "strategy")
        if self.engine is Engine.LOCAL and self.workers > 1:
            raise ValueError("engine 'local' trains one worker in this process; use --engine rounds or barrier with "
                             "--workers K")
        if self.tau is not None and self.tau < 1:
            raise ValueError(f"tau must be at least 1 (steps between synchronizations), got {self.tau}")
        if self.round_seconds is not None and not self.round_seconds > 0:
            raise ValueError(f"round_seconds must be positive, got {self.round_seconds}")
        if self.tau is None and self.round_seconds is None:
            raise ValueError("give tau, round_seconds, or both: a round needs an end")
        if self.strategy is Strategy.ASYNC and (self.tau is None or self.round_seconds is not None):
            raise ValueError("the async strategy pushes every tau local steps: give --tau, not --round-seconds")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be non-negative, got {self.warmup_steps}")
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"epochs must be positive, got {self.epochs}")
        if self.target_accuracy is not None and not 0 < self.target_accuracy <= 1:
            raise ValueError(f"target_accuracy is a fraction in (0, 1], got {self.target_accuracy}")
        if self.target_loss is not None and not math.isfinite(self.target_loss):
            raise ValueError(f"target_loss must be a finite number, got {self.target_loss}")
        self._check_patience()
        if self.target_loss is not None and self.strategy is Strategy.ASYNC:
            raise ValueError("the async strategy stops on --target-accuracy, --steps or --epochs; drop --target-loss")
        if self.eval_budget is not None and not 0.0 < self.eval_budget <= 1.0:
            raise ValueError(f"eval_budget is a share of the wall time in (0, 1], got {self.eval_budget}")
        if self.eval_screen_rows < 0:
            raise ValueError(f"eval_screen_rows must be 0 (always the whole set) or more, got {self.eval_screen_rows}")
        if self.eval_overlap and self.engine is not Engine.ROUNDS:
            raise ValueError(f"eval_overlap (--eval-overlap) scores the weights on the driver behind the rounds "
                             f"engine's jobs; the {self.engine.value} engine evaluates on its workers, in the round")
        if self.eval_sharded and self.engine is not Engine.ROUNDS:
            raise ValueError(f"eval_sharded (--eval-sharded) scores the rounds engine's weights in a Spark job of "
                             f"their own; the {self.engine.value} engine evaluates on its workers, in the round")
        if self.eval_sharded and self.eval_overlap:
            raise ValueError("eval_sharded (--eval-sharded) scores the weights on the executors, eval_overlap "
                             "(--eval-overlap) in a thread on the driver: choose one")
        if self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be at least 1 round, got {self.checkpoint_every}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs --checkpoint-dir: the folder whose newest checkpoint to continue from")
        if self.strategy is Strategy.SYNC:
            check_per_step_strategy(self, "the sync strategy")
        self._check_strategy_settings()
        self.streaming()  # --overlap and --fragments' own rules
        self._check_model_parallel()
        self._check_procs_per_worker()
        if self.weight_ema is not None:
            if not 0.0 < self.weight_ema < 1.0:
                raise ValueError(f"weight_ema is a decay per round in (0, 1) (e.g. 0.9), got {self.weight_ema}")
            if self.strategy is Strategy.ASYNC:
                raise ValueError("weight_ema averages the global weights of the round loop; the async strategy has "
                                 "no rounds: drop --weight-ema or choose another strategy")

    def _check_patience(self) -> None:
        """--patience's own rules, and the settings it cannot stand beside."""
        if self.patience is None:
            if self.monitor is not Monitor.LOSS or self.min_delta != 0.0:
                raise ValueError("--monitor and --min-delta are early stopping's settings; give --patience N too")
            return
        if self.patience < 1:
            raise ValueError(f"patience counts evaluations without betterment, at least 1, got {self.patience}")
        if not (math.isfinite(self.min_delta) and self.min_delta >= 0.0):
            raise ValueError(f"min_delta must be a finite number, 0 or more, got {self.min_delta}")

    _STRATEGY_SETTINGS: ClassVar[dict] = {Strategy.DILOCO: ("outer_lr", "outer_momentum"),
                                          Strategy.EASGD: ("easgd_beta",)}
    """The settings only one strategy reads."""

    def _check_strategy_settings(self) -> None:
        """A strategy's own settings changed for another strategy, which would leave them unused: refused; DiLoCo's
        checked before any Spark starts."""
        if self.strategy is Strategy.DILOCO:
            check_outer_step(self.outer_lr, self.outer_momentum)
        for owner, names in self._STRATEGY_SETTINGS.items():
            given = [flag(name) for name in changed(self, names)]
            if given and self.strategy is not owner:
                raise ValueError(f"{' and '.join(given)} only shape{'s' * (len(given) == 1)} the {owner.value} "
                                 f"strategy, and this run's is {self.strategy.value}: add --strategy {owner.value} "
                                 f"or drop {'them' if len(given) > 1 else 'it'}")

    def _check_model_parallel(self) -> None:
        """--model-parallel, --parallel-plan and --max-weight-bytes, and what a split net cannot do."""
        m = self.model_parallel
        if m < 1:
            raise ValueError(f"--model-parallel must be at least 1, got {m}")
        if self.max_weight_bytes is not None and not self.max_weight_bytes > 0:
            raise ValueError(f"--max-weight-bytes must be positive, got {self.max_weight_bytes}")
        if self.parallel_plan is not None:
            parse_plan(self.parallel_plan)
            if m == 1:
                raise ValueError("--parallel-plan needs --model-parallel M with M > 1")
        if m == 1:
            return
        refusal = None
        if self.engine is not Engine.BARRIER:
            refusal = (f"--model-parallel runs its workers together in one barrier stage; add --engine barrier "
                       f"(the {self.engine.value} engine does not split layers)")
        elif self.procs_per_worker > 1 and self.procs_per_worker % m:
            refusal = (f"--procs-per-worker {self.procs_per_worker} does not divide into copies split {m} ways: give "
                       f"a worker a multiple of --model-parallel {m} processes")
        elif self.shard_replica and self.procs_per_worker == m:
            refusal = (f"--shard-replica with --model-parallel {m} shards each part over a worker's copies of the "
                       f"split layers: give --procs-per-worker a multiple of {m} above it (e.g. {2 * m})")
        elif self.procs_per_worker == 1 and self.workers % m:
            refusal = (f"{self.workers} workers do not divide into model-parallel groups of {m}; use --workers "
                       f"{max(m, self.workers - self.workers % m)} or another multiple of {m}")
        elif self.strategy in (Strategy.SYNC, Strategy.ASYNC):
            refusal = (f"the {self.strategy.value} strategy does not know about split layers; use --strategy "
                       "average, diloco or easgd with --model-parallel")
        elif self.tau is None or self.round_seconds is not None or self.auto_tau:
            refusal = ("--model-parallel needs a fixed --tau and no --round-seconds or --auto-tau: the processes of "
                       "one model copy make every step together")
        if refusal is not None:
            raise ValueError(refusal)

    def _check_procs_per_worker(self) -> None:
        """--procs-per-worker: what a worker of several processes cannot do."""
        g = self.procs_per_worker
        if g < 1:
            raise ValueError(f"--procs-per-worker must be at least 1, got {g}")
        if self.shard_replica and g == 1:
            raise ValueError("--shard-replica shards a worker's weights over its processes: give --procs-per-worker "
                             "G with G > 1")
        if g == 1:
            return
        refusal = None
        if self.engine is not Engine.BARRIER:
            refusal = (f"a worker of several processes averages its ranks' gradients every step in one barrier "
                       f"stage; add --engine barrier (the {self.engine.value} engine runs one task a worker)")
        elif self.strategy in (Strategy.SYNC, Strategy.ASYNC):
            refusal = (f"the {self.strategy.value} strategy does not exchange every tau steps between workers"
                       + ("; it already averages gradients over every process at every step: train with "
                          f"--workers {self.workers * g} instead" if self.strategy is Strategy.SYNC else "")
                       + "; choose --strategy average, diloco or easgd with --procs-per-worker")
        elif self.round_seconds is not None or self.auto_tau:
            refusal = ("the ranks of a worker make every step together, so rounds need a fixed tau: drop "
                       "--round-seconds and --auto-tau with --procs-per-worker")
        if refusal is not None:
            raise ValueError(refusal)

    @property
    def one_process(self) -> bool:
        """Whether one worker trains in this process, without Spark: the local engine, or one worker of the rounds
        engine with no master named (``--master`` trains one worker on Spark)."""
        return self.engine is Engine.LOCAL or (self.workers == 1 and self.engine is Engine.ROUNDS
                                               and self.master is None)

    @property
    def toward_target(self) -> bool:
        """Whether the run stops at a target accuracy or loss, or on --patience: an evaluation is then what ends it,
        and evaluations come more often by default (``eval_budget``; one process's ``RunConfig.eval_every``)."""
        return self.target_accuracy is not None or self.target_loss is not None or self.patience is not None

    @property
    def ranks(self) -> int:
        """The processes that train: workers x procs_per_worker (the barrier stage's tasks, the partitions); with
        --model-parallel, the workers themselves."""
        return self.workers * self.procs_per_worker

    def as_workers(self) -> DistributedConfig:
        """This fit as the barrier engine runs it, K workers of G processes: --model-parallel M alone makes its W
        workers processes, M of them one worker whose layers are split over them (W/M workers of M processes); any
        other fit is itself."""
        if self.model_parallel == 1 or self.procs_per_worker > 1:
            return self
        return dataclasses.replace(self, workers=self.workers // self.model_parallel,
                                   procs_per_worker=self.model_parallel)

    def plan(self) -> dict[str, str | None] | None:
        """--parallel-plan as layer name -> ``"column"``, ``"row"`` or ``None`` (``None``: not given)."""
        return None if self.parallel_plan is None else parse_plan(self.parallel_plan)

    def streaming(self) -> Streaming | None:
        """How the round's exchange runs late or in parts (--overlap, --fragments); ``None``: neither."""
        if self.fragments < 1:
            raise ValueError(f"fragments must be at least 1 (1: the whole weights every round), got {self.fragments}")
        if not self.overlap and self.fragments == 1:
            return None
        what = "--overlap" if self.overlap else "--fragments"
        if self.strategy not in (Strategy.AVERAGE, Strategy.DILOCO):
            raise ValueError(f"{what} applies each round's average late or a part at a time, which average and "
                             f"diloco can and {self.strategy.value} cannot: choose --strategy average or diloco")
        if self.workers == 1:
            raise ValueError(f"{what} shapes the exchange between workers; one worker trains alone: give --workers")
        if self.engine is Engine.ROUNDS:
            raise ValueError(f"{what} needs the barrier engine: the rounds engine runs a round's local steps and its "
                             "exchange as one Spark job (--engine barrier)")
        if self.overlap and (self.round_seconds is not None or self.auto_tau):
            raise ValueError("--overlap counts a round's steps before its sums arrive, so rounds need a fixed tau: "
                             "drop --round-seconds and --auto-tau")
        if self.fragments > 1 and self.compression is not CompressionKind.NONE:
            raise ValueError("--fragments with --compression: the codecs' error feedback covers whole updates; "
                             "drop one of them")
        return Streaming(overlap=self.overlap, fragments=self.fragments)

    def link(self):
        """The simulated link of --link-latency/--link-bandwidth (``None`` when neither is given)."""
        if self.link_latency is None and self.link_bandwidth is None:
            return None
        return LinkModel.parse(self.link_latency, self.link_bandwidth)

    def strategy_options(self) -> dict:
        """Keyword arguments for :func:`sparknet.strategies.make_strategy`."""
        if self.strategy is Strategy.DILOCO:
            return {"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum}
        if self.strategy is Strategy.EASGD:
            return {"num_workers": self.as_workers().workers, "beta": self.easgd_beta}
        return {}

    @property
    def resolved_master(self) -> str:
        return self.master or f"local[{self.ranks}]"


@dataclass(kw_only=True)
class EngineOptions:
    """Settings of the Spark engines beyond :class:`~sparknet.config.DistributedConfig`."""

    staging_dir: str | None = None
    """Rounds engine: where executors keep each partition's arrays (default: their Spark local directory)."""
    storage_level: str = "MEMORY_AND_DISK"
    """How Spark caches the converted training chunks (a ``pyspark.StorageLevel`` name; ``MEMORY_AND_DISK_2``
    keeps a copy on a second host, so a partition that moves after a host is lost trains on the same rows in
    the same order)."""
    worker_state_on_driver: bool | None = None
    """Rounds engine: every task also sends its solver and strategy state to the driver each round, and a
    partition that moves to another host (a host lost) continues from it instead of from a fresh solver.
    Default: on a cluster (not on a local master, whose executors share one disk and find the state there)."""
    elastic_after_s: float | None = 60.0
    """Rounds engine: how long the cluster may have fewer task slots than workers (a host lost) before
    each round trains only as many workers as there are slots, a different few each round in turn, so
    that a round takes the time of one task again and every partition's rows still get their turn
    (a host that comes back is used again from the next round). Until then, and always with ``None``,
    Spark runs the K tasks in waves on the hosts left, and the weights are those of an undisturbed run.
    Needs the driver to hold the workers' states (:attr:`worker_state_on_driver`, on by default on a
    cluster). Barrier engine: how long a failed stage waits for the slots of all its workers before it starts
    again with as many whole workers (each of its ``procs_per_worker`` processes on a slot) as the cluster has
    slots for, their partitions holding every row (a worker left takes those of one that left), their solver
    states afresh. Once the cluster has the slots of more whole workers, the stage of fewer is stopped after its
    round and started again with them (all of them: each on its own partition). With ``None`` the stage waits
    :attr:`rendezvous_timeout_s` for all of them, then fails."""
    rounds_transport: str = "socket"
    """Rounds engine: how the weights and updates travel. ``socket``: through an authenticated socket on the
    driver beside each round's Spark job (:mod:`sparknet.spark._relay`: a Unix socket only the user can open on a
    local master, TCP with CurveZMQ and one key per fit on a cluster), so a round costs little more than Spark's
    job; should a task not reach it (a firewall between the executors and the
    driver), that fit goes on through Spark. ``spark``: through a broadcast and the task results, nothing
    but Spark's own connections."""
    warmup_max_samples: int = 20_000
    """Most training rows collected to the driver for the warm-up steps."""
    warmup_max_bytes: int = 256 << 20
    """Most feature bytes collected to the driver for the warm-up steps."""
    rendezvous_timeout_s: float = 180.0
    """Barrier engine: longest wait for every task to start and join the process group."""
    collective_timeout_s: float = 300.0
    """Barrier engine: longest wait of one collective (the gloo process group's timeout)."""
    driver_timeout_s: float | None = None
    """Barrier engine: longest silence from the stage between two rounds before the driver cancels it
    (default: collective_timeout_s + round_seconds + 60)."""
    round_timeout_s: float | None = None
    """Rounds engine: longest wait for one round's Spark job; past it the job is cancelled and a
    DeadlineExceeded names the round and the tasks not finished. Default: 30 minutes for the first
    round of a fit, then 20 times the slowest step time seen so far times the round's steps, at
    least 10 minutes, bounded by round_seconds for time-budgeted rounds
    (:func:`sparknet.spark.backend.default_round_deadline`)."""
    data_timeout_s: float = 3600.0
    """Longest wait for one Spark job on the fit's data (conversion and check, staging, the validation
    collect, the warm-up sample); past it the jobs are cancelled and a DeadlineExceeded says which."""
    max_restarts: int = 3
    """Barrier engine: how many times a failed stage is started again from the driver's newest state."""
    state_every_rounds: int = 1
    """Barrier engine: rounds between the global weights and strategy state sent to the driver (what a
    restart starts from)."""
    fault: str | None = None
    """Injected faults for reliability tests, e.g. ``rank=1,round=3,kind=kill`` (see sparknet.faults; default none:
    faults are set here only, never read from the environment)."""
    link: LinkModel | None = None
    """A simulated slow network (:class:`sparknet.link.LinkModel`): in the rounds engine each task waits
    ``link.delay(bytes)`` for its download of the weights and again for its upload; in the barrier engine
    every rank waits the collective's delay before each collective (each step's, for sync). The waits are
    recorded per round (``link_s``). Default: ``dist.link_latency``/``dist.link_bandwidth``, else none."""

    CODE_ONLY: ClassVar[frozenset[str]] = frozenset({"fault", "link"})
    """Fields set in code only, never flags or Params: injected faults (reliability tests) and a link model
    (``--link-latency`` and ``--link-bandwidth`` make one)."""

    def __post_init__(self):
        from pyspark import StorageLevel

        if not hasattr(StorageLevel, str(self.storage_level)):
            raise ValueError(f"unknown storage level {self.storage_level!r} (e.g. MEMORY_AND_DISK, DISK_ONLY)")
        for name in ("warmup_max_samples", "warmup_max_bytes", "state_every_rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.rounds_transport not in ("socket", "spark"):
            raise ValueError(f"rounds_transport must be 'socket' or 'spark', got {self.rounds_transport!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {self.max_restarts}")
        faults_from(self.fault)  # a bad fault spec fails here, not on the executors
        if self.link is not None and not isinstance(self.link, LinkModel):
            raise ValueError(f"link must be a sparknet.link.LinkModel (e.g. LinkModel.parse('50ms', '100Mbit')), "
                             f"got {type(self.link).__name__}")
        if self.elastic_after_s is not None and not (math.isfinite(self.elastic_after_s) and self.elastic_after_s >= 0):
            raise ValueError(f"elastic_after_s must be 0 or more seconds, or None (never), got {self.elastic_after_s}")
        for name in ("rendezvous_timeout_s", "collective_timeout_s", "driver_timeout_s", "round_timeout_s",
                     "data_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")


@dataclass(kw_only=True)
class CaffeTrainFlags:
    """Caffe files (train a Caffe net with its solver)"""

    prototxt: str | None = None
    """Caffe net prototxt to train (with --solver it replaces the solver's net)."""
    solver: str | None = None
    """Caffe solver prototxt (its net, max_iter, test_interval, test_iter, display and snapshot settings)."""
    weights: str | None = None
    """.caffemodel to start from (fine-tuning)."""
    snapshot_dir: str | None = None
    """Folder for <prefix>_iter_N.caffemodel snapshots and model folders (default: ./<snapshot_prefix name>)."""
    snapshot_every: int | None = None
    """Iterations between snapshots (default: the solver's snapshot; 0: only the final one)."""
    test_iter: int | None = None
    """Test batches per test net (default: the solver's test_iter)."""
    display: int | None = None
    """Iterations between progress log lines (default: the solver's display)."""
    caffe_sources: str | None = None
    """Bind data layer sources to data sets: SOURCE=DATASET[:SPLIT],... (e.g. mnist_train_lmdb=mnist-small)."""
    max_train_samples: int | None = None
    """Train on the first N samples of the training data only (quick runs)."""

    def __post_init__(self):
        check_at_least(0, **{"--snapshot-every": self.snapshot_every, "--display": self.display})
        check_at_least(1, **{"--test-iter": self.test_iter, "--max-train-samples": self.max_train_samples})

    @property
    def given(self) -> bool:
        """Whether a Caffe file was given (the run is a Caffe run)."""
        return self.prototxt is not None or self.solver is not None


@dataclass(kw_only=True)
class TrainConfig:
    """Everything ``sparknet train`` takes."""

    run: RunConfig = field(default_factory=RunConfig)
    dist: DistributedConfig = field(default_factory=DistributedConfig)

    def to_dict(self) -> dict:
        return {name: {k: v.value if isinstance(v, enum.Enum) else v for k, v in asdict(part).items()}
                for name, part in (("run", self.run), ("dist", self.dist))}
