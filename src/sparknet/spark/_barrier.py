"""Executor side of the barrier engine: one barrier stage, a gloo group, one allreduce per round.

Every task of the stage runs :func:`run_barrier`:

1. reads its partition's chunks into a :class:`~sparknet.net.Net` (once for the whole fit);
2. rendezvous: rank 0 opens a ``TCPStore`` on a free port of its host (the OS picks it, so
   no other process can take it in between) and ``BarrierTaskContext.allGather`` shares
   ``host:port``; every rank then joins ``torch.distributed`` with the gloo backend and a
   timeout on every collective;
3. each round: local steps, then ONE ``all_reduce`` (sum) of one flat float32 buffer::

       [ n_r * delta_r  (P values) | K rows of (samples, loss*samples, steps, compute_s, finite, processed) ]

   where only rank r fills its own row. Every rank then holds the same sums, forms the same
   sample-weighted mean and applies the same strategy step, so global weights stay
   identical without any further message. Evaluation (when due) is one more tiny allreduce
   of (correct, count, loss) over each rank's shard of the validation data, so every rank
   sees the same accuracy and all stop together;
4. rank 0 pushes a record per round to the driver over :mod:`sparknet.spark._channel` and
   returns the final weights and the history when the stage ends. Every
   ``state_every_rounds`` rounds (and at the last) it also sends the global weights and the
   strategy's state as a binary payload, so the driver can start a failed stage again from
   them; on checkpoint rounds every rank sends its own solver and strategy state.

A stage starts at round 0 or where ``payload["start"]`` says (a restart or a resumed fit);
torch's global generator is reseeded every round from (seed, rank, round), as in the rounds
engine, so a resumed fit repeats an uninterrupted one exactly.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import pickle
import socket
import time
from datetime import timedelta

import numpy as np
import torch

from sparknet.faults import due_fault
from sparknet.spark._channel import encode_tree
from sparknet.spark._data import merge_chunks
from sparknet.spark._rounds import (WorkerSpec, build_worker_net, export_worker_state, freeze_heap,
                                    import_worker_state, round_seed, task_device, worker_failure)
from sparknet.stopping import StopRule
from sparknet.strategies import AutoTau, WorkerState, make_compressor

__all__ = ["run_barrier", "rendezvous", "FIELDS"]

log = logging.getLogger(__name__)

FIELDS = 7
"""Per-worker values appended to the allreduced buffer: samples averaged (0 when not finite),
loss*samples, steps, compute_s, finite, samples processed, the rank's sync time of the previous
round (-1 for none yet; what automatic tau reads, so every rank chooses the same tau)."""


def run_barrier(payload_bc, params: dict, val_bc=None):
    """The barrier stage's task function (``rdd.barrier().mapPartitionsWithIndex``)."""

    def task(index: int, chunks):
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        try:
            yield from _run(ctx, rank, payload_bc, params, val_bc, chunks)
        except StuckPeers as exc:  # this rank is fine; the error names the rank it waited for
            failure = worker_failure(exc.ranks[0], exc)
            _report_failure(params, exc.ranks[0], exc, str(failure), collective=False)
            raise failure from None
        except Exception as exc:
            failure = worker_failure(rank, exc)
            _report_failure(params, rank, exc, str(failure))
            raise failure from None

    return task


class StuckPeers(RuntimeError):
    """A collective timed out because other ranks never reached it: they are the ones to name."""

    def __init__(self, ranks: list[int], waiter: int, round_index: int, timeout_s: float, cause: BaseException):
        self.ranks = ranks
        who = ", ".join(str(r) for r in ranks)
        super().__init__(f"rank {who} did not reach round {round_index + 1}'s exchange within collective_timeout_s="
                         f"{timeout_s:g} s (stuck in its local steps, or its process died); rank {waiter} waited for "
                         f"it ({type(cause).__name__}). Look at that task's executor log, or raise "
                         "EngineOptions.collective_timeout_s if its rounds are legitimately that long")


