"""Solvers: Caffe's solver types and learning-rate policies on top of ``torch.optim``.

A :class:`SolverConfig` says what to optimise with; :func:`build_optimizer` turns it into a
``torch.optim.Optimizer`` and a ``LambdaLR`` scheduler. Per-layer learning-rate and decay
multipliers (Caffe's ``param { lr_mult decay_mult }``) become optimizer parameter groups.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch

from sparknet._enums import parse_enum

__all__ = ["SolverType", "LRPolicy", "SolverConfig", "build_optimizer", "lr_multiplier"]


class SolverType(str, enum.Enum):
    """The update rule. Values are the lower-case names the CLI and Caffe files use."""

    SGD = "sgd"
    NESTEROV = "nesterov"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"
    ADADELTA = "adadelta"

    @classmethod
    def parse(cls, value) -> SolverType:
        """Accept a member or a name in any case (``"Adam"``, ``"ADAM"``, ``"adam"``)."""
        return parse_enum(cls, value, "solver type")


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
    """Learning rate before the policy and the per-layer ``lr_mult`` scale it."""
    momentum: float = 0.9
    """SGD/Nesterov momentum; Adam's beta1."""
    momentum2: float = 0.999
    """Adam's beta2."""
    weight_decay: float = 0.0
    """Regularisation strength (scaled per layer by ``decay_mult``)."""
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
    iter_size: int = 1
    """Gradient accumulation: minibatches per update."""
    clip_gradients: float = -1.0
    """Clip the global gradient L2 norm to this value when positive (as Caffe: the norm of the ``iter_size``
    minibatches' summed gradient, before weight decay)."""

    def __post_init__(self):
        self.type = SolverType.parse(self.type)
        self.lr_policy = LRPolicy.parse(self.lr_policy)
        self.regularization = str(self.regularization).upper()
        self.stepvalues = tuple(int(v) for v in self.stepvalues)
        if not (math.isfinite(self.base_lr) and self.base_lr > 0):
            raise ValueError(f"base_lr must be a positive number, got {self.base_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.momentum2 < 1:
            raise ValueError(f"momentum2 must be in [0, 1), got {self.momentum2}")
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
        if self.iter_size < 1:
            raise ValueError(f"iter_size must be at least 1, got {self.iter_size}")
        if self.type is SolverType.NESTEROV and self.momentum == 0:
            raise ValueError("the Nesterov solver needs a non-zero momentum")

    def replace(self, **changes) -> SolverConfig:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-able values."""
        d = asdict(self)
        d["type"] = self.type.value
        d["lr_policy"] = self.lr_policy.value
        d["stepvalues"] = list(self.stepvalues)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SolverConfig:
        return cls(**d)


def lr_multiplier(config: SolverConfig, iteration: int) -> float:
    """The factor the policy applies to ``base_lr`` at ``iteration`` (Caffe's formulas)."""
    it = iteration
    p = config.lr_policy
    if p is LRPolicy.FIXED:
        return 1.0
    if p is LRPolicy.STEP:
        return config.gamma ** (it // config.stepsize)
    if p is LRPolicy.MULTISTEP:
        return config.gamma ** sum(1 for v in config.stepvalues if it >= v)
    if p is LRPolicy.EXP:
        return config.gamma**it
    if p is LRPolicy.INV:
        return (1.0 + config.gamma * it) ** (-config.power)
    if p is LRPolicy.POLY:
        return max(0.0, 1.0 - it / config.max_iter) ** config.power
    if p is LRPolicy.SIGMOID:
        return 1.0 / (1.0 + math.exp(-config.gamma * (it - config.stepsize)))
    if p is LRPolicy.COSINE:
        return 0.5 * (1.0 + math.cos(math.pi * min(it, config.max_iter) / config.max_iter))
    raise AssertionError(p)


def _groups(model_or_groups) -> list[dict]:
    """Parameter groups with ``lr_mult``/``decay_mult`` keys, from a module or a list."""
    if isinstance(model_or_groups, torch.nn.Module):
        if hasattr(model_or_groups, "param_groups") and callable(model_or_groups.param_groups):
            groups = model_or_groups.param_groups()
        else:
            groups = [{"params": [p for p in model_or_groups.parameters() if p.requires_grad]}]
    else:
        groups = list(model_or_groups)
        if groups and isinstance(groups[0], torch.Tensor):
            groups = [{"params": groups}]
    out = []
    for g in groups:
        params = [p for p in g["params"] if p.requires_grad]
        if params:
            out.append({"params": params, "lr_mult": float(g.get("lr_mult", 1.0)), "decay_mult": float(g.get("decay_mult", 1.0))})
    if not out:
        raise ValueError("the model has no trainable parameters")
    return out


class _L1Regularized(torch.optim.Optimizer):
    """Wraps an optimizer and adds ``weight_decay * sign(w)`` to each gradient (Caffe's L1)."""

    def __init__(self, inner: torch.optim.Optimizer, decays: Sequence[float]):
        self.inner = inner
        self._decays = list(decays)
        # Share the inner optimizer's state so schedulers and state_dict see one optimizer.
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.state = inner.state

    @torch.no_grad()
    def step(self, closure=None):
        for group, decay in zip(self.param_groups, self._decays):
            if decay:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(torch.sign(p), alpha=decay)
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)


def build_optimizer(model_or_groups, config: SolverConfig | None = None):
    """Build the optimizer and learning-rate scheduler a :class:`SolverConfig` describes.

    Parameters
    ----------
    model_or_groups : torch.nn.Module or list of parameter groups
        A module (its ``param_groups()`` is used when it has one, as a ``GraphModule``
        does, to honour per-layer ``lr_mult``/``decay_mult``), or groups
        ``{"params", "lr_mult", "decay_mult"}``.
    config : SolverConfig, optional
        Defaults to ``SolverConfig()`` (SGD, lr 0.01, momentum 0.9).

    Returns
    -------
    (torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR)
        Call ``scheduler.step()`` once per update, after ``optimizer.step()``.
    """
    config = config or SolverConfig()
    groups = _groups(model_or_groups)
    l1 = config.regularization == "L1"
    torch_groups, decays = [], []
    for g in groups:
        decay = config.weight_decay * g["decay_mult"]
        decays.append(decay if l1 else 0.0)
        torch_groups.append({"params": g["params"], "lr": config.base_lr * g["lr_mult"], "weight_decay": 0.0 if l1 else decay})
    t = config.type
    if t is SolverType.SGD:
        opt = torch.optim.SGD(torch_groups, lr=config.base_lr, momentum=config.momentum)
    elif t is SolverType.NESTEROV:
        opt = torch.optim.SGD(torch_groups, lr=config.base_lr, momentum=config.momentum, nesterov=True)
    elif t is SolverType.ADAM:
        opt = torch.optim.Adam(torch_groups, lr=config.base_lr, betas=(config.momentum, config.momentum2), eps=config.delta)
    elif t is SolverType.ADAMW:
        opt = torch.optim.AdamW(torch_groups, lr=config.base_lr, betas=(config.momentum, config.momentum2), eps=config.delta)
    elif t is SolverType.RMSPROP:
        opt = torch.optim.RMSprop(torch_groups, lr=config.base_lr, alpha=config.rms_decay, eps=config.delta)
    elif t is SolverType.ADAGRAD:
        opt = torch.optim.Adagrad(torch_groups, lr=config.base_lr, eps=config.delta)
    elif t is SolverType.ADADELTA:
        opt = torch.optim.Adadelta(torch_groups, lr=config.base_lr, rho=config.momentum, eps=config.delta)
    else:  # pragma: no cover - the Enum is closed
        raise AssertionError(t)
    if l1 and any(decays):
        opt = _L1Regularized(opt, decays)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_multiplier(config, it))
    return opt, scheduler
