"""The optimizers a :class:`~sparknet.solvers.SolverConfig` describes, on top of ``torch.optim``.

:func:`build_optimizer` turns a configuration into a ``torch.optim.Optimizer`` and a ``LambdaLR`` scheduler.
Per-layer learning-rate and decay multipliers (Caffe's ``param { lr_mult decay_mult }``) become optimizer
parameter groups.

Two solvers search along a direction instead of stepping by the learning rate: nonlinear conjugate gradient
(:class:`ConjugateGradient`, the optimizer the 2017 data- and model-parallel Spark paper found fastest for its fully
connected net) and L-BFGS (``torch.optim.LBFGS``). Their ``step`` takes a closure that evaluates the loss again on the
same minibatch (:attr:`~sparknet.solvers.SolverType.needs_closure`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from sparknet.solvers import SolverConfig, SolverType, lr_multiplier

__all__ = ["CaffeSGD", "CaffeAdam", "ConjugateGradient", "build_optimizer"]


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
            out.append({"params": params, "lr_mult": float(g.get("lr_mult", 1.0)),
                        "decay_mult": float(g.get("decay_mult", 1.0))})
    if not out:
        raise ValueError("the model has no trainable parameters")
    return out


class _CaffeRule(torch.optim.Optimizer):
    """A Caffe rule: ``_update(p, d, state, group)`` for every weight with a gradient, ``d`` the gradient with the
    weight decay added (Caffe's Regularize, before ComputeUpdateValue)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            wd = group["weight_decay"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad if not wd else p.grad.add(p, alpha=wd), self.state[p], group)
        return loss


class CaffeSGD(_CaffeRule):
    """SGD with momentum as Caffe's ``SGDSolver`` and ``NesterovSolver`` compute it: the history is the step.

    Each update, with ``d = grad + weight_decay * w`` and ``lr`` the group's rate now::

        sgd:       v = momentum * v + lr * d;              w -= v
        nesterov:  v' = momentum * v + lr * d;  w -= (1 + momentum) * v' - momentum * v;  v = v'

    (Caffe's ``sgd_solver.cpp`` and ``nesterov_solver.cpp``). While the rate is constant this is
    ``torch.optim.SGD`` exactly; after a change of rate, the history keeps the steps taken at the old
    rate. The history is kept under ``momentum_buffer``, as ``torch.optim.SGD`` keeps its own.
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "nesterov": nesterov})

    @staticmethod
    def _update(p: torch.Tensor, d: torch.Tensor, state: dict, group: dict) -> None:
        lr, m = group["lr"], group["momentum"]
        v = state.get("momentum_buffer")
        if v is None:
            v = state["momentum_buffer"] = torch.zeros_like(p)
        if group["nesterov"]:  # w -= (1 + m) v' - m v, with no copy of v
            p.add_(v, alpha=m)
            v.mul_(m).add_(d, alpha=lr)
            p.sub_(v, alpha=1 + m)
        else:
            v.mul_(m).add_(d, alpha=lr)
            p.sub_(v)


class CaffeAdam(_CaffeRule):
    """Adam as Caffe's ``AdamSolver`` computes it: ``delta`` joins ``sqrt(v)`` before the bias correction.

    Each update, with ``d = grad + weight_decay * w``, ``t`` the update's number from 1 and ``lr`` the
    group's rate now::

        m = b1 * m + (1 - b1) * d;   v = b2 * v + (1 - b2) * d²
        w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + delta)

    (Caffe's ``adam_solver.cpp``). The moments are kept under ``exp_avg`` and ``exp_avg_sq`` and the
    count under ``step``, as ``torch.optim.Adam`` keeps its own.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @staticmethod
    def _update(p: torch.Tensor, d: torch.Tensor, state: dict, group: dict) -> None:
        lr, (b1, b2), eps = group["lr"], group["betas"], group["eps"]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        t = int(state["step"])
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(d, alpha=1 - b1)
        v.mul_(b2).addcmul_(d, d, value=1 - b2)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))


class _Wrapped(torch.optim.Optimizer):
    """An optimizer around another, sharing its groups and state so schedulers and ``state_dict`` see one."""

    def __init__(self, inner: torch.optim.Optimizer):
        self.inner = inner
        self.param_groups = inner.param_groups
        self.defaults = inner.defaults
        self.state = inner.state

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict):
        self.inner.load_state_dict(state_dict)


