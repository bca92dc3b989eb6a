"""Fault specs parse, reject bad text clearly, and fire as their kind says."""

import os
import subprocess
import sys

import pytest
import torch

from sparknet.faults import Fault, InjectedFault, due_fault, faults_from, parse_faults
from sparknet.net import Net


def test_parse_one_and_several():
    assert parse_faults("rank=1,round=3,kind=kill") == (Fault(rank=1, round=3, kind="kill"),)
    assert parse_faults(" rank=0 , round=2, kind=NaN, attempt=1 ; rank=1,round=5,kind=hang,hang_s=2") == (
        Fault(rank=0, round=2, kind="nan", attempt=1), Fault(rank=1, round=5, kind="hang", hang_s=2.0))
    assert parse_faults("") == () and parse_faults(None) == ()


@pytest.mark.parametrize("text, match", [
    ("rank=1,round=3", "missing kind"),
    ("rank=1,round=3,kind=explode", "unknown fault kind"),
    ("rank=1,round=0,kind=kill", "round >= 1"),
    ("rank=-1,round=1,kind=kill", "rank >= 0"),
    ("rank=one,round=1,kind=kill", "whole numbers"),
    ("rank=1,round=1,kind=kill,when=now", "not one of"),
    ("rank=1,rank=2,round=1,kind=kill", "given twice"),
    ("rank=1 round=1 kind=kill", "missing round, kind"),
])
def test_bad_specs_say_what_is_wrong(text, match):
    with pytest.raises(ValueError, match=match):
        parse_faults(text)


def test_faults_come_from_the_configuration_only(monkeypatch):
    monkeypatch.setenv("SPARKNET_FAULT", "rank=0,round=1,kind=raise")  # what older versions read: ignored now
    assert faults_from(None) == () and faults_from("") == ()
    assert faults_from("rank=1,round=2,kind=exit") == (Fault(rank=1, round=2, kind="exit"),)
    assert faults_from(Fault(rank=2, round=1, kind="nan"))[0].rank == 2
    with pytest.raises(TypeError):
        faults_from([object()])


def test_due_only_on_its_rank_round_and_attempt():
    faults = parse_faults("rank=1,round=3,kind=raise")
    assert due_fault(faults, 1, 3, 0) is faults[0]
    assert due_fault(faults, 1, 3, 1) is None and due_fault(faults, 0, 3, 0) is None
    assert due_fault(faults, 1, 2, 0) is None and due_fault((), 1, 3, 0) is None


def test_raise_and_nan_fire_in_process():
    with pytest.raises(InjectedFault, match="worker 1, round 3"):
        Fault(rank=1, round=3, kind="raise").fire()
    net = Net(torch.nn.Linear(2, 2))
    Fault(rank=0, round=1, kind="nan").fire(net)
    assert torch.isnan(net.get_flat()).all()
    with pytest.raises(ValueError, match="needs the worker's net"):
        Fault(rank=0, round=1, kind="nan").fire()


@pytest.mark.parametrize("kind, code", [("exit", 17), ("kill", -9)])
def test_exit_and_kill_end_the_process(kind, code):
    src = f"from sparknet.faults import Fault; Fault(rank=0, round=1, kind={kind!r}).fire()"
    proc = subprocess.run([sys.executable, "-c", src], timeout=60, env=os.environ.copy())
    assert proc.returncode == code



def test_a_parameter_server_task_spec_never_shows_its_secret():
    from sparknet.ps._worker import TaskSpec

    spec = TaskSpec(endpoint="tcp://127.0.0.1:1", job_id=b"j" * 16, secret=b"s3cr3t-key-bytes", net={}, solver={},
                    batch_size=8, tau=1, seed=0, epoch=0, iteration=0, shuffle=True, sample_shape=None, timeout_s=60.0)
    assert "s3cr3t" not in repr(spec) and "secret" not in repr(spec)
