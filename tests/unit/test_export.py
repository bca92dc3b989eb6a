"""Export for serving outside Spark: ONNX (checked and run) and TorchScript (round trip)."""

import importlib.util
import warnings

import numpy as np
import onnx
import pytest
import torch

from sparknet import Net, zoo
from sparknet.model_io import save_model
from sparknet.cli import main
from sparknet.tools.export import export_model, export_onnx, export_torchscript, verify_onnx


@pytest.fixture(scope="module")
def lenet():
    return zoo.lenet().build(seed=3).eval()


def _jit_load(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.jit.load(str(path))


def _onnx_outputs(path, x):
    """Outputs of the ONNX file: ONNX Runtime when installed, else onnx's reference evaluator."""
    feed = x.numpy()
    if importlib.util.find_spec("onnxruntime") is not None:
        import onnxruntime as ort

        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return sess.run(None, {sess.get_inputs()[0].name: feed})[0]
    from onnx.reference import ReferenceEvaluator

    model = onnx.load(str(path))
    return ReferenceEvaluator(model).run(None, {model.graph.input[0].name: feed})[0]


def test_lenet_onnx_passes_the_checker_and_matches_torch(lenet, tmp_path):
    path = export_onnx(lenet, torch.zeros(2, 1, 28, 28), tmp_path / "lenet.onnx")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    # the batch dimension is free: one exported file serves any batch size
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [1, 28, 28]
    x = torch.rand(7, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = lenet(x).numpy()
    got = _onnx_outputs(path, x)
    assert got.shape == (7, 10)
    np.testing.assert_allclose(got, expected, atol=1e-5, rtol=0)
    assert verify_onnx(path, lenet, x) < 1e-5


def test_export_restores_training_mode(tmp_path):
    module = zoo.lenet().build(seed=0).train()
    export_onnx(module, torch.zeros(2, 1, 28, 28), tmp_path / "m.onnx")
    export_torchscript(module, torch.zeros(2, 1, 28, 28), tmp_path / "m.pt")
    assert module.training


def test_torchscript_round_trip_is_exact(lenet, tmp_path):
    path = export_torchscript(lenet, torch.zeros(2, 1, 28, 28), tmp_path / "lenet.pt")
    loaded = _jit_load(path)
    x = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(x), lenet(x))


def test_lstm_net_exports_with_integer_input(tmp_path):
    module = zoo.char_lstm(vocab_size=12, seq_len=6, hidden=8, num_layers=1).build(seed=0).eval()
    x = torch.randint(0, 12, (4, 6), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's notes on LSTM batch sizes and tracing; checked below
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        path = export_onnx(module, torch.zeros(2, 6, dtype=torch.long), tmp_path / "lstm.onnx")
    assert verify_onnx(path, module, x) < 1e-5


def test_export_command_from_a_model_folder(tmp_path, capsys):
    net = Net(zoo.mlp(input_shape=[1, 6, 6], hidden=[16], num_classes=4), seed=0)
    folder = save_model(tmp_path / "model", net)
    onnx_out = tmp_path / "out" / "mlp.onnx"
    assert main(["export", "--model-dir", str(folder), "--format", "onnx", "--out", str(onnx_out), "--verify"]) == 0
    assert capsys.readouterr().out.strip() == str(onnx_out)
    onnx.checker.check_model(onnx.load(str(onnx_out)))
    ts_out = export_model(folder, "torchscript", tmp_path / "out" / "mlp.pt", verify=True)
    x = torch.rand(3, 1, 6, 6)
    with torch.no_grad():
        assert torch.equal(_jit_load(ts_out)(x), net.module.eval()(x))


def test_bad_export_requests_are_clear(tmp_path, lenet):
    with pytest.raises(ValueError, match="unknown export format"):
        export_model(tmp_path, "tflite", tmp_path / "x")
    with pytest.raises(ValueError, match="exporter"):
        export_onnx(lenet, torch.zeros(2, 1, 28, 28), tmp_path / "x.onnx", exporter="tf2onnx")
    assert main(["export", "--model-dir", str(tmp_path / "nope"), "--format", "onnx", "--out", "x.onnx"]) == 2


def test_dynamo_exporter_when_onnxscript_is_installed(lenet, tmp_path):
    """The optional torch.export-based exporter (needs onnxscript, not part of the [onnx] extra)."""
    if importlib.util.find_spec("onnxscript") is None:
        with pytest.raises(ValueError, match="onnxscript"):
            export_onnx(lenet, torch.zeros(2, 1, 28, 28), tmp_path / "d.onnx", exporter="dynamo")
        return
    path = export_onnx(lenet, torch.zeros(2, 1, 28, 28), tmp_path / "d.onnx", exporter="dynamo")
    assert verify_onnx(path, lenet, torch.rand(5, 1, 28, 28)) < 1e-5
