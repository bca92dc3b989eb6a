"""The round's exchange as one collective: the barrier engine's, and a model-parallel mesh's data-parallel group's.

Every rank of a torch.distributed group runs :func:`sparknet.loop.run_rounds` with a
:class:`CollectiveExchange`. Each round it runs the rank's local steps, then ONE
``all_reduce`` (sum) of one flat float32 buffer::

    [ n_r * delta_r  (P values) | world rows of FIELDS values ]

where rank r fills only its own row (samples, loss * samples, steps, compute seconds, finite,
samples processed, its previous sync time). Every rank then holds the same sums, forms the same
sample-weighted mean and applies the same strategy step, so the global weights stay identical
without any further message. With compression the updates cannot be summed on the way: every
rank all-gathers one message per rank (its row, then its encoded delta) and decodes them in rank
order. Evaluation is one more tiny allreduce of (correct, count, loss) over each rank's share of
the validation data, so every rank sees the same accuracy and all stop together.

No pyspark import.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from sparknet._enums import CompressionKind
from sparknet.config import Profile, Streaming
from sparknet.labels import Task, task_width
from sparknet.loop import Exchange, RoundPlan, RoundUpdate, check_streaming, late_update, whole_or
from sparknet.net import EvalResult
from sparknet.step import WorkerRanks, WorkerStep
from sparknet.strategies import TrainingStrategy, WorkerState, make_compressor
from sparknet.weights import box_numel, box_size, shard_slice

__all__ = ["CollectiveExchange", "FIELDS", "evaluate_shards"]

log = logging.getLogger(__name__)

FIELDS = 7
"""Per-rank values appended to the allreduced buffer: samples averaged (0 when not finite),
loss*samples, steps, compute_s, finite, samples processed, the rank's sync time of the previous
round (-1 for none yet; what automatic tau reads, so every rank chooses the same tau)."""


@dataclass
class _InFlight:
    """A started exchange: the collective's handle, its buffer, and the link's wait still owed."""

    work: object
    buf: torch.Tensor
    n: int
    gathered: list | None
    sent: dict
    delay: float
    t: float
    size: int = 0
    """Bytes of each rank's message (a worker's piece of it is cut from it padded)."""


_KEPT_SENT = ("link_s", "bytes", "round", "inner_bytes", "gather_bytes")
"""What a finished overlapped exchange keeps in a checkpoint of what its round sent (its part besides)."""


def _span(part: slice | None) -> list[int] | None:
    return None if part is None else [part.start, part.stop]


@dataclass
class _Done:
    """A finished exchange: every rank's row (float64), the weighted delta sum, and its times."""

    rows: torch.Tensor
    total: torch.Tensor
    sent: dict
    seconds: float
    waited_s: float