class _Arrivals:
    """Which ranks reached which collective, kept in the stage's TCPStore (one small write per round).

    When a collective times out, the ranks whose mark is missing are the stuck (or dead) ones.
    """

    def __init__(self, store, rank: int, world: int):
        self.store, self.rank, self.world = store, rank, world

    def mark(self, tag: str) -> None:
        self.store.set(f"arrived/{tag}/{self.rank}", "1")

    def missing(self, tag: str) -> list[int]:
        try:
            return [r for r in range(self.world) if not self.store.check([f"arrived/{tag}/{r}"])]
        except Exception:  # the store's host is gone too: nothing to tell
            return []


def _report_failure(params: dict, rank: int, exc: BaseException, text: str, *, collective: bool | None = None) -> None:
    """Tell the driver which rank failed first, and why, before Spark fails the stage.

    When one rank raises, its peers soon fail too (their collectives lose the connection), and
    Spark reports whichever task failure it handles first; the driver uses these reports to
    name the rank that started it.
    """
    if not params.get("endpoint"):
        return
    try:
        from sparknet.spark._channel import MetricsSender

        sender = MetricsSender(params["endpoint"], params["secret"], send_timeout_ms=2000)
        try:
            sender.send({"event": "error", "rank": rank, "type": type(exc).__name__, "text": text[-8000:],
                         "collective": _is_collective_failure(exc) if collective is None else collective,
                         "time": time.time(),
                         "fatal": isinstance(exc, FloatingPointError)})
        finally:
            sender.close()
    except Exception:  # pragma: no cover - the task fails anyway
        log.debug("could not report the failure of rank %d to the driver", rank, exc_info=True)


