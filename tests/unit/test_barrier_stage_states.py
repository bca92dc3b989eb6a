"""What the barrier engine's driver keeps of the states its ranks send: the newest (what a restart starts from) and
the rounds a checkpoint still waits for, never one copy of the weights for every round the fit ran."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from sparknet._tensortree import pack_tree
from sparknet.checkpoint import RoundCheckpoints
from sparknet.spark.barrier.driver import BarrierStage

N = 1000  # weights of the pretend net


def _stage(checkpoints=None, saved=None):
    def save_checkpoint(engine, state):
        checkpoints.written.append(state.round)
        saved.append((state.round, sorted(state.workers)))
        return f"ckpt-{state.round}"

    run = SimpleNamespace(checkpoints=checkpoints, dist=SimpleNamespace(workers=2), rows=(5, 5),
                          save_checkpoint=save_checkpoint)
    return BarrierStage(run, history=[], restart=0)


def _state(stage, r):
    head = {"event": "state", "round": r, "steps_done": 2 * r, "samples_done": 16 * r, "total_bytes": 0,
            "iteration": 2 * r}
    stage._handle({**head, "payload": memoryview(pack_tree({"global": torch.full((N,), float(r)),
                                                            "strategy": {}}))}, 0.0)


def _worker_state(stage, r, rank):
    stage._handle({"event": "worker_state", "round": r, "rank": rank,
                   "payload": memoryview(pack_tree({"momentum": torch.full((N,), float(rank))}))}, 0.0)


def test_without_checkpoints_only_the_newest_state_is_kept():
    stage = _stage()
    for r in range(1, 51):
        _state(stage, r)
        assert sorted(stage.pending) == [r]  # was every round so far: one copy of the weights each
        assert stage.latest.round == r and stage.latest.global_flat[0].item() == r


def test_a_state_that_arrives_late_does_not_replace_the_newest():
    stage = _stage()
    _state(stage, 3)
    _state(stage, 2)  # a round behind (a sharded replica's parts arrive out of order)
    assert stage.latest.round == 3 and sorted(stage.pending) == [3]


def test_a_checkpoint_round_is_kept_until_its_ranks_states_arrive(tmp_path):
    saved: list = []
    cp = RoundCheckpoints(str(tmp_path), every=3, keep=2, config={})
    stage = _stage(cp, saved)
    for r in (1, 2, 3, 4, 5):
        _state(stage, r)
    assert sorted(stage.pending) == [3, 5]  # round 3 waits for the ranks' solver states; 1, 2 and 4 are gone
    _worker_state(stage, 3, 0)
    assert saved == [] and sorted(stage.pending) == [3, 5]
    _worker_state(stage, 3, 1)
    assert saved == [(3, [0, 1])]
    assert sorted(stage.pending) == [5]
    _state(stage, 6)
    _worker_state(stage, 6, 1)
    _worker_state(stage, 6, 0)
    assert saved[-1] == (6, [0, 1]) and stage.pending == {} and stage.latest.round == 6
    assert sorted(stage.latest.workers) == [0, 1]  # a restart from round 6 is exact