class CollectiveExchange(Exchange):
    """One rank's side of a round whose deltas meet in one collective over ``group``.

    Parameters
    ----------
    net : Net
        This rank's net (its training data set, unless ``has_data`` is False).
    strategy : TrainingStrategy
        The worker hooks; every rank applies the outer step identically.
    rank, world : int
        This rank's index in ``group`` and the group's size (K).
    group : ProcessGroup, optional
        Where the round's collective runs (default: the whole world).
    state : WorkerState, optional
        The strategy's state of this worker (a resumed fit's).
    has_data : bool
        False: this rank trains nothing and sends an empty row.
    validation : (ndarray, ndarray), optional
        This rank's share of the validation rows.
    validation_rows : int, optional
        Validation rows over all ranks (a screen scores its share of a sample of them).
    outputs : int, optional
        The net's outputs (a classifier's classes): the width of the validation shares' summed scores, F1 by class
        among them (default: a classifier's accuracies alone; :func:`evaluate_shards`).
    compression : str
        Codec of the updates (``none``: one sum-allreduce).
    link : LinkModel, optional
        A simulated network every collective waits for.
    seed_for_round : callable, optional
        ``seed_for_round(round)`` reseeds torch's generator before the local steps.
    after_train : callable, optional
        ``after_train(net, round)`` after the local steps (fault injection).
    train : callable, optional
        ``train(steps, max_seconds) -> TrainStats`` in place of ``net.train`` (a custom local loop, e.g.
        one that carries a recurrent state from batch to batch; no gradient strategy then).
    engine : str
        The engine's name in round records.
    ranks : WorkerRanks, optional
        This worker is several processes (``rank`` and ``world`` then count workers, and ``group`` holds the
        ranks of the other workers that train the same part): their gradients are averaged every step.
    everyone : ProcessGroup, optional
        Every rank of the fit, where ``group`` holds only some (a worker of several processes): its ranks agree on
        when to evaluate, and the validation rows are shared and scored over it (default: ``group``).
    scoring : ProcessGroup, optional
        Where the validation shares are summed instead of ``everyone`` (a sharded replica: a worker's ranks score
        its share together, so the sums run over ``group``).
    profile : Profile, optional
        Trace one of this rank's rounds with torch's profiler, its files named ``name`` (default ``rank-<rank>``).
    """

    def __init__(self, net, strategy: TrainingStrategy, *, rank: int, world: int, group=None,
                 state: WorkerState | None = None, has_data: bool = True, validation=None,
                 compression: CompressionKind | str = CompressionKind.NONE,
                 link=None, seed_for_round: Callable[[int], int] | None = None,
                 after_train: Callable[[object, int], None] | None = None, engine: str = "barrier",
                 train: Callable | None = None, validation_rows: int | None = None,
                 streaming: Streaming | None = None, ranks: WorkerRanks | None = None, everyone=None,
                 scoring=None, profile: Profile | None = None, name: str | None = None, outputs: int | None = None):
        self.net, self.strategy, self.rank, self.world, self.group = net, strategy, rank, world, group
        self.everyone = group if everyone is None else everyone
        self.scoring = self.everyone if scoring is None else scoring
        check_streaming(strategy, streaming)
        self.streaming = streaming
        # a sharded replica's rows of each weight (FSDP2's cut) on every rank of the worker, one column's each: where
        # a streamed round finds its fragment, and what every column of the worker sends
        sharded = ranks is not None and ranks.sharded
        self._layouts = net.cut_layouts(*net.cuts) if sharded else None
        self._layout = net.shard_layout() if sharded else None
        self.step = WorkerStep(net, strategy, state=state, compression=compression, streaming=streaming,
                               seed=seed_for_round, after_train=after_train, train=train, ranks=ranks,
                               profile=profile, name=name or f"rank-{rank}")
        self._arrived: slice | None = None  # the part whose new global weights this rank takes next round
        self._in_flight: _InFlight | _Done | None = None  # an overlapped exchange on its way (or kept, finished)
        self.workers = world
        self.has_data, self.validation, self.link = has_data, validation, link
        self.validation_rows, self.outputs = validation_rows, outputs
        self.codec, self.engine = self.step.codec, engine
        # the codec of every column of a sharded worker, to count its bytes: a split one's int8 chunks its own boxes
        self._column_codecs = None if self._layouts is None or self.codec is None else [
            make_compressor(self.codec.kind, [box_numel(box) for box in layout]) if ranks.split else self.codec
            for layout in self._layouts]
        self.compression = CompressionKind.NONE if self.codec is None else self.codec.kind
        self.strategy.set_link(link)  # a gradient strategy's every-step allreduce waits too
        self._bufs: list[torch.Tensor | None] = [None, None]  # an overlapped round fills one while the other travels
        # a worker's copies (whole replicas, or a split one's copies of each part): their buffers are the same, so
        # each column carries one piece of it between the workers and the copies gather the pieces (a sharded
        # replica's columns carry their parts)
        self._pieces = ranks.size if ranks is not None and not ranks.sharded else 1
        self._piece = dist.get_rank(ranks.group) if self._pieces > 1 else 0
        # the worker's columns whose exchange each has this rank's size: a whole replica's pieces, a split one's parts
        # (every process of a split worker holds its parts in the same shapes) and their pieces
        self._columns = ranks.procs if ranks is not None and not ranks.sharded else 1
        self.eval_link_s = 0.0  # the link wait of this round's evaluation
        self._last_sync_s = -1.0  # this rank's sync time of the previous round (none yet in a new stage)

    @property
    def state(self) -> WorkerState:
        """This worker's strategy and codec state."""
        return self.step.state

    def stream_state(self) -> dict | None:
        """A streamed or overlapped exchange's worker side between rounds: its own weights, where its progress counts
        from, the part whose new global weights it takes next round, and an overlapped exchange's sums still to be
        applied (the exchange in flight is waited for here: every rank holds the same sums). ``None`` where there is
        none to keep (no stream, or none begun)."""
        if self.streaming is None or self.step.stream.base is None:
            return None
        stream = self.step.stream
        state = {**stream.state_dict(self.net), "arrived": _span(self._arrived)}
        if self.streaming.overlap:
            done = self._in_flight = None if self._in_flight is None else self._finish(self._in_flight)
            state["in_flight"] = None if done is None else {
                "rows": done.rows, "total": done.total.clone(), "seconds": done.seconds, "waited_s": done.waited_s,
                "sent": {**{k: v for k, v in done.sent.items() if k in _KEPT_SENT}, "part": _span(done.sent["part"])}}
        return state

    def load_stream_state(self, saved: dict) -> None:
        """Continue a stream from :meth:`stream_state`'s dict (a resumed fit's)."""
        self.step.stream.load_state_dict(self.net, saved)
        self._arrived = None if saved["arrived"] is None else slice(*saved["arrived"])
        held = saved.get("in_flight")
        if held is not None:  # the sums the next round applies, as they arrived before the stop
            sent = {**held["sent"], "part": None if held["sent"]["part"] is None else slice(*held["sent"]["part"]),
                    "gradient": self.strategy.gradient_traffic()}
            self._in_flight = _Done(torch.as_tensor(held["rows"], dtype=torch.float64),
                                    torch.as_tensor(held["total"], dtype=torch.float32), sent, float(held["seconds"]),
                                    float(held["waited_s"]))

    # -- one round ----------------------------------------------------------------------------
    def run_round(self, plan: RoundPlan, global_flat: torch.Tensor) -> RoundUpdate:
        P, streaming = global_flat.numel(), self.streaming
        part = slice(0, P) if streaming is None else self._part(plan, P)
        n = part.stop - part.start
        slot = plan.round % 2 if streaming is not None and streaming.overlap else 0
        size = -(-(n + self.world * FIELDS) // self._pieces) * self._pieces  # whole pieces, the last padded
        if self._bufs[slot] is None or self._bufs[slot].numel() < size:
            self._bufs[slot] = torch.zeros(size, dtype=torch.float32)
        buf = self._bufs[slot][:size]
        buf.zero_()
        self.eval_link_s = 0.0
        row = buf[n + self.rank * FIELDS:n + (self.rank + 1) * FIELDS]
        grad_bytes0, grad_link0 = self.strategy.gradient_traffic()
        inner0 = self.step.ranks.bytes_sent if self.step.ranks is not None else 0
        sent = {"link_s": 0.0, "bytes": 0, "message": None, "round": plan.round, "part": whole_or(part, P),
                "columns": None if self._layouts is None else self._column_values(plan)}
        if self.has_data and plan.steps > 0:
            result = self.step.run(plan.steps, global_flat, round=plan.round, seconds=plan.seconds, part=part,
                                   arrived=self._arrived)
            stats, finite = result.stats, result.finite
            if result.counts and self.codec is None:
                torch.mul(result.delta, float(stats.samples), out=buf[:n])
            sent["message"] = result.message
            if not finite:
                log.warning("worker %d: loss or weights became NaN/Inf in round %d; left out of the average",
                            self.rank, plan.round)
            loss_sum = stats.loss * stats.samples if result.counts else 0.0
            row.copy_(torch.tensor([stats.samples if finite else 0, loss_sum, stats.steps, stats.wall_s,
                                    1.0 if finite else 0.0, stats.samples, self._last_sync_s]))
            compute_s = stats.wall_s
        else:
            row[4], row[6] = 1.0, self._last_sync_s
            compute_s = 0.0
        sent["gradient"] = grad_bytes0, grad_link0
        if self.step.ranks is not None and self.step.ranks.averages:
            sent["inner_bytes"] = self.step.ranks.bytes_sent - inner0
        if streaming is None or not streaming.overlap:
            self._arrived = part
            return self._update(self._finish(self._start(buf, n, plan, sent)))
        # overlapped: this round's sums travel while the next round trains; the last round waits for both
        arrived = None if self._in_flight is None else self._update(self._finish(self._in_flight))
        self._in_flight = None
        handle = self._start(buf, n, plan, sent)
        if plan.last:
            return late_update(arrived, self._update(self._finish(handle)))
        self._in_flight = handle
        self._arrived = None if arrived is None else (arrived.part or slice(0, P))
        return late_update(arrived, RoundUpdate(
            total=None, samples=0, loss_sum=0.0, steps=plan.steps if self.has_data else 0, processed=0,
            compute_s=compute_s, slowest_steps=plan.steps, nbytes=handle.sent["bytes"]))

    def _part(self, plan: RoundPlan, numel: int) -> slice:
        """The weights a streamed round exchanges, in this rank's flat: a fragment of the whole weights, of which a
        sharded replica's rank holds its own values (so each column exchanges the fragment a whole replica would)."""
        if self._layout is None:
            return self.streaming.part(plan.round, numel, last=plan.last)
        return shard_slice(self._whole_part(plan), self._layout)

    def _whole_part(self, plan: RoundPlan) -> slice:
        """A sharded replica's round: the slice of the whole weights it exchanges."""
        whole = sum(box_size(box) for box in self._layout)
        return slice(0, whole) if self.streaming is None else self.streaming.part(plan.round, whole, last=plan.last)

    def _column_values(self, plan: RoundPlan) -> list[int]:
        """A sharded replica's round: the values each column of the worker exchanges (its ranks' part of it)."""
        part = self._whole_part(plan)
        return [(mine := shard_slice(part, layout)).stop - mine.start for layout in self._layouts]

    def _update(self, done: _Done) -> RoundUpdate:
        """The round's update from its finished exchange: the sums, and every rank's row."""
        rows, total, sent = done.rows, done.total, done.sent
        prev_sync = float(rows[:, 6].max())  # every rank's last sync time, the slowest's: the same everywhere
        self._last_sync_s = done.seconds
        grad_bytes, grad_link = (now - before for now, before in zip(self.strategy.gradient_traffic(),
                                                                      sent["gradient"]))
        slowest = int(torch.argmax(rows[:, 3]))
        fields = {
            "allreduce_s": done.seconds,
            "per_worker": [{"rank": i, "samples": int(rows[i, 5]), "steps": int(rows[i, 2]),
                            "loss": float(rows[i, 1] / rows[i, 0]) if rows[i, 0] > 0 else None,
                            "compute_s": float(rows[i, 3]), "finite": bool(rows[i, 4] > 0)}
                           for i in range(self.world)],
        }
        if "inner_bytes" in sent:
            fields["inner_allreduce_bytes"] = sent["inner_bytes"]
        if "gather_bytes" in sent:
            fields["inner_gather_bytes"] = sent["gather_bytes"]
        if self.link is not None:
            fields["link_s"] = sent["link_s"] + grad_link
        if self.streaming is not None:
            part = sent["part"]
            fields.update(fragment=None if part is None else sent["round"] % self.streaming.fragments,
                          overlap_wait_s=done.waited_s)
        return RoundUpdate(
            total=total, samples=float(rows[:, 0].sum()), loss_sum=float(rows[:, 1].sum()),
            steps=int(rows[:, 2].max()), processed=int(rows[:, 5].sum()), compute_s=float(rows[slowest, 3]),
            slowest_steps=int(rows[slowest, 2]),
            nbytes=sent["bytes"] + (2 * (self.world - 1) * grad_bytes if self.world > 1 else 0),
            nonfinite=tuple(i for i in range(self.world) if rows[i, 4] == 0),
            sync_s=prev_sync, observe=prev_sync >= 0, fields=fields, part=sent["part"])

    def _start(self, buf: torch.Tensor, n: int, plan: RoundPlan, sent: dict) -> _InFlight:
        """Start the round's one collective over ``buf`` (``n`` weighted delta values, then the rows; a worker of
        several processes holding its replica whole: this rank's piece of it). Overlapped, the simulated link's wait
        is what is left of it when the exchange is waited for; otherwise all of it, before the collective starts."""
        world, rank, link, codec = self.world, self.rank, self.link, self.codec
        overlapped = self.streaming is not None and self.streaming.overlap
        t = time.perf_counter()
        size = 0
        if codec is None:
            piece, gathered = buf.view(self._pieces, -1)[self._piece], None
            nbytes = piece.numel() * 4
            delay = link.allreduce_delay(nbytes, world) if link is not None else 0.0
        else:
            row = buf[n + rank * FIELDS:n + (rank + 1) * FIELDS].clone()
            body = sent["message"] if sent["message"] is not None else torch.zeros(codec.wire_nbytes(n),
                                                                                   dtype=torch.uint8)
            message = torch.cat([row.view(torch.uint8), body])
            size = message.numel()
            piece = torch.nn.functional.pad(message, (0, -size % self._pieces)).view(self._pieces, -1)[self._piece]
            delay = link.allgather_delay(piece.numel(), world) if link is not None else 0.0
            gathered = [torch.empty_like(piece) for _ in range(world)]
        if not overlapped and delay > 0:  # all of the link's wait, before the collective starts
            time.sleep(delay)
            sent["link_s"] += delay
            delay = 0.0
        if gathered is None:
            work = dist.all_reduce(piece, group=self.group, async_op=True)
        else:
            work = dist.all_gather(gathered, piece, group=self.group, async_op=True)
        # the round's bytes between the workers, every column of a worker of several processes counted: a whole
        # replica's columns carry pieces of one size, a split one's columns parts of one size, a sharded one's
        # columns their own parts
        if sent["columns"] is not None:
            sent["bytes"] += sum(self._allreduce_bytes(values + world * FIELDS) if codec is None else
                                 self._allgather_bytes(FIELDS * 4 + self._column_codecs[j].wire_nbytes(values))
                                 for j, values in enumerate(sent["columns"]))
        else:
            sent["bytes"] += self._columns * (self._allreduce_bytes(piece.numel()) if codec is None else
                                              self._allgather_bytes(piece.numel()))
        return _InFlight(work, buf, n, gathered, sent, delay, t, size)

    def _allreduce_bytes(self, values: int) -> int:
        """Bytes a ring allreduce of ``values`` float32 values over the workers moves in all."""
        return 2 * (self.world - 1) * 4 * values

    def _allgather_bytes(self, nbytes: int) -> int:
        """Bytes a ring all-gather of one ``nbytes`` message from each worker moves in all."""
        return self.world * (self.world - 1) * nbytes

    def _finish(self, flight: _InFlight | _Done) -> _Done:
        """Wait for an exchange (and what is left of its link's wait); the weighted delta sum lands in its
        buffer's first ``n`` values, identical on every rank. One finished already (kept for a checkpoint) is
        itself."""
        if isinstance(flight, _Done):
            return flight
        t_wait = time.perf_counter()
        left = flight.delay - (t_wait - flight.t)
        if left > 0:
            time.sleep(left)
        if flight.delay:
            flight.sent["link_s"] += max(left, 0.0)
        flight.work.wait()
        buf, n, sent, gathered = flight.buf, flight.n, flight.sent, flight.gathered
        if self._pieces > 1:  # every column's piece, from the worker's other ranks (on its host)
            gathered = self._gather_pieces(buf, gathered, flight.size, sent)
        now = time.perf_counter()
        rows_end = n + self.world * FIELDS
        if gathered is None:
            return _Done(buf[n:rows_end].view(self.world, FIELDS).double(), buf[:n], sent, now - flight.t,
                         now - t_wait)
        head = FIELDS * 4
        rows = torch.stack([g[:head].clone().view(torch.float32) for g in gathered]).double()
        buf[:n].zero_()
        for i, g in enumerate(gathered):
            if rows[i, 0] > 0:
                buf[:n] += self.codec.decode(g[head:], n) * float(rows[i, 0])
        return _Done(rows, buf[:n], sent, now - flight.t, now - t_wait)

    def _gather_pieces(self, buf: torch.Tensor, gathered: list | None, size: int, sent: dict) -> list | None:
        """The worker's ranks trade the pieces their columns exchanged: the summed buffer whole in ``buf``, or each
        rank's message whole (``size`` bytes) from its pieces. The bytes they move stay inside the worker."""
        G, group = self._pieces, self.step.ranks.group
        if gathered is None:
            pieces = buf.view(G, -1)
            dist.all_gather(list(pieces.unbind(0)), pieces[self._piece].clone(), group=group)
            sent["gather_bytes"] = G * (G - 1) * pieces[0].numel() * 4
            return None
        mine = torch.cat(gathered)  # every rank's piece this column carried, in rank order
        theirs = [torch.empty_like(mine) for _ in range(G)]
        dist.all_gather(theirs, mine, group=group)
        sent["gather_bytes"] = G * (G - 1) * mine.numel()
        return [torch.cat([t.view(self.world, -1)[k] for t in theirs])[:size] for k in range(self.world)]

    # -- evaluation ---------------------------------------------------------------------------
    def agree(self, due: bool) -> bool:
        flag = torch.tensor([1 if due else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.everyone)
        return bool(flag.item())

    def evaluate(self, global_flat: torch.Tensor, rows: int | None = None, rest_of: int | None = None):
        if self.validation is None:
            return None
        waited = {"link_s": 0.0}
        world = dist.get_world_size(self.scoring)

        def per_rank(screen_rows: int | None) -> int | None:  # each rank's part of a screen
            return None if screen_rows is None else -(-screen_rows // world)

        result = evaluate_shards(self.net, global_flat, self.validation, group=self.scoring,
                                 keep_local=self.strategy.keeps_local_weights or self.streaming is not None,
                                 link=self.link, waited=waited, sample=per_rank(rows), rest_of=per_rank(rest_of),
                                 outputs=self.outputs)
        self.eval_link_s = waited["link_s"]
        return result


def evaluate_shards(net, global_flat: torch.Tensor, validation, *, group=None, keep_local: bool = False, link=None,
                    waited: dict | None = None, sample: int | None = None, rest_of: int | None = None,
                    outputs: int | None = None) -> EvalResult:
    """Loss and metrics of the global weights over every rank's share of the validation rows.

    One allreduce of (count, loss, the rows' total sample weight where ``validation`` is ``(x, y, w)``) and the task's
    :func:`~sparknet.labels.task_sums` over ``group``, so every rank gets the same numbers; ``net`` gets its own
    weights back afterwards when ``keep_local`` (EASGD). ``sample``: each rank scores at most that many of its rows (a
    fixed random sample); ``rest_of``: each rank scores the rows such a sample leaves out. ``outputs``: the net's
    (a classifier's classes), so that its F1 by class sums too; without, its accuracies alone
    (:func:`~sparknet.labels.task_width`).
    """
    unlabelled = net.task is Task.UNLABELLED
    local = net.get_flat() if keep_local else None
    net.set_flat(global_flat)
    x, y, w = (*validation, None)[:3]
    head = 2 if w is None else 3  # (count, loss sum[, weight])
    width = 0 if unlabelled else task_width(net.task, tuple(y.shape[1:]), outputs)
    t = torch.zeros(head + width, dtype=torch.float64)
    res = net.evaluate((x, y), sample=sample, rest_of=rest_of, weights=w) if len(x) else None
    if res is not None and res.samples:
        loss_sum = res.loss * res.counted if res.counted else 0.0  # a share of weight 0 has a NaN mean loss
        t[:] = torch.tensor([float(res.samples), loss_sum, *([] if w is None else [res.weight]),
                             *res.sums[:width]], dtype=torch.float64)
    if link is not None and waited is not None:
        waited["link_s"] += link.wait_allreduce(t.numel() * 8, dist.get_world_size(group))
    dist.all_reduce(t, group=group)
    if local is not None:
        net.set_flat(local)
    return EvalResult.of(net.task, int(t[0]), float(t[1]), None if unlabelled else t[head:].tolist(),
                         None if w is None else float(t[2]))
