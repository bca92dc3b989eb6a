"""Solvers: Caffe's solver types and learning-rate policies (:class:`SolverConfig`).

A :class:`SolverConfig` says what to optimise with; :func:`sparknet.optimizers.build_optimizer` turns it into a
``torch.optim.Optimizer`` and a ``LambdaLR`` scheduler. This module loads no torch: the command line reads its
flags before torch is imported.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

from sparknet._enums import parse_enum

__all__ = ["SolverType", "LRPolicy", "SolverConfig", "lr_multiplier", "check_gradient_hook"]


class SolverType(str, enum.Enum):
    """The update rule. Values are the lower-case names the CLI and Caffe files use."""

    SGD = "sgd"
    NESTEROV = "nesterov"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"
    ADADELTA = "adadelta"
    CG = "cg"
    """Nonlinear conjugate gradient (Polak-Ribiere+) with a line search:
    :class:`~sparknet.optimizers.ConjugateGradient`."""
    LBFGS = "lbfgs"
    """L-BFGS with a strong-Wolfe line search: ``torch.optim.LBFGS``."""

    @classmethod
    def parse(cls, value) -> SolverType:
        """Accept a member or a name in any case (``"Adam"``, ``"ADAM"``, ``"adam"``)."""
        return parse_enum(cls, value, "solver type")

    @property
    def needs_closure(self) -> bool:
        """Whether ``step`` takes a closure that evaluates the loss again (a line search)."""
        return self in (SolverType.CG, SolverType.LBFGS)


class LRPolicy(str, enum.Enum):
    """Learning-rate policies: Caffe's, plus cosine annealing."""

    FIXED = "fixed"
    STEP = "step"
    MULTISTEP = "multistep"
    EXP = "exp"
    INV = "inv"
    POLY = "poly"
    SIGMOID = "sigmoid"
    COSINE = "cosine"

    @classmethod
    def parse(cls, value) -> LRPolicy:
        """Accept a member or a name in any case."""
        return parse_enum(cls, value, "learning-rate policy")


