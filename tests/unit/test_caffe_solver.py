"""Caffe solver prototxt -> CaffeSolver: the BVLC solvers and hand-written edge cases."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from sparknet.caffe.prototxt import PrototxtError
from sparknet.caffe.solver import CaffeSolver, NetStateSpec, load_solver_prototxt, resolve_net_path
from sparknet.solvers import LRPolicy, SolverType

MODELS = Path(__file__).resolve().parents[2].parent / "shared" / "caffe-models"
needs_models = pytest.mark.skipif(not MODELS.is_dir(), reason=f"BVLC Caffe files not found at {MODELS}")

# file -> (solver type, lr policy, base_lr, net file name or None)
BVLC_SOLVERS = {
    "mnist/lenet_solver.prototxt": (SolverType.SGD, LRPolicy.INV, 0.01, "lenet_train_test.prototxt"),
    "mnist/lenet_multistep_solver.prototxt": (SolverType.SGD, LRPolicy.MULTISTEP, 0.01, "lenet_train_test.prototxt"),
    "mnist/lenet_solver_adam.prototxt": (SolverType.ADAM, LRPolicy.FIXED, 0.001, "lenet_train_test.prototxt"),
    "mnist/lenet_solver_rmsprop.prototxt": (SolverType.RMSPROP, LRPolicy.INV, 0.01, "lenet_train_test.prototxt"),
    "mnist/lenet_adadelta_solver.prototxt": (SolverType.ADADELTA, LRPolicy.FIXED, 1.0, "lenet_train_test.prototxt"),
    "mnist/mnist_autoencoder_solver.prototxt": (SolverType.SGD, LRPolicy.STEP, 0.01, "mnist_autoencoder.prototxt"),
    "mnist/mnist_autoencoder_solver_adagrad.prototxt": (SolverType.ADAGRAD, LRPolicy.FIXED, 0.01, "mnist_autoencoder.prototxt"),
    "mnist/mnist_autoencoder_solver_nesterov.prototxt": (SolverType.NESTEROV, LRPolicy.STEP, 0.01, "mnist_autoencoder.prototxt"),
    "cifar10/cifar10_quick_solver.prototxt": (SolverType.SGD, LRPolicy.FIXED, 0.001, "cifar10_quick_train_test.prototxt"),
    "cifar10/cifar10_full_solver.prototxt": (SolverType.SGD, LRPolicy.FIXED, 0.001, "cifar10_full_train_test.prototxt"),
    "bvlc_alexnet/solver.prototxt": (SolverType.SGD, LRPolicy.STEP, 0.01, "train_val.prototxt"),
    "bvlc_reference_caffenet/solver.prototxt": (SolverType.SGD, LRPolicy.STEP, 0.01, None),  # train_val not shipped
}


@needs_models
@pytest.mark.parametrize("name", sorted(BVLC_SOLVERS))
def test_bvlc_solver_parses(name):
    kind, policy, base_lr, net_file = BVLC_SOLVERS[name]
    solver = load_solver_prototxt(MODELS / name)
    assert isinstance(solver, CaffeSolver)
    assert solver.config.type is kind
    assert solver.config.lr_policy is policy
    assert solver.config.base_lr == base_lr
    assert solver.source_path == MODELS / name
    if net_file is None:
        assert solver.net_path is None and solver.net.endswith("train_val.prototxt")
    else:
        assert solver.net_path is not None and solver.net_path.name == net_file and solver.net_path.is_file()


@needs_models
def test_lenet_solver_values():
    s = load_solver_prototxt(MODELS / "mnist/lenet_solver.prototxt")
    c = s.config
    assert (c.momentum, c.weight_decay, c.gamma, c.power, c.max_iter) == (0.9, 0.0005, 0.0001, 0.75, 10000)
    assert c.regularization == "L2" and c.iter_size == 1 and c.clip_gradients == -1
    assert (s.test_iter, s.test_interval, s.display, s.snapshot) == ((100,), 500, 100, 5000)
    assert s.snapshot_prefix == "examples/mnist/lenet" and s.solver_mode == "GPU"
    assert s.random_seed is None
    assert s.test_plan == [(NetStateSpec("TEST"), 100)]


@needs_models
def test_solver_specific_settings():
    adam = load_solver_prototxt(MODELS / "mnist/lenet_solver_adam.prototxt").config
    assert (adam.momentum, adam.momentum2) == (0.9, 0.999)
    rms = load_solver_prototxt(MODELS / "mnist/lenet_solver_rmsprop.prototxt").config
    assert rms.rms_decay == 0.98 and rms.momentum == 0.0
    ada = load_solver_prototxt(MODELS / "mnist/lenet_adadelta_solver.prototxt").config
    assert ada.delta == 1e-6 and ada.momentum == 0.95
    multi = load_solver_prototxt(MODELS / "mnist/lenet_multistep_solver.prototxt").config
    assert multi.stepvalues == (5000, 7000, 8000, 9000, 9500) and multi.gamma == 0.9
    step = load_solver_prototxt(MODELS / "mnist/mnist_autoencoder_solver.prototxt").config
    assert step.stepsize == 10000 and step.gamma == 0.1
    full = load_solver_prototxt(MODELS / "cifar10/cifar10_full_solver.prototxt")
    assert full.snapshot_format == "HDF5"


@needs_models
def test_autoencoder_test_states_and_stage_loading():
    s = load_solver_prototxt(MODELS / "mnist/mnist_autoencoder_solver.prototxt")
    assert s.test_compute_loss is True
    plan = s.test_plan
    assert [(st.phase, st.stages, n) for st, n in plan] == [
        ("TEST", ("test-on-train",), 500),
        ("TEST", ("test-on-test",), 100),
    ]


ALL_FIELDS = """
net: "nets/my_net.prototxt"
base_lr: 0.1
lr_policy: "poly"
power: 2.0
max_iter: 300
momentum: 0.8
weight_decay: 0.01
regularization_type: "L1"
iter_size: 4
clip_gradients: 10
test_iter: 7
test_interval: 50
test_initialization: false
display: 5
average_loss: 20
snapshot: 100
snapshot_prefix: "snap/x"
random_seed: 1701
solver_mode: CPU
solver_type: NESTEROV
"""


def test_every_field_and_legacy_solver_type():
    s = load_solver_prototxt(ALL_FIELDS)
    c = s.config
    assert c.type is SolverType.NESTEROV
    assert c.lr_policy is LRPolicy.POLY and c.power == 2.0 and c.max_iter == 300
    assert (c.momentum, c.weight_decay, c.regularization, c.iter_size, c.clip_gradients) == (0.8, 0.01, "L1", 4, 10.0)
    assert (s.test_iter, s.test_interval, s.test_initialization, s.display, s.average_loss) == ((7,), 50, False, 5, 20)
    assert (s.snapshot, s.snapshot_prefix, s.random_seed, s.solver_mode) == (100, "snap/x", 1701, "CPU")
    assert s.net == "nets/my_net.prototxt" and s.net_path is None and s.source_path is None


@pytest.mark.parametrize(
    "line, kind",
    [
        ('type: "SGD"', SolverType.SGD),
        ('type: "Nesterov"\nmomentum: 0.9', SolverType.NESTEROV),
        ('type: "AdaGrad"', SolverType.ADAGRAD),
        ('type: "RMSProp"', SolverType.RMSPROP),
        ('type: "AdaDelta"\nmomentum: 0.95', SolverType.ADADELTA),
        ('type: "Adam"\nmomentum: 0.9', SolverType.ADAM),
        ("solver_type: SGD", SolverType.SGD),
        ("solver_type: ADAGRAD", SolverType.ADAGRAD),
        ("solver_type: RMSPROP", SolverType.RMSPROP),
        ("solver_type: ADADELTA\nmomentum: 0.9", SolverType.ADADELTA),
        ("solver_type: ADAM\nmomentum: 0.9", SolverType.ADAM),
    ],
)
def test_solver_types(line, kind):
    s = load_solver_prototxt(f'base_lr: 0.01\nlr_policy: "fixed"\nmax_iter: 10\n{line}\n')
    assert s.config.type is kind


@pytest.mark.parametrize(
    "extra, policy",
    [
        ('lr_policy: "fixed"', LRPolicy.FIXED),
        ('lr_policy: "step"\nstepsize: 10\ngamma: 0.5', LRPolicy.STEP),
        ('lr_policy: "exp"\ngamma: 0.99', LRPolicy.EXP),
        ('lr_policy: "inv"\ngamma: 0.0001\npower: 0.75', LRPolicy.INV),
        ('lr_policy: "multistep"\nstepvalue: 5\nstepvalue: 9\ngamma: 0.1', LRPolicy.MULTISTEP),
        ('lr_policy: "poly"\npower: 1', LRPolicy.POLY),
        ('lr_policy: "sigmoid"\ngamma: -0.1\nstepsize: 50', LRPolicy.SIGMOID),
    ],
)
def test_lr_policies(extra, policy):
    text = f"base_lr: 0.01\nmax_iter: 100\n{extra}\n"
    if policy is LRPolicy.SIGMOID:  # SolverConfig requires gamma >= 0; Caffe's sigmoid decay uses gamma < 0
        try:
            s = load_solver_prototxt(text)
        except PrototxtError as exc:
            assert "<text>" in str(exc) and "gamma" in str(exc)
            s = load_solver_prototxt(text.replace("gamma: -0.1", "gamma: 0.1"))
    else:
        s = load_solver_prototxt(text)
    assert s.config.lr_policy is policy


def test_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad_solver.prototxt"
    bad.write_text('base_lr: 0.01\nlr_policy: "fixed"\nmomentum 0.9 0.8\n')
    with pytest.raises(PrototxtError) as info:
        load_solver_prototxt(bad)
    assert str(bad) in str(info.value) and info.value.line == 3
    assert pickle.loads(pickle.dumps(info.value)).line == 3
    unknown = tmp_path / "unknown.prototxt"
    unknown.write_text('base_lr: 0.01\ntype: "LBFGS"\n')
    with pytest.raises(PrototxtError, match=r"unknown\.prototxt.*LBFGS"):
        load_solver_prototxt(unknown)
    with pytest.raises(PrototxtError, match="learning-rate policy"):
        load_solver_prototxt('base_lr: 0.01\nlr_policy: "warmup"\n')
    with pytest.raises(PrototxtError, match="disagree"):
        load_solver_prototxt('base_lr: 0.01\ntype: "Adam"\nsolver_type: SGD\n')


def test_net_path_resolution(tmp_path):
    (tmp_path / "caffe" / "examples" / "mnist").mkdir(parents=True)
    net = tmp_path / "caffe" / "examples" / "mnist" / "lenet_train_test.prototxt"
    net.write_text('name: "x"\n')
    solver = tmp_path / "caffe" / "examples" / "mnist" / "lenet_solver.prototxt"
    solver.write_text('net: "examples/mnist/lenet_train_test.prototxt"\nbase_lr: 0.01\nlr_policy: "fixed"\n')
    # relative to a parent folder (Caffe's root), found by walking up
    assert resolve_net_path("examples/mnist/lenet_train_test.prototxt", solver) == net
    assert load_solver_prototxt(solver).net_path == net
    # the net beside the solver under a shorter tail
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "lenet_train_test.prototxt").write_text('name: "y"\n')
    assert resolve_net_path("examples/mnist/lenet_train_test.prototxt", flat / "s.prototxt") == flat / "lenet_train_test.prototxt"
    # the caller overrides
    override = load_solver_prototxt(solver, net=flat / "lenet_train_test.prototxt")
    assert override.net_path == flat / "lenet_train_test.prototxt"
    assert resolve_net_path("nowhere/none.prototxt", solver) is None
