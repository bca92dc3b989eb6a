"""The line-search solvers: nonlinear conjugate gradient (cg) and L-BFGS (lbfgs), alone and inside Net.train."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch

from sparknet.cli import build_parser
from sparknet.config import RunConfig
from sparknet.net import Net
from sparknet.optimizers import ConjugateGradient, _line_search, build_optimizer
from sparknet.solvers import SolverConfig, SolverType

LINE_SEARCH = [SolverType.CG, SolverType.LBFGS]
FIRST_STEP = {SolverType.CG: 0.1, SolverType.LBFGS: 1.0}  # cg: SGD's rate; lbfgs: the quasi-Newton step


def _quadratic(n: int = 30, condition: float = 1e4):
    """``f(x) = x'Ax/2 - b'x`` with eigenvalues spread log-evenly over [1, condition]; A, b, f(x*)."""
    g = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(0, math.log10(condition), n, dtype=torch.float64)) @ q.T
    b = torch.randn(n, generator=g, dtype=torch.float64)
    return a, b, float(-0.5 * b @ torch.linalg.solve(a, b))


def _evaluations_to(opt, x, a, b, f_star: float, gap: float, most: int, every: int = 1) -> int | None:
    """Step ``opt`` until ``(f(x) - f*) / (f(0) - f*)`` is below ``gap`` (looked at every ``every`` steps and at the
    end): the evaluations of f it took (None: more than ``most``). f(0) = 0."""
    count = 0

    def closure():
        nonlocal count
        count += 1
        opt.zero_grad()
        f = 0.5 * x @ a @ x - b @ x
        f.backward()
        return f

    for step in range(1, most + 1):  # every step evaluates f at least once
        opt.step(closure)
        if step % every and count < most:
            continue
        with torch.no_grad():
            if (float(0.5 * x @ a @ x - b @ x) - f_star) / -f_star < gap:
                return count
        if count >= most:
            return None
    return None


def test_cg_minimises_an_ill_conditioned_quadratic_far_faster_than_sgd_at_its_best_rate():
    a, b, f_star = _quadratic()
    x = torch.zeros(len(b), dtype=torch.float64, requires_grad=True)
    cg = ConjugateGradient([x], lr=1e-4)
    cg_evaluations = _evaluations_to(cg, x, a, b, f_star, 1e-6, most=1500)
    assert cg_evaluations is not None and cg.state[x]["func_evals"] == cg_evaluations

    # gradient descent with ten times the evaluations, at 1/L and at its best fixed rate 2/(L + mu) (its loss
    # falls at every step, so a look at the end is enough)
    eigenvalues = torch.linalg.eigvalsh(a)
    smallest, largest = float(eigenvalues[0]), float(eigenvalues[-1])
    for rate in (1 / largest, 2 / (largest + smallest)):
        x = torch.zeros(len(b), dtype=torch.float64, requires_grad=True)
        sgd, _ = build_optimizer([x], SolverConfig(base_lr=rate, momentum=0.0))
        assert _evaluations_to(sgd, x, a, b, f_star, 1e-6, most=10 * cg_evaluations, every=10 * cg_evaluations) is None, rate


def test_line_search_meets_the_strong_wolfe_conditions_and_keeps_the_best_step():
    def phi(t):  # (t - 3)^2: minimum at 3
        return (t - 3.0) ** 2, 2.0 * (t - 3.0)

    t, f = _line_search(phi, 9.0, -6.0, 0.1, max_evals=10, c1=1e-4, c2=0.1)
    assert abs(2.0 * (t - 3.0)) <= 0.1 * 6.0 and f <= 9.0 - 1e-4 * t * 6.0  # found by extrapolating, then the cubic
    # uphill everywhere (a wrong slope at 0): no trial lowers the loss, the step is 0
    t, f = _line_search(lambda t: (1.0 + t, 1.0), 1.0, -1.0, 1.0, max_evals=5, c1=1e-4, c2=0.1)
    assert (t, f) == (0.0, 1.0)
    # a loss that is NaN beyond 0.5: the search shrinks into where it is finite
    t, _ = _line_search(lambda t: (float("nan"), float("nan")) if t > 0.5 else ((t - 0.4) ** 2, 2 * (t - 0.4)),
                        0.16, -0.8, 4.0, max_evals=20, c1=1e-4, c2=0.1)
    assert 0 < t <= 0.5


def _blobs(n: int = 240, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    centers = np.array([[2.0, 0.0], [-2.0, 0.0], [0.0, 2.5]], dtype=np.float32)
    return (centers[y] + rng.normal(0, 0.8, (n, 2))).astype(np.float32), y.astype(np.int64)


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(2, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _net(solver: SolverConfig, *, batch_size: int = 60, seed: int = 0, data=None, shuffle: bool = True,
         **kw) -> Net:
    net = Net(_mlp(seed), solver, batch_size=batch_size, seed=seed, **kw)
    net.set_training_data(data if data is not None else _blobs(), shuffle=shuffle)
    net.set_validation_data(_blobs(300, seed=1))
    return net


@pytest.mark.parametrize("solver_type", LINE_SEARCH)
def test_a_small_mlp_learns(solver_type):
    net = _net(SolverConfig(type=solver_type, base_lr=FIRST_STEP[solver_type]))
    first = net.evaluate().loss
    stats = net.train(40)
    assert stats.steps == 40 and stats.finite and stats.samples == 40 * 60
    assert net.evaluate().loss < 0.5 * first
    assert net.test() > 0.9
    evals = net.optimizer.state[next(net.module.parameters())]["func_evals"]
    assert 40 * 2 <= evals <= 40 * 12  # a start and at least one trial per step, at most 1 + line_search_evals


@pytest.mark.parametrize("solver_type", LINE_SEARCH)
def test_solver_state_round_trips_through_torch_save_and_load_with_weights_only(solver_type):
    solver = SolverConfig(type=solver_type, base_lr=FIRST_STEP[solver_type], weight_decay=1e-3)
    whole = _net(solver)
    whole.train(15)

    first = _net(solver)
    first.train(7)
    buffer = io.BytesIO()
    torch.save({"weights": first.get_weights().to_flat(), "solver": first.solver_state()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = _net(solver, seed=5)  # other initial weights and data order: all must come from the checkpoint
    resumed.set_flat(saved["weights"])
    resumed.load_solver_state(saved["solver"])
    resumed.train(8)
    assert torch.equal(resumed.get_flat(), whole.get_flat())

    # the solver's memory matters: the same weights without it continue elsewhere
    forgetful = _net(solver)
    forgetful.set_flat(saved["weights"])
    state = copy.deepcopy(saved["solver"])
    state["optimizer"]["state"] = {}
    forgetful.load_solver_state(state)
    forgetful.train(8)
    assert not torch.allclose(forgetful.get_flat(), whole.get_flat(), atol=1e-6)


@pytest.mark.parametrize("solver_type", LINE_SEARCH)
def test_the_closure_honours_iter_size(solver_type):
    # shuffle off: two minibatches of 8 are the same 16 rows as one minibatch of 16, and the same mean loss
    data = _blobs(64)
    solver = SolverConfig(type=solver_type, base_lr=FIRST_STEP[solver_type])
    one = _net(solver, batch_size=16, data=data, shuffle=False)
    two = _net(solver.replace(iter_size=2), batch_size=8, data=data, shuffle=False)
    s1, s2 = one.train(6), two.train(6)
    assert s1.samples == s2.samples == 6 * 16
    assert s2.loss == pytest.approx(s1.loss, rel=1e-5)
    assert torch.allclose(one.get_flat(), two.get_flat(), atol=1e-5)
    # ...and not the same as one minibatch of 8 per step
    half = _net(solver, batch_size=8, data=data, shuffle=False)
    half.train(6)
    assert not torch.allclose(half.get_flat(), two.get_flat(), atol=1e-3)


@pytest.mark.parametrize("solver_type", LINE_SEARCH)
def test_the_closure_honours_sample_weights(solver_type):
    # weight 0 on every other row: each step is the step on the weighted rows alone
    x, y = _blobs(64)
    w = np.tile([1.0, 0.0], 32).astype(np.float32)
    solver = SolverConfig(type=solver_type, base_lr=FIRST_STEP[solver_type])
    weighted = _net(solver, batch_size=16, data=(x, np.stack([y, w], 1).astype(np.float32)), shuffle=False,
                    weighted=True)
    kept = _net(solver, batch_size=8, data=(x[::2], y[::2]), shuffle=False)
    weighted.train(6)
    kept.train(6)
    assert torch.allclose(weighted.get_flat(), kept.get_flat(), atol=1e-5)


@pytest.mark.parametrize("solver_type", LINE_SEARCH)
def test_weight_decay_is_part_of_the_loss_the_search_lowers(solver_type):
    # ridge regression, full batch: mean((Xw - y)^2) + decay/2 |w|^2 has the closed-form minimum below
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 5, generator=g)
    y = x @ torch.randn(5, generator=g) + 0.1 * torch.randn(64, generator=g)
    decay = 0.5
    ridge = torch.linalg.solve(2 / 64 * x.T @ x + decay * torch.eye(5), 2 / 64 * x.T @ y)
    linear = torch.nn.Linear(5, 1, bias=False)
    torch.nn.init.zeros_(linear.weight)  # made before Net seeds anything: a start of torch's global generator's
    # (whatever the tests before drew) ended 60 searches from 3e-6 to 1.1e-4 away from the minimum
    net = Net(linear, SolverConfig(type=solver_type, base_lr=FIRST_STEP[solver_type], weight_decay=decay),
              loss=torch.nn.MSELoss(), batch_size=64, seed=0)
    net.set_training_data((x.numpy(), y.numpy()), shuffle=False)
    net.train(60)
    assert torch.allclose(net.module.weight.detach()[0], ridge, atol=1e-4)
    assert not torch.allclose(ridge, torch.linalg.lstsq(x, y[:, None]).solution[:, 0], atol=1e-2)  # decay mattered


@pytest.mark.parametrize("solver_type", LINE_SEARCH)
def test_a_per_step_gradient_hook_is_refused(solver_type):
    net = _net(SolverConfig(type=solver_type))
    with pytest.raises(ValueError, match="line search.*local solver of averaging rounds"):
        net.train(1, after_backward=lambda _: None)
    assert net.iteration == 0
    net.train(1)  # without the hook it trains
    assert net.iteration == 1


def test_settings_a_line_search_cannot_honour_are_clear_errors():
    with pytest.raises(ValueError, match="clip_gradients"):
        SolverConfig(type="cg", clip_gradients=10.0)
    for name in ("line_search_evals", "cg_restart", "history_size"):
        with pytest.raises(ValueError, match=name):
            SolverConfig(type="cg", **{name: 0})
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    groups = [{"params": [a], "lr_mult": 1.0}, {"params": [b], "lr_mult": 2.0}]
    with pytest.raises(ValueError, match="lr_mult"):
        build_optimizer(groups, SolverConfig(type="lbfgs"))
    build_optimizer(groups, SolverConfig(type="cg"))  # cg takes the ratios as a diagonal preconditioner
    with pytest.raises(ValueError, match="closure"):
        ConjugateGradient([a]).step()


def test_the_command_line_takes_the_line_search_solvers():
    assert [m.needs_closure for m in SolverType] == [m in LINE_SEARCH for m in SolverType]
    for name in ("cg", "lbfgs"):
        args = build_parser().parse_args(["train", "--solver-type", name, "--lr", "0.5"])
        solver = RunConfig(solver_type=args.solver_type, lr=args.lr).solver()
        assert solver.type is SolverType(name) and solver.base_lr == 0.5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--solver-type", "newton"])
