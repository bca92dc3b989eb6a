"""What the barrier engine's driver keeps of the states its ranks send: the newest (what a restart starts from) and
the rounds a checkpoint still waits for, never one copy of the weights for every round the fit ran; and the order
rank 0 sends a round's messages in (its states, then its record)."""

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


def test_rank_0_sends_a_rounds_states_before_its_record():
    """A host lost as soon as the driver has a round's record (what an ``on_round`` callback sees) loses nothing sent
    with it: the record goes last on rank 0's socket, whose messages arrive in the order they were sent."""
    from sparknet.spark.barrier.executor import StagePlan, _BarrierExchange
    from sparknet.strategies import WorkerState

    sent: list[str] = []
    exchange = object.__new__(_BarrierExchange)  # the parts round_done reads, no process group
    vars(exchange).update(
        params=StagePlan(group=None, fit=None, checkpoint_every=2),
        fit=SimpleNamespace(auto=None, average=None, early_stop=None), history=[], reports=True, state_part=None,
        holds_state=True, has_data=True, task=0, link=None, eval_link_s=0.0, streaming=None,
        step=SimpleNamespace(state=WorkerState(local_flat=None, extra={})),
        net=SimpleNamespace(iteration=20, solver_state=lambda copy_tensors: {"momentum": torch.zeros(N)}),
        strategy=SimpleNamespace(state_dict=lambda: {}),
        sender=SimpleNamespace(send=lambda head, payload=None: sent.append(head["event"]) or True))
    progress = SimpleNamespace(round=2, steps_done=20, samples_done=320, total_bytes=0)
    exchange.round_done({"event": "round", "round": 2}, torch.zeros(N), progress)
    assert sent == ["state", "worker_state", "round"]
    assert exchange.history == [{"event": "round", "round": 2}]


def test_the_last_rounds_record_after_its_states_writes_the_final_checkpoint(tmp_path):
    saved: list = []
    cp = RoundCheckpoints(str(tmp_path), every=10, keep=2, config={})
    stage = _stage(cp, saved)
    stage.fit.t_fit, stage.fit.emit = 0.0, lambda record: None
    _state(stage, 4)
    _worker_state(stage, 4, 0)
    _worker_state(stage, 4, 1)
    assert saved == []  # round 4 is not due, and not known to be the last until its record comes
    stage._handle({"event": "round", "round": 4, "stop_reason": "target accuracy"}, 1.0)
    assert saved == [(4, [0, 1])] and stage.pending == {}


def test_a_record_that_comes_before_its_rounds_state_waits_for_it():
    """What the history and ``on_round`` show of a round is on the driver: a record whose state is due and not yet in
    (a sharded replica's parts come from several ranks, on sockets of their own) is recorded once the state is."""
    from sparknet.spark.barrier.executor import StagePlan

    emitted: list[int] = []
    stage = _stage()
    stage.fit.t_fit, stage.fit.emit = 0.0, lambda record: emitted.append(record["round"])
    stage.states = StagePlan(group=None, fit=None, state_every_rounds=2)
    stage._handle({"event": "round", "round": 1}, 1.0)  # no state due: recorded at once
    stage._handle({"event": "round", "round": 2}, 2.0)
    assert emitted == [1] and [h["round"] for h in stage.history] == [1]
    _state(stage, 2)
    assert emitted == [1, 2] and stage.latest.round == 2
    stage._handle({"event": "round", "round": 3}, 3.0)
    stage._handle({"event": "round", "round": 4}, 4.0)  # round 4's state lost on the way; round 6's comes
    stage._handle({"event": "round", "round": 5}, 5.0)  # not due, but after a round held: in order
    stage._handle({"event": "round", "round": 6, "stop_reason": "rounds"}, 6.0)
    assert emitted == [1, 2, 3]
    _state(stage, 6)
    assert emitted == [1, 2, 3, 4, 5, 6] and stage.held == {}


def test_a_state_its_rank_could_not_send_holds_no_record_behind_it(caplog):
    """A rank whose state did not leave (the channel to the driver full) says so: the records held for that state and
    after it are recorded at once, not when a later state comes in, and the newest state stays the one that came."""
    from sparknet.spark.barrier.executor import StagePlan

    emitted: list[int] = []
    stage = _stage()
    stage.fit.t_fit, stage.fit.emit = 0.0, lambda record: emitted.append(record["round"])
    stage.states = StagePlan(group=None, fit=None, state_every_rounds=2)
    _state(stage, 2)
    for r in (1, 2, 3, 4, 5):
        stage._handle({"event": "round", "round": r}, float(r))
    assert emitted == [1, 2, 3]  # round 4's state is due and not in
    stage._handle({"event": "state_lost", "round": 4, "rank": 0}, 5.0)
    assert emitted == [1, 2, 3, 4, 5] and stage.held == {} and stage.latest.round == 2
    assert "could not send round 4's state" in caplog.text


def test_a_rank_whose_state_did_not_leave_tells_the_driver_after_it():
    from sparknet.loop import Progress
    from sparknet.spark.barrier.executor import StagePlan, _BarrierExchange

    sent: list[dict] = []

    def send(record, payload=None):  # the channel full: a state (with its payload) does not leave
        sent.append(record)
        return payload is None

    rank = SimpleNamespace(params=StagePlan(group=None, fit=None),
                           fit=SimpleNamespace(auto=None, average=None, early_stop=None),
                           sender=SimpleNamespace(send=send), link=None, holds_state=True, net=SimpleNamespace(
                               iteration=6), state_part=None, strategy=SimpleNamespace(state_dict=lambda: {}),
                           has_data=True, reports=True, history=[], task=0)
    progress = Progress(round=3, steps_done=6, samples_done=48, total_bytes=0)
    _BarrierExchange.round_done(rank, {"event": "round", "round": 3}, torch.zeros(N), progress)
    assert [m["event"] for m in sent] == ["state", "state_lost", "round"] and sent[1]["round"] == 3