class _L1Regularized(_Wrapped):
    """Wraps an optimizer and adds ``weight_decay * sign(w)`` to each gradient (Caffe's L1)."""

    def __init__(self, inner: torch.optim.Optimizer, decays: Sequence[float]):
        super().__init__(inner)
        self._decays = list(decays)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # evaluated here, so the sign joins the gradients it makes
            with torch.enable_grad():
                loss = closure()
        for group, decay in zip(self.param_groups, self._decays):
            if decay:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.add_(torch.sign(p), alpha=decay)
        self.inner.step()
        return loss


class _Penalized(_Wrapped):
    """Wraps a line-search optimizer: the weight-decay penalty joins the loss its closure returns and the gradient.

    The search then lowers the regularised loss itself: ``decay/2 * |w|^2`` (L2, gradient ``decay * w``) or
    ``decay * |w|_1`` (L1, gradient ``decay * sign(w)``), each group with its own ``decay``.
    """

    def __init__(self, inner: torch.optim.Optimizer, penalties: Sequence[tuple[Sequence[torch.Tensor], float]],
                 l1: bool):
        super().__init__(inner)
        self._penalties = [(list(params), decay) for params, decay in penalties if decay]
        self._l1 = l1

    def _penalize(self) -> float:
        """Add the penalty's gradient to every gradient; the penalty."""
        total = 0.0
        for params, decay in self._penalties:
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                if self._l1:
                    total = total + decay * p.abs().sum()
                    p.grad.add_(torch.sign(p), alpha=decay)
                else:
                    total = total + 0.5 * decay * p.square().sum()
                    p.grad.add_(p, alpha=decay)
        return float(total)

    def step(self, closure=None):
        """One step of the inner optimizer on the penalised loss; returns the closure's first loss, unpenalised."""
        if closure is None:
            raise ValueError("this solver's step needs a closure that evaluates the loss again")
        losses = []

        def penalized():
            losses.append(closure())
            with torch.no_grad():
                return losses[-1] + self._penalize()

        self.inner.step(penalized)
        return losses[0]