def _is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` looks like a consequence of a peer's failure (a broken or timed-out collective)."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in ("gloo", "Connection closed by peer", "Connection reset", "Broken pipe",
                                   "DistBackendError", "DistNetworkError", "timed out", "Timed out"))


def _loopback_ifname() -> str | None:
    try:
        for _, name in socket.if_nameindex():
            if name in ("lo", "lo0"):
                return name
    except OSError:  # pragma: no cover
        pass
    return None


def rendezvous(ctx, rank: int, world: int, params: dict):
    """Join the gloo process group of a barrier stage's tasks; returns the TCPStore (keep it alive).

    ``params`` holds ``local``, ``rendezvous_timeout_s`` and ``collective_timeout_s``.
    """
    import torch.distributed as dist

    timeout = timedelta(seconds=params["rendezvous_timeout_s"])
    if params["local"]:
        host = "127.0.0.1"
        ifname = _loopback_ifname()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    else:
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
    store = None
    if rank == 0:
        store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False)
        addresses = ctx.allGather(f"{host}:{store.port}")
    else:
        addresses = ctx.allGather("")
    master_host, master_port = addresses[0].rsplit(":", 1)
    if rank != 0:
        store = dist.TCPStore(master_host, int(master_port), world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=params["collective_timeout_s"]))
    return store


def _run(ctx, rank: int, payload_bc, params: dict, val_bc, chunks):
    import torch.distributed as dist

    t_start = time.perf_counter()
    packed, init_flat, start = payload_bc.value
    spec: WorkerSpec = pickle.loads(packed[1])
    world = params["workers"]
    torch.set_num_threads(spec.threads)
    x, y, _ = merge_chunks(chunks)
    device, device_info = task_device(spec.device)
    net = build_worker_net(spec, rank, x, y, device)
    has_data = x is not None and len(x) > 0
    del chunks
    freeze_heap()  # no full garbage collection of torch's modules in the middle of a round
    val = None
    if val_bc is not None:
        vx, vy = val_bc.value
        val = (vx[rank::world], vy[rank::world])
    sender = None
    store = None
    history: list[dict] = []
    try:
        if params.get("endpoint") and (rank == 0 or params.get("checkpoint_every")):
            from sparknet.spark._channel import MetricsSender

            sender = MetricsSender(params["endpoint"], params["secret"])
        store = rendezvous(ctx, rank, world, params)
        if sender is not None and rank == 0:
            sender.send({"event": "ready", "fit": spec.fit_id, "setup_s": time.perf_counter() - t_start})
        final = _round_loop(net, spec, rank, world, init_flat, has_data, val, params, sender, history, start or {},
                            arrivals=_Arrivals(store, rank, world))
        yield ("worker", rank, {"host": socket.gethostname(), "pid": os.getpid(), **device_info,
                                "attempt": ctx.attemptNumber()})
        if rank == 0:
            yield ("result", final.numpy().tobytes(), history)
    finally:
        gc.unfreeze()
        if dist.is_initialized():
            dist.destroy_process_group()
        del store
        if sender is not None:
            sender.close()


def _exchange(buf: torch.Tensor, P: int, world: int, rank: int, codec, link, sent: dict) -> torch.Tensor:
    """The round's one collective; returns the ``world x FIELDS`` rows and leaves the weighted delta sum in
    ``buf[:P]`` (identical on every rank). ``sent`` gets the link wait and the bytes that crossed.

    Without compression: a sum-allreduce of ``buf`` (rank r filled its own row and ``n_r * delta_r``).
    With it the updates cannot be summed on the way: every rank all-gathers one message per rank
    (its row as float32 bytes, then its encoded delta) and decodes all of them in rank order.
    """
    import torch.distributed as dist

    if codec is None:
        nbytes = buf.numel() * 4
        sent["link_s"] += link.wait_allreduce(nbytes, world) if link is not None else 0.0
        dist.all_reduce(buf)
        sent["bytes"] += 2 * (world - 1) * nbytes if world > 1 else 0
        return buf[P:].view(world, FIELDS).double()
    row = buf[P + rank * FIELDS:P + (rank + 1) * FIELDS].clone()
    delta = sent.get("delta")
    body = codec.encode(delta, sent["state"]) if delta is not None else torch.zeros(codec.wire_nbytes(P),
                                                                                      dtype=torch.uint8)
    message = torch.cat([row.view(torch.uint8), body])
    sent["link_s"] += link.wait_allgather(message.numel(), world) if link is not None else 0.0
    gathered = [torch.empty_like(message) for _ in range(world)]
    dist.all_gather(gathered, message)
    sent["bytes"] += world * (world - 1) * message.numel()
    head = FIELDS * 4
    rows = torch.stack([g[:head].clone().view(torch.float32) for g in gathered]).double()
    buf[:P].zero_()
    for i, g in enumerate(gathered):
        if rows[i, 0] > 0:
            buf[:P] += codec.decode(g[head:], P) * float(rows[i, 0])
    return rows


def _round_loop(net, spec: WorkerSpec, rank: int, world: int, init_flat, has_data: bool, val, params: dict,
                sender, history: list, start: dict, arrivals: _Arrivals | None = None) -> torch.Tensor:
    """Train round after round until the stop rule says so; returns the final global weights."""
    strategy = spec.strategy
    state = WorkerState()
    if start.get("strategy") is not None:
        strategy.load_state_dict(start["strategy"])
    saved = (start.get("workers") or {}).get(rank)
    if saved is not None and has_data:
        state = import_worker_state(net, saved)
    elif start.get("iteration") is not None:
        net.set_iteration(start["iteration"])  # a restart without solver state: momentum starts afresh
    global_flat = torch.from_numpy(np.array(init_flat, dtype=np.float32, copy=True))
    P = global_flat.numel()
    buf = torch.zeros(P + world * FIELDS, dtype=torch.float32)
    stop = StopRule(**params["stop"])
    auto = None
    if params.get("auto_tau"):
        auto = AutoTau(**params["auto_tau"])
        if start.get("auto_tau"):
            auto.load_state_dict(start["auto_tau"])
    codec = make_compressor(spec.compression) if spec.compression != "none" else None
    link = spec.link
    if link is not None and hasattr(strategy, "link"):
        strategy.link = link  # the gradient allreduce of every step waits too
    hook = strategy.after_backward if strategy.needs_gradient_hook else None
    steps_done, samples_done = start.get("steps_done", 0), start.get("samples_done", 0)
    total_bytes = start.get("total_bytes", 0)
    t0 = time.perf_counter()
    eval_every = params["eval_every_rounds"]
    ckpt_every, state_every = params.get("checkpoint_every"), params.get("state_every_rounds", 1)
    r = start.get("round", 0)
    last_sync_s = -1.0  # this rank's sync time of the previous round (none yet in a new stage)
    while True:
        if auto is not None:
            stop.tau = auto.tau  # the same on every rank: chosen from allreduced values only
        steps = stop.steps_for_round(steps_done)
        t_round = time.perf_counter()
        buf.zero_()
        row = buf[P + rank * FIELDS:P + (rank + 1) * FIELDS]
        grad_bytes0, grad_link0 = getattr(strategy, "bytes_sent", 0), getattr(strategy, "link_s", 0.0)
        sent = {"link_s": 0.0, "bytes": 0, "state": state}
        if has_data and steps > 0:
            strategy.worker_begin(state, net, global_flat.to(net.device))
            torch.manual_seed(round_seed(spec.seed, rank, r))
            stats = net.train(steps, max_seconds=params.get("round_seconds"), after_backward=hook)
            fault = due_fault(spec.faults, rank, r + 1, params.get("restart", 0))
            if fault is not None:
                fault.fire(net)
            delta = strategy.worker_delta(state, net, global_flat.to(net.device)).cpu()
            finite = bool(stats.finite and torch.isfinite(delta).all())
            if finite and stats.samples and codec is None:
                torch.mul(delta, float(stats.samples), out=buf[:P])
            elif finite and stats.samples:
                sent["delta"] = delta  # encoded (error feedback in this rank's state) by _exchange
            if not finite:
                log.warning("worker %d: loss or weights became NaN/Inf in round %d; left out of the average", rank, r)
            loss_sum = stats.loss * stats.samples if finite and stats.samples else 0.0
            row.copy_(torch.tensor([stats.samples if finite else 0, loss_sum, stats.steps, stats.wall_s,
                                    1.0 if finite else 0.0, stats.samples, last_sync_s]))
        else:
            row[4], row[6] = 1.0, last_sync_s
        t_comm = time.perf_counter()
        tag = f"{params.get('restart', 0)}/{r}"
        if arrivals is not None:
            arrivals.mark(tag)
        try:
            rows = _exchange(buf, P, world, rank, codec, link, sent)
        except RuntimeError as exc:
            # only a wait that ran to the deadline points at a stuck peer; a peer that failed on its own
            # breaks the collective at once and reports its own error
            timed_out = time.perf_counter() - t_comm >= 0.9 * params["collective_timeout_s"]
            stuck = [i for i in arrivals.missing(tag) if i != rank] if arrivals is not None and timed_out else []
            if stuck:
                raise StuckPeers(stuck, rank, r, params["collective_timeout_s"], exc) from exc
            raise
        allreduce_s = time.perf_counter() - t_comm
        last_sync_s = allreduce_s
        n_total = float(rows[:, 0].sum())
        if n_total <= 0:
            bad = [i for i in range(world) if rows[i, 4] == 0]
            raise FloatingPointError(f"no worker produced finite weights in round {r} (non-finite: {bad})")
        mean = buf[:P] / n_total
        global_flat = strategy.apply(global_flat, mean, world)
        round_steps = int(rows[:, 2].max())
        steps_done += round_steps
        round_samples = int(rows[:, 5].sum())
        samples_done += round_samples
        grad_bytes = getattr(strategy, "bytes_sent", 0) - grad_bytes0  # sync: every step's gradient allreduce
        link_s = sent["link_s"] + getattr(strategy, "link_s", 0.0) - grad_link0
        nbytes_round = sent["bytes"] + (2 * (world - 1) * grad_bytes if world > 1 else 0)
        total_bytes += nbytes_round
        round_s = time.perf_counter() - t_round
        accuracy = val_loss = None
        r += 1
        t_eval = time.perf_counter()
        due = val is not None and (r % eval_every == 0)
        evaluated = {"link_s": 0.0}
        if due:
            accuracy, val_loss = _evaluate(net, global_flat, val, strategy.keeps_local_weights, link, evaluated)
        reason = stop.reason(r, steps_done, samples_done, accuracy)
        if reason is not None and val is not None and not due:
            accuracy, val_loss = _evaluate(net, global_flat, val, strategy.keeps_local_weights, link, evaluated)
        eval_s = time.perf_counter() - t_eval
        slowest = int(torch.argmax(rows[:, 3]))
        compute_s = float(rows[slowest, 3])
        record = {
            "event": "round", "round": r, "steps": round_steps, "total_steps": steps_done,
            "samples": round_samples, "total_samples": samples_done, "wall_s": time.perf_counter() - t0,
            "round_s": round_s, "compute_s": compute_s, "comm_s": max(round_s - compute_s, 0.0),
            "allreduce_s": allreduce_s,
            "loss": float(rows[:, 1].sum() / n_total), "bytes": nbytes_round, "total_bytes": total_bytes,
            "tau": steps if steps < StopRule.UNBOUNDED_STEPS else None, "workers": world,
            "engine": "barrier", "strategy": getattr(strategy.name, "value", str(strategy.name)),
            "compression": spec.compression,
            "per_worker": [{"rank": i, "samples": int(rows[i, 5]), "steps": int(rows[i, 2]),
                            "loss": float(rows[i, 1] / rows[i, 0]) if rows[i, 0] > 0 else None,
                            "compute_s": float(rows[i, 3]), "finite": bool(rows[i, 4] > 0)}
                           for i in range(world)],
        }
        if link is not None:
            record["link_s"] = link_s + evaluated["link_s"]
        if auto is not None:
            prev_sync = float(rows[:, 6].max())  # every rank's last sync time, the slowest's: the same everywhere
            if prev_sync >= 0:
                auto.observe(int(rows[slowest, 2]), compute_s, prev_sync)
            record["next_tau"] = auto.tau
        if accuracy is not None:
            record.update(val_accuracy=accuracy, val_loss=val_loss, eval_s=eval_s)
        if int((rows[:, 4] == 0).sum()):
            record["nonfinite_workers"] = int((rows[:, 4] == 0).sum())
        if reason is not None:
            record["stop_reason"] = reason
        if params.get("restart"):
            record["restarts"] = params["restart"]
        if rank == 0:
            history.append(record)
            if sender is not None:
                sender.send(record)
                if r % state_every == 0 or reason is not None or (ckpt_every and r % ckpt_every == 0):
                    sender.send({"event": "state", "round": r, "steps_done": steps_done, "samples_done": samples_done,
                                 "total_bytes": total_bytes, "iteration": net.iteration},
                                encode_tree({"global": global_flat, "strategy": strategy.state_dict(),
                                             "auto_tau": None if auto is None else auto.state_dict()}))
        if sender is not None and ckpt_every and has_data and (r % ckpt_every == 0 or reason is not None):
            sender.send({"event": "worker_state", "round": r, "rank": rank},
                        encode_tree(export_worker_state(net, state)))
        if reason is not None:
            return global_flat
        if round_steps == 0:
            raise RuntimeError("a round made no step on any worker; check tau, max_steps and the data")


def _evaluate(net, global_flat, val, keep_local: bool, link=None, waited: dict | None = None) -> tuple[float, float]:
    """Accuracy and loss of the global weights over all ranks' validation shards (same on every rank)."""
    import torch.distributed as dist

    local = net.get_flat() if keep_local else None
    net.set_flat(global_flat)
    x, y = val
    correct = loss_sum = 0.0
    count = 0
    if len(x):
        res = net.evaluate((x, y))
        count = res.samples
        correct = res.accuracy * res.samples
        loss_sum = res.loss * res.samples
    t = torch.tensor([correct, float(count), loss_sum], dtype=torch.float64)
    if link is not None:
        waited["link_s"] += link.wait_allreduce(t.numel() * 8, dist.get_world_size())
    dist.all_reduce(t)
    if local is not None:
        net.set_flat(local)
    if t[1] <= 0:
        return math.nan, math.nan
    return float(t[0] / t[1]), float(t[2] / t[1])