@dataclass(kw_only=True)
class SolverConfig:
    """How to optimise: the update rule, its hyper-parameters and the learning-rate policy.

    Names follow Caffe's ``SolverParameter`` so a solver prototxt maps onto it directly.
    """

    type: SolverType = SolverType.SGD
    """Update rule."""
    base_lr: float = 0.01
    """Learning rate before the policy and the per-layer ``lr_mult`` scale it. For cg, the first trial step
    of its first line search is SGD's step (this rate times the gradient); for lbfgs, the first trial step
    along its quasi-Newton direction (1.0 is the natural value)."""
    momentum: float = 0.9
    """SGD/Nesterov momentum; Adam's beta1."""
    momentum2: float = 0.999
    """Adam's beta2."""
    weight_decay: float = 0.0
    """Regularisation strength (scaled per layer by ``decay_mult``). For cg and lbfgs the penalty
    (``weight_decay/2 * |w|^2``, or ``weight_decay * |w|_1``) is part of the loss their line search lowers."""
    regularization: str = "L2"
    """``"L2"`` (weight decay) or ``"L1"`` (sign of the weights added to the gradient)."""
    delta: float = 1e-8
    """Numerical-stability epsilon of Adam, RMSprop, AdaGrad, AdaDelta."""
    rms_decay: float = 0.99
    """RMSprop's smoothing constant (alpha); AdaDelta uses ``momentum`` as rho, like Caffe."""
    lr_policy: LRPolicy = LRPolicy.FIXED
    """How the learning rate changes with the iteration."""
    gamma: float = 0.1
    """Factor of the step, multistep, exp, inv and sigmoid policies."""
    power: float = 1.0
    """Exponent of the inv and poly policies."""
    stepsize: int = 1
    """Iterations per step of the step policy; centre of the sigmoid policy."""
    stepvalues: tuple[int, ...] = ()
    """Iterations at which the multistep policy multiplies by ``gamma``."""
    max_iter: int = 10000
    """Horizon of the poly and cosine policies."""
    lr_warmup: int = 0
    """Iterations over which the rate rises linearly to the policy's: at iteration t below it, (t + 1) / lr_warmup
    of the policy's rate (the gradual warm-up of large-batch SGD and of transformers; 0: none)."""
    min_lr: float = 0.0
    """The cosine policy's floor: its rate falls from base_lr to this at max_iter (PyTorch's eta_min)."""
    iter_size: int = 1
    """Gradient accumulation: minibatches per update."""
    clip_gradients: float = -1.0
    """Clip the global gradient L2 norm to this value when positive (as Caffe: the norm of the ``iter_size``
    minibatches' summed gradient, before weight decay)."""
    line_search_evals: int = 10
    """cg and lbfgs: most loss evaluations one line search makes (each a forward and backward pass)."""
    cg_restart: int = 50
    """cg: restart from the steepest descent direction every this many steps (and whenever the
    direction is not a descent direction)."""
    history_size: int = 10
    """lbfgs: curvature pairs kept (its memory)."""
    caffe_history: bool = False
    """sgd and nesterov: keep Caffe's momentum history, the step itself (``v = momentum * v + lr * g``,
    ``w -= v``), instead of PyTorch's, the gradients' sum (``v = momentum * v + g``, ``w -= lr * v``). The two
    are the same while the rate stays the same; when it changes, Caffe's history keeps the steps already
    taken at the old rate and PyTorch's is rescaled by the new one. A Caffe solver file sets it."""
    caffe_delta: bool = False
    """adam: add ``delta`` to ``sqrt(v)`` before the bias correction, as Caffe's ``adam_solver.cpp`` does
    (``lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + delta)``), instead of after it, as PyTorch does
    (``lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + delta)``). The two part where ``sqrt(v)`` is near
    ``delta``: with a large delta, or in a net's rarely moved weights. A Caffe solver file sets it."""

    def __post_init__(self):
        self.type = SolverType.parse(self.type)
        self.lr_policy = LRPolicy.parse(self.lr_policy)
        self.regularization = str(self.regularization).upper()
        self.stepvalues = tuple(_iteration(v, "stepvalues") for v in self.stepvalues)
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"base_lr must be a positive number, got {self.base_lr}")
        for name in ("momentum", "momentum2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be non-negative, got {self.weight_decay}")
        if self.regularization not in ("L1", "L2"):
            raise ValueError(f"regularization must be 'L1' or 'L2', got {self.regularization!r}")
        if self.delta <= 0:
            raise ValueError(f"delta must be positive, got {self.delta}")
        if not 0 < self.rms_decay < 1:
            raise ValueError(f"rms_decay must be in (0, 1), got {self.rms_decay}")
        if not math.isfinite(self.gamma):
            raise ValueError(f"gamma must be a finite number, got {self.gamma}")
        if self.gamma < 0 and self.lr_policy is not LRPolicy.SIGMOID:
            # Caffe's sigmoid policy decays the rate with a negative gamma; elsewhere it is a mistake.
            raise ValueError(f"gamma must be non-negative for the {self.lr_policy.value} policy, got {self.gamma}")
        if self.lr_policy is LRPolicy.STEP and self.stepsize <= 0:
            raise ValueError(f"the step policy needs a positive stepsize, got {self.stepsize}")
        if list(self.stepvalues) != sorted(self.stepvalues):
            raise ValueError(f"stepvalues must increase, got {self.stepvalues}")
        if self.max_iter <= 0:
            raise ValueError(f"max_iter must be positive, got {self.max_iter}")
        if self.lr_warmup < 0:
            raise ValueError(f"lr_warmup must be 0 or more iterations, got {self.lr_warmup}")
        if self.min_lr and self.lr_policy is not LRPolicy.COSINE:
            raise ValueError(f"min_lr is the cosine policy's floor; the {self.lr_policy.value} policy has none: give "
                             "--lr-policy cosine, or drop min_lr")
        if not 0.0 <= self.min_lr <= self.base_lr:
            raise ValueError(f"min_lr must be in [0, base_lr = {self.base_lr}], got {self.min_lr}")
        if self.type is SolverType.NESTEROV and self.momentum == 0:
            raise ValueError("the Nesterov solver needs a non-zero momentum")
        for name in ("iter_size", "line_search_evals", "cg_restart", "history_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.caffe_history and self.type not in (SolverType.SGD, SolverType.NESTEROV):
            raise ValueError(f"caffe_history is a rule of the sgd and nesterov solvers, not of {self.type.value}")
        if self.caffe_delta and self.type is not SolverType.ADAM:
            raise ValueError(f"caffe_delta is a rule of the adam solver, not of {self.type.value}")
        if self.type.needs_closure and self.clip_gradients > 0:
            raise ValueError(f"the {self.type.value} solver chooses its step by a line search on the loss; a clipped "
                             "gradient would not be the loss's gradient: drop clip_gradients")

    def replace(self, **changes) -> SolverConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-able values."""
        return {**asdict(self), "type": self.type.value, "lr_policy": self.lr_policy.value,
                "stepvalues": list(self.stepvalues)}

    @classmethod
    def from_dict(cls, d: dict) -> SolverConfig:
        return cls(**d)


def _multistep(config: SolverConfig, it: int) -> float:
    # Caffe moves past at most one step value an iteration: a repeated value takes effect one iteration later
    steps, at = 0, -1
    for v in config.stepvalues:
        at = max(v, at + 1)
        steps += it >= at
    return config.gamma**steps


_POLICIES: dict[LRPolicy, Callable[[SolverConfig, int], float]] = {
    LRPolicy.FIXED: lambda config, it: 1.0,
    LRPolicy.STEP: lambda config, it: config.gamma ** (it // config.stepsize),
    LRPolicy.MULTISTEP: _multistep,
    LRPolicy.EXP: lambda config, it: config.gamma**it,
    LRPolicy.INV: lambda config, it: (1.0 + config.gamma * it) ** (-config.power),
    LRPolicy.POLY: lambda config, it: max(0.0, 1.0 - it / config.max_iter) ** config.power,
    LRPolicy.SIGMOID: lambda config, it: 1.0 / (1.0 + math.exp(-config.gamma * (it - config.stepsize))),
    LRPolicy.COSINE: lambda config, it: 0.5 * (1.0 + math.cos(math.pi * min(it, config.max_iter) / config.max_iter)),
}


def lr_multiplier(config: SolverConfig, iteration: int) -> float:
    """The factor the policy applies to ``base_lr`` at ``iteration`` (Caffe's formulas; the cosine policy's falls to
    ``min_lr``), times the linear warm-up's during the first ``lr_warmup`` iterations."""
    factor = _POLICIES[config.lr_policy](config, iteration)
    if config.min_lr:
        floor = config.min_lr / config.base_lr
        factor = floor + (1.0 - floor) * factor
    if iteration < config.lr_warmup:
        factor *= (iteration + 1) / config.lr_warmup
    return factor


def _iteration(value, name: str) -> int:
    """An iteration number given as a whole number (an int, or a float such as JSON may hold); ``ValueError``
    for anything else (a fraction, NaN, an infinity, a string that is not a number)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must hold whole numbers of iterations, got {value!r}") from None
    if not math.isfinite(number) or number != int(number):
        raise ValueError(f"{name} must hold whole numbers of iterations, got {value!r}")
    return int(number)


def check_gradient_hook(config: SolverConfig, what: str) -> None:
    """Refuse a line-search solver (cg, lbfgs) where ``what`` changes the gradients at every step.

    A strategy that allreduces gradients between backward and the update (``sync``) needs every worker to
    evaluate the loss the same number of times per step; a line search evaluates each worker's own loss until
    its own conditions hold.
    """
    if config.type.needs_closure:
        raise ValueError(f"{what} combines the workers' gradients at every step, but the {config.type.value} "
                         "solver's line search evaluates each worker's own loss a different number of times per "
                         "step: train it as the local solver of averaging rounds (strategy average, diloco or "
                         "easgd), or choose a gradient solver such as sgd or adam")