def _cubic_step(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """The minimiser of the cubic through two trials ``(step, loss, slope)``, kept in the middle 80% between
    them; their midpoint when the cubic has no minimum there or a trial is not finite."""
    (ta, fa, sa), (tb, fb, sb) = a, b
    mid = 0.5 * (ta + tb)
    if ta == tb or not all(math.isfinite(v) for v in (fa, sa, fb, sb)):
        return mid
    d1 = sa + sb - 3.0 * (fa - fb) / (ta - tb)
    disc = d1 * d1 - sa * sb
    if disc < 0:
        return mid
    d2 = math.copysign(math.sqrt(disc), tb - ta)
    denom = sb - sa + 2.0 * d2
    if denom == 0:
        return mid
    t = tb - (tb - ta) * (sb + d2 - d1) / denom
    lo, hi = min(ta, tb), max(ta, tb)
    margin = 0.1 * (hi - lo)
    return min(max(t, lo + margin), hi - margin) if math.isfinite(t) else mid


def _line_search(phi: Callable[[float], tuple[float, float]], f0: float, slope0: float, t: float, *,
                 max_evals: int, c1: float, c2: float) -> tuple[float, float]:
    """A step along a descent direction that meets the strong Wolfe conditions, by bracketing and interpolation.

    ``phi(t)`` gives the loss and the slope (the directional derivative) at step ``t``; ``f0`` and ``slope0 < 0``
    are those at 0, and ``t`` is the first trial. A trial is accepted when it lowers the loss enough,
    ``f(t) <= f0 + c1 * t * slope0``, and the slope has flattened, ``|slope(t)| <= c2 * |slope0|``
    (``0 < c1 < c2 < 1``). Otherwise it narrows a bracket ``[lo, hi]`` that holds such a step: a trial that does
    not lower the loss enough (or is not finite) or that is already uphill becomes ``hi``; one still steeply
    downhill becomes ``lo``. The next trial is four times ``lo`` while nothing bounds the step from above, else
    the minimum of the cubic through ``lo`` and ``hi`` (:func:`_cubic_step`). Returns the step and the loss
    there; after ``max_evals`` calls of ``phi``, the trial with the lowest loss below ``f0``, or ``(0.0, f0)``.
    """
    lo, hi = (0.0, f0, slope0), None
    best = (0.0, f0)
    for _ in range(max_evals):
        f, slope = phi(t)
        finite = math.isfinite(f) and math.isfinite(slope)
        if finite and f < best[1]:
            best = (t, f)
        if not finite or f > f0 + c1 * t * slope0 or f >= lo[1]:
            hi = (t, f, slope)  # not enough decrease: the step lies below t
        elif abs(slope) <= -c2 * slope0:
            return t, f
        elif slope > 0:
            hi = (t, f, slope)  # past a minimum
        else:
            lo = (t, f, slope)  # still steeply downhill
        t = 4.0 * lo[0] if hi is None else _cubic_step(lo, hi)
    return best


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class ConjugateGradient(torch.optim.Optimizer):
    """Nonlinear conjugate gradient, Polak-Ribiere+, with automatic restarts and a line search.

    ``torch.optim`` has no conjugate gradient; this one follows Nocedal and Wright (*Numerical Optimization*,
    2nd ed., sections 3.5 and 5.2). Like ``torch.optim.LBFGS``, :meth:`step` takes a closure that zeroes the
    gradients, evaluates the loss on the same data, calls ``backward()`` and returns the loss. One step is one
    update:

    1. the loss ``f`` and the gradient ``g`` at the current weights, and the scaled gradient ``z``: ``g`` times
       each group's ``lr``, so ``-z`` is SGD's step and a net's ``lr_mult`` ratios act as a diagonal
       preconditioner;
    2. the direction ``d = -z + beta * d_prev`` with ``beta = max(0, z.(g - g_prev) / (z_prev.g_prev))``
       (Polak-Ribiere+); ``d = -z`` (a restart) at the first step, every ``restart`` steps, and whenever
       ``d`` does not point downhill (``g.d >= 0``);
    3. a line search along ``d`` (:func:`_line_search`, strong Wolfe conditions) whose first trial is ``t = 1``
       (SGD's step) at the first step and after a failed search, else the previous step times the ratio of the
       previous slope ``g_prev.d_prev`` to this one ``g.d`` (at most tenfold), Nocedal and Wright's rule. The
       weights move to ``w + t * d``; when no trial within ``max_evals`` lowers the loss they stay, and the
       next step restarts.

    The loss is evaluated again at the start of every step, so each step may bring a new minibatch (as
    :meth:`sparknet.Net.train` does): ``d_prev`` and ``g_prev`` then come from the previous minibatch, which
    large batches keep close to the full-batch method. Its state (tensors and numbers) lives under the first
    parameter, so ``state_dict()`` saves with ``torch.save`` and loads with ``torch.load(weights_only=True)``.

    Parameters
    ----------
    params : iterable of tensors or of parameter groups
        Groups may set their own ``lr``.
    lr : float
        Scale of the gradient in the direction (SGD's learning rate for the first trial step).
    restart : int
        Steps between scheduled restarts.
    max_evals : int
        Most loss evaluations of one line search.
    c1, c2 : float
        The sufficient-decrease and curvature constants of the strong Wolfe conditions, ``0 < c1 < c2 < 1``
        (0.1 for ``c2``, a fairly exact search, is what conjugate gradient usually takes).
    """

    def __init__(self, params, lr: float = 0.01, *, restart: int = 50, max_evals: int = 10, c1: float = 1e-4,
                 c2: float = 0.1):
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if restart < 1 or max_evals < 1:
            raise ValueError(f"restart and max_evals must be at least 1, got {restart} and {max_evals}")
        if not 0 < c1 < c2 < 1:
            raise ValueError(f"the line search needs 0 < c1 < c2 < 1, got c1={c1}, c2={c2}")
        super().__init__(params, {"lr": lr, "restart": restart, "max_evals": max_evals, "c1": c1, "c2": c2})
        self._params = [p for group in self.param_groups for p in group["params"]]

    def _grad(self) -> torch.Tensor:
        return _flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params])

    def _lr(self) -> torch.Tensor:
        """Each parameter's group ``lr``, as one flat vector."""
        return torch.cat([torch.full((p.numel(),), float(group["lr"]), dtype=p.dtype, device=p.device)
                          for group in self.param_groups for p in group["params"]])

    def _move(self, x0: torch.Tensor, t: float, d: torch.Tensor) -> None:
        """Set the weights to ``x0 + t * d``."""
        offset = 0
        for p in self._params:
            n = p.numel()
            p.copy_(x0[offset:offset + n].view_as(p)).add_(d[offset:offset + n].view_as(p), alpha=t)
            offset += n

    def _direction(self, state: dict, g: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Polak-Ribiere+ from the previous direction, or ``-z`` when it is time to restart."""
        d_prev = state.get("direction")
        if d_prev is not None and state["since_restart"] < self.defaults["restart"]:
            beta = max(0.0, float(z.dot(g - state["prev_grad"])) / state["prev_zg"])
            d = torch.add(-z, d_prev, alpha=beta)
            if float(g.dot(d)) < 0:
                return d
        state["since_restart"] = 0
        return -z

    @torch.no_grad()
    def step(self, closure=None):
        """One update; ``closure`` re-evaluates the loss with its gradients. Returns the loss before the update."""
        if closure is None:
            raise ValueError("ConjugateGradient.step needs a closure that re-evaluates the loss and its gradients "
                             "(as torch.optim.LBFGS does)")
        closure = torch.enable_grad()(closure)
        state = self.state[self._params[0]]
        options = self.defaults
        loss = closure()
        f0 = float(loss)
        g = self._grad()
        state["func_evals"] = state.get("func_evals", 0) + 1
        state["n_iter"] = state.get("n_iter", 0) + 1
        z = g * self._lr()
        zg = float(z.dot(g))
        if not (math.isfinite(f0) and math.isfinite(zg)) or zg == 0:
            state.pop("direction", None)  # nothing to search along: restart at the next step
            return loss
        d = self._direction(state, g, z)
        slope = float(g.dot(d))
        prev_step = state.get("prev_step")
        t = 1.0 if prev_step is None else prev_step * min(10.0, state["prev_slope"] / slope)
        x0 = _flat([p.detach() for p in self._params])

        def phi(step: float) -> tuple[float, float]:
            self._move(x0, step, d)
            state["func_evals"] += 1
            return float(closure()), float(self._grad().dot(d))

        t, _ = _line_search(phi, f0, slope, t, max_evals=options["max_evals"], c1=options["c1"], c2=options["c2"])
        self._move(x0, t, d)
        if t > 0:
            state.update(direction=d, prev_grad=g, prev_zg=zg, prev_slope=slope, prev_step=t,
                         since_restart=state["since_restart"] + 1)
        else:
            for key in ("direction", "prev_grad", "prev_step"):
                state.pop(key, None)
        return loss


def _line_search_optimizer(config: SolverConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """The conjugate-gradient or L-BFGS optimizer over ``groups`` (``params`` and ``lr`` each)."""
    if config.type is SolverType.CG:
        return ConjugateGradient(groups, lr=config.base_lr, restart=config.cg_restart,
                                 max_evals=config.line_search_evals)
    rates = sorted({g["lr"] for g in groups})
    if len(rates) > 1:
        raise ValueError(f"the lbfgs solver takes one learning rate for all parameters (torch.optim.LBFGS has no "
                         f"parameter groups), but this net's layers set lr_mult to make {rates}: give every layer "
                         "the same lr_mult, or use the cg solver, which honours them")
    # One iteration per step; max_eval counts the step's first evaluation, then the line search's.
    return torch.optim.LBFGS([p for g in groups for p in g["params"]], lr=rates[0], max_iter=1,
                             max_eval=1 + config.line_search_evals, history_size=config.history_size,
                             line_search_fn="strong_wolfe")


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
        torch_groups.append({"params": g["params"], "lr": config.base_lr * g["lr_mult"],
                             "weight_decay": 0.0 if l1 else decay})
    t = config.type
    if t.needs_closure:
        # The penalty joins the loss the line search lowers: no weight_decay inside the optimizer.
        opt = _line_search_optimizer(config, [{"params": g["params"], "lr": g["lr"]} for g in torch_groups])
        penalties = [(g["params"], config.weight_decay * g["decay_mult"]) for g in groups]
        if any(decay for _, decay in penalties):
            opt = _Penalized(opt, penalties, l1)
    else:
        sgd = CaffeSGD if config.caffe_history else torch.optim.SGD
        adam = dict(betas=(config.momentum, config.momentum2), eps=config.delta)
        kind, options = {
            SolverType.SGD: (sgd, dict(momentum=config.momentum)),
            SolverType.NESTEROV: (sgd, dict(momentum=config.momentum, nesterov=True)),
            SolverType.ADAM: (CaffeAdam if config.caffe_delta else torch.optim.Adam, adam),
            SolverType.ADAMW: (torch.optim.AdamW, adam),
            SolverType.RMSPROP: (torch.optim.RMSprop, dict(alpha=config.rms_decay, eps=config.delta)),
            SolverType.ADAGRAD: (torch.optim.Adagrad, dict(eps=config.delta)),
            SolverType.ADADELTA: (torch.optim.Adadelta, dict(rho=config.momentum, eps=config.delta)),
        }[t]
        opt = kind(torch_groups, lr=config.base_lr, **options)
    if l1 and any(decays) and not t.needs_closure:
        opt = _L1Regularized(opt, decays)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_multiplier(config, it))
    return opt, scheduler
