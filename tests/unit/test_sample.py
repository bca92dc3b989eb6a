"""The character LSTM on a tiny corpus: two averaging workers lower the bits per character,
and sampling (the library call and ``sparknet sample``) returns text over the vocabulary."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from sparknet import zoo
from sparknet.datasets import CharCorpus
from sparknet.net import Net
from sparknet.sample import Vocabulary, configure_sample, sample_text
from sparknet.solvers import SolverConfig
from sparknet.strategies import WorkerState, make_strategy

TEXT = ("ROMEO: but soft, what light through yonder window breaks?\n"
        "JULIET: o romeo, romeo, wherefore art thou romeo?\n") * 12
SEQ = 16


@pytest.fixture(scope="module")
def trained():
    """Two workers, RMSprop, averaging every 5 steps: (corpus, global net, bpc before, bpc after)."""
    torch.set_num_threads(1)
    corpus = CharCorpus(TEXT, validation_fraction=0.2)
    train, val = corpus.sequences("train", SEQ), corpus.sequences("validation", SEQ)
    net_def = zoo.char_lstm(corpus.vocab_size, seq_len=SEQ, hidden=32, num_layers=1, batch_size=8)
    solver = SolverConfig(type="rmsprop", base_lr=1e-2, rms_decay=0.95)
    evaluator = Net(net_def.build(seed=0), solver, batch_size=8)
    before = evaluator.evaluate(val).loss / math.log(2)
    workers = []
    for i in range(2):
        net = Net(net_def.build(seed=0), solver, batch_size=8, seed=i)
        net.set_training_data(train.shard(i, 2))
        workers.append(net)
    strategy, states = make_strategy("average", num_workers=2), [WorkerState(), WorkerState()]
    global_flat = strategy.init_global(evaluator.get_flat())
    for _ in range(6):
        total, acc = 0, torch.zeros_like(global_flat)
        for net, state in zip(workers, states):
            strategy.worker_begin(state, net, global_flat)
            stats = net.train(5)
            acc += strategy.worker_delta(state, net, global_flat) * stats.samples
            total += stats.samples
        global_flat = strategy.apply(global_flat, acc / total, 2)
    evaluator.set_flat(global_flat)
    after = evaluator.evaluate(val).loss / math.log(2)
    return corpus, evaluator, before, after


def test_two_averaging_workers_lower_bits_per_character(trained):
    corpus, _, before, after = trained
    assert before == pytest.approx(math.log2(corpus.vocab_size), rel=0.1)  # untrained: about uniform
    assert after < before - 1.0


def test_sample_is_text_of_the_right_length_over_the_vocabulary(trained):
    corpus, net, _, _ = trained
    text = sample_text(net, corpus, prime="ROMEO:", length=50, temperature=0.8, seed=3)
    assert isinstance(text, str) and len(text) == 50
    assert set(text) <= set(corpus.vocab)
    assert text == sample_text(net.module, corpus, prime="ROMEO:", length=50, temperature=0.8, seed=3)
    greedy = sample_text(net, corpus.vocab, prime="JULIET:", length=20, temperature=0.0)
    assert greedy == sample_text(net, corpus.vocab, prime="JULIET:", length=20, temperature=0.0, seed=99)
    assert sample_text(net, corpus, prime="", length=5) != ""


def test_sample_rejects_bad_input(trained):
    corpus, net, _, _ = trained
    with pytest.raises(ValueError, match="not in the vocabulary"):
        sample_text(net, corpus, prime="ZEBRA", length=5)
    with pytest.raises(ValueError, match="temperature"):
        sample_text(net, corpus, length=5, temperature=-1.0)
    with pytest.raises(ValueError, match="vocabulary has"):
        sample_text(net, Vocabulary("abc"), prime="a", length=1)


def _parse(argv):
    parser = argparse.ArgumentParser(prog="sparknet sample")
    configure_sample(parser)
    return parser.parse_args(argv)


def test_cli_samples_from_a_model_folder_and_a_checkpoint(trained, tmp_path, capsys):
    from sparknet.model_io import save_model

    corpus, net, _, _ = trained
    save_model(tmp_path / "model", net.module, net.get_weights(), metadata={"vocab": "".join(corpus.vocab)})
    args = _parse(["--model-dir", str(tmp_path / "model"), "--prime", "ROMEO:", "--length", "40", "--json"])
    assert args._run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["text"]) == 40 and set(out["text"]) <= set(corpus.vocab)
    assert out["text"] == sample_text(net, corpus, prime="ROMEO:", length=40, temperature=0.8, seed=0)

    weights = tmp_path / "weights.safetensors"
    net.get_weights().save(weights)
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    args = _parse(["--checkpoint", str(weights), "--corpus", str(tmp_path / "corpus.txt"), "--hidden", "32",
                   "--num-layers", "1", "--seq-len", str(SEQ), "--length", "40", "--json"])
    assert args._run(args) == 0
    assert json.loads(capsys.readouterr().out)["text"] == out["text"]
    with pytest.raises(ValueError, match="does not fit"):
        args = _parse(["--checkpoint", str(weights), "--corpus", str(tmp_path / "corpus.txt"), "--hidden", "16",
                       "--num-layers", "1"])
        args._run(args)
