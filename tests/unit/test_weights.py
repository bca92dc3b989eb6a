"""WeightCollection: arithmetic, means, flat buffers, files and mismatches."""

import pytest
import torch

from sparknet.weights import WeightCollection


def wc(scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return WeightCollection({
        "conv1": [torch.randn(4, 1, 3, 3, generator=g, dtype=dtype) * scale, torch.randn(4, generator=g, dtype=dtype) * scale],
        "ip1": [torch.randn(10, 36, generator=g, dtype=dtype) * scale, torch.randn(10, generator=g, dtype=dtype) * scale],
    })


def test_arithmetic_is_layerwise():
    a, b = wc(1.0), wc(2.0)
    assert ((a + b) - b).allclose(a)
    assert (a * 3).allclose(a + a + a)
    assert (3 * a).allclose(a * 3)
    assert (b / 2).allclose(a)
    assert (-a + a).max_abs_diff(a.zeros_like()) == 0.0


def test_weighted_mean_matches_formula():
    a, b = wc(1.0), wc(5.0)
    m = WeightCollection.mean([a, b], weights=[3, 1])
    expected = (a * 3 + b * 1) / 4
    assert m.allclose(expected, atol=1e-6)
    assert WeightCollection.mean([a, b]).allclose((a + b) / 2, atol=1e-6)


def test_mean_rejects_bad_weights():
    a = wc()
    with pytest.raises(ValueError, match="weights"):
        WeightCollection.mean([a, a], weights=[1])
    with pytest.raises(ValueError, match="non-negative"):
        WeightCollection.mean([a, a], weights=[1, -1])
    with pytest.raises(ValueError, match="zero"):
        WeightCollection.mean([a, a], weights=[0, 0])
    with pytest.raises(ValueError, match="no WeightCollections"):
        WeightCollection.mean([])


def test_flat_round_trip_and_nbytes():
    a = wc()
    flat = a.to_flat()
    assert flat.dim() == 1 and flat.is_contiguous()
    assert flat.numel() == a.numel == 4 * 9 + 4 + 360 + 10
    assert a.nbytes == a.numel * 4
    b = WeightCollection.from_flat(flat, like=a)
    assert b.max_abs_diff(a) == 0.0
    b.load_flat_(flat * 2)
    assert b.allclose(a * 2)
    with pytest.raises(ValueError, match="elements"):
        WeightCollection.from_flat(flat[:-1], like=a)


def test_mismatches_name_the_first_difference():
    a = wc()
    renamed = WeightCollection({"conv1": a["conv1"], "fc": a["ip1"]})
    with pytest.raises(ValueError, match="'ip1' vs 'fc'"):
        a + renamed
    reshaped = WeightCollection({"conv1": a["conv1"], "ip1": [a["ip1"][0].reshape(36, 10), a["ip1"][1]]})
    with pytest.raises(ValueError, match=r"layer 'ip1' tensor 0: shape \(10, 36\) vs \(36, 10\)"):
        a - reshaped
    doubled = wc(dtype=torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        a.allclose(doubled)
    shorter = WeightCollection({"conv1": a["conv1"]})
    with pytest.raises(ValueError, match="'ip1' is in one collection only"):
        WeightCollection.mean([a, shorter])
    with pytest.raises(TypeError):
        a * a


def test_save_and_load_keep_order_and_values(tmp_path):
    a = WeightCollection({"z_last": [torch.ones(2)], "a/first": [torch.zeros(3), torch.arange(4.0)]})
    path = tmp_path / "w.safetensors"
    a.save(path)
    b = WeightCollection.load(path)
    assert list(b) == ["z_last", "a/first"]
    assert b.max_abs_diff(a) == 0.0


def test_copy_into_casts_and_checks_layout():
    a = wc()
    target = wc(dtype=torch.float64).zeros_like()
    a.copy_into(target)
    assert target["ip1"][0].dtype == torch.float64
    assert torch.allclose(target["ip1"][0].float(), a["ip1"][0])
    with pytest.raises(ValueError):
        a.copy_into(WeightCollection({"conv1": a["conv1"]}))


def test_is_finite():
    a = wc()
    assert a.is_finite()
    a["ip1"][1][0] = float("nan")
    assert not a.is_finite()
