"""Character-level LSTM on the complete works of Shakespeare: K workers, periodic averaging.

    python examples/char_lstm.py --workers 2 --out runs/char_lstm
    sparknet sample --model-dir runs/char_lstm/model --prime "ROMEO:"
    python examples/char_lstm.py --quick               # a tiny LSTM, 3 rounds on 20,000 characters (seconds)

Paper 001's LSTM experiment, the SparkNet way: each worker trains ``zoo.char_lstm`` with
RMSprop on its own partition of the corpus (blocks dealt round-robin) for a round (``--tau`` steps or ``--round-seconds``,
whichever comes first: time-budgeted rounds, so no worker waits for a straggler), then the
workers average their weights (one allreduce of one flat buffer over a gloo group on
loopback: sparknet's round loop with the exchange the barrier engine runs, here with the
example's own local steps), and again, until the
validation bits per character reach ``--target-bpc`` or the time budget runs out. What is
kept is a moving average of the global weights over rounds (``--ema``: the round loop's
``WeightAverage``, what ``--weight-ema`` gives ``sparknet train``); every probe scores both it and
the global weights, and the target is judged on the average.

Truncated backpropagation through time: the corpus is cut into sequences of ``--seq-len``
characters; each sequence starts from a zero LSTM state (the hidden state is *not* carried
from one batch to the next), so gradients flow back at most ``seq-len`` steps.

Bits per character are the mean cross entropy in nats divided by ln 2 on the validation
split (the last 5% of the corpus, 252,866 characters), read in windows of
``--eval-seq-len`` characters with the state carried through each window (the first
characters of a window lack context; with 64-character windows they add about 0.06 bits).
At the end rank 0 prints a sample, saves a model folder (with the vocabulary in its
manifest, for ``sparknet sample``) and writes ``result.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparknet import zoo
from sparknet.datasets import shakespeare
from sparknet.net import EvalResult, Net, TrainStats
from sparknet.collective import CollectiveExchange
from sparknet.loop import EvalPlan, FitPlan, Progress, StopRule, WeightAverage, run_rounds
from sparknet.sample import sample_text
from sparknet.solvers import SolverConfig
from sparknet.strategies import make_strategy
from sparknet.step import worker_seed

log = logging.getLogger("char_lstm")

LN2 = math.log(2.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _val_bpc(net: Net, x: np.ndarray, y: np.ndarray, group_size: int) -> float:
    """Bits per character of ``net`` on (x, y), the rows split across the group and summed."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    xs, ys = x[rank::group_size], y[rank::group_size]
    res = net.evaluate((xs, ys), batch_size=256) if len(xs) else None
    t = torch.tensor([res.loss * res.samples if res else 0.0, float(res.samples if res else 0)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1]) / LN2


def partition(ids: np.ndarray, rank: int, world: int, block: int) -> np.ndarray:
    """Worker ``rank``'s partition of the text: blocks of ``block`` characters dealt round-robin.

    Every worker gets pieces of every play (as a Spark repartition would give), rather
    than one contiguous half of the works each.
    """
    if world == 1:
        return ids
    starts = range(rank * block, len(ids), world * block)
    return np.concatenate([ids[s:s + block] for s in starts])


class StatefulTrainer:
    """Truncated BPTT with the LSTM state carried from one batch to the next (as char-rnn trains).

    The worker's text is cut into ``batch`` contiguous streams; step ``k`` trains on
    characters ``[k*T, (k+1)*T)`` of every stream, starting from the state step ``k-1``
    ended in (detached: gradients still flow back at most ``T`` steps, but the model sees
    and learns from all the context before). When the streams run out, the state resets and
    they restart at a random offset. It drives the same ``Net`` (its optimizer, learning-rate
    schedule, clipping and weights) as ``Net.train`` would, so averaging is unchanged.
    """

    def __init__(self, net: Net, ids: np.ndarray, batch: int, seq_len: int, seed: int) -> None:
        module = net.module
        self.net = net
        self.embed, self.lstm, self.head = (module.layer_module(n) for n in ("embed", "lstm", "logits"))
        self.ids, self.batch, self.seq_len = ids, batch, seq_len
        self.rng = np.random.default_rng(seed)
        self.state = None
        self._restart()

    def _restart(self) -> None:
        offset = int(self.rng.integers(0, self.seq_len))
        n = (len(self.ids) - 1 - offset) // self.batch
        block = self.ids[offset: offset + n * self.batch + 1]
        self.x = torch.from_numpy(np.ascontiguousarray(block[:-1].reshape(self.batch, n)))
        self.y = torch.from_numpy(np.ascontiguousarray(block[1:].reshape(self.batch, n)))
        self.pos, self.state = 0, None

    def __call__(self, steps: int, max_seconds: float | None = None) -> TrainStats:
        net, opt, sched, clip = self.net, self.net.optimizer, self.net.scheduler, self.net.solver.clip_gradients
        net.module.train()
        t0 = time.perf_counter()
        done, loss_sum, last = 0, 0.0, math.nan
        for _ in range(steps):
            if max_seconds is not None and done and time.perf_counter() - t0 >= max_seconds:
                break
            if self.pos + self.seq_len > self.x.shape[1]:
                self._restart()
            xb = self.x[:, self.pos:self.pos + self.seq_len]
            yb = self.y[:, self.pos:self.pos + self.seq_len]
            self.pos += self.seq_len
            out, state = torch.nn.LSTM.forward(self.lstm, self.embed(xb), self.state)
            self.state = tuple(s.detach() for s in state)
            logits = self.head(out)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(net.module.parameters(), clip)
            opt.step()
            sched.step()
            net.iteration += 1
            last = loss.item()
            loss_sum += last
            done += 1
        return TrainStats(steps=done, samples=done * self.batch, loss=loss_sum / max(done, 1), last_loss=last,
                          wall_s=time.perf_counter() - t0, finite=math.isfinite(loss_sum))


def _setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, t_start: float) -> None:
    _setup_logging()  # spawned processes start with a fresh logging configuration
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    try:
        _train(rank, world, args, t_start)
        dist.barrier()  # no rank closes its gloo pairs while another still uses them
    except Exception:
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned_worker(rank: int, world: int, port: int, args: argparse.Namespace, t_start: float) -> None:
    """``_worker`` in a process of its own, which leaves with ``os._exit`` once rank 0 has written the result:
    gloo's threads can abort the interpreter's own shutdown ("terminate called without an active exception",
    SIGABRT), which ``mp.spawn`` reports as a failed worker although the work was done."""
    code = 1
    try:
        _worker(rank, world, port, args, t_start)
        code = 0
    finally:  # a failure's traceback is printed already; the parent sees the exit code
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _CharExchange(CollectiveExchange):
    """The round loop's allreduce, scored in bits per character on the probe set, and a wall-clock budget
    every worker agrees on (the slowest worker's clock decides, so all stop on the same round)."""

    def __init__(self, net: Net, strategy, args: argparse.Namespace, *, rank: int, world: int, trainer, probe,
                 t_start: float):
        super().__init__(net, strategy, rank=rank, world=world, train=trainer)
        self.args, self.probe, self.t_start = args, probe, t_start
        self.elapsed_s = 0.0

    def evaluate(self, global_flat: torch.Tensor, rows: int | None = None):  # always the whole probe set
        self.net.set_flat(global_flat)
        bpc = _val_bpc(self.net, self.probe.x, self.probe.y, self.world)
        return EvalResult(loss=bpc, accuracy=math.nan, samples=len(self.probe.x))  # scored by bits per char alone

    def stop_reason(self, record: dict, progress) -> str | None:
        elapsed = torch.tensor([time.time() - self.t_start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        self.elapsed_s = float(elapsed)
        scored = "val_ema_loss" if self.args.ema else "val_loss"  # the weights the run keeps
        if scored in record and record[scored] < self.args.target_bpc:
            return "target_bpc"
        if self.elapsed_s > self.args.minutes * 60 - self.args.final_eval_s:
            return "minutes"
        return None


def _train(rank: int, world: int, args: argparse.Namespace, t_start: float) -> None:
    corpus = shakespeare()
    if args.train_chars:
        corpus.train = corpus.train[: args.train_chars]
    val = corpus.sequences("validation", args.eval_seq_len)
    probe = val.subset(min(len(val), args.eval_sequences), seed=0)
    if args.final_sequences:
        val = val.subset(min(len(val), args.final_sequences), seed=0)
    solver = SolverConfig(type="rmsprop", base_lr=args.lr, rms_decay=args.rms_decay, clip_gradients=args.clip,
                          lr_policy="inv", gamma=args.lr_gamma, power=0.75)
    net_def = zoo.char_lstm(corpus.vocab_size, seq_len=args.seq_len, hidden=args.hidden,
                            num_layers=args.num_layers, batch_size=args.batch_size, embed_dim=args.embed_dim)
    seed = worker_seed(args.seed, rank)
    torch.manual_seed(seed)
    # The same initial weights on every worker, but each worker its own data order.
    net = Net(net_def.build(seed=args.seed), solver, batch_size=args.batch_size, seed=seed)
    shard = partition(corpus.train, rank, world, args.block_chars)
    trainer = None
    if args.carry_state:
        trainer = StatefulTrainer(net, shard, args.batch_size, args.seq_len, seed)
    else:
        windows = np.lib.stride_tricks.sliding_window_view(shard, args.seq_len + 1)[::args.seq_len]
        net.set_training_data((np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])))
    strategy = make_strategy(args.strategy, num_workers=world)
    global_flat = strategy.init_global(net.get_flat())
    bpc = _val_bpc(net, probe.x, probe.y, world)
    if rank == 0:
        log.info("%d workers, %s parameters, start bpc %.3f", world, f"{global_flat.numel():,}", bpc)
    exchange = _CharExchange(net, strategy, args, rank=rank, world=world, trainer=trainer, probe=probe,
                             t_start=t_start)
    ema = WeightAverage(args.ema, global_flat) if args.ema else None
    history = []
    progress = Progress()

    def on_record(record: dict) -> None:
        if "val_loss" not in record:
            return
        entry = {"round": record["round"], "steps": record["total_steps"], "elapsed_s": round(exchange.elapsed_s, 1),
                 "train_bpc": record["loss"] / LN2, "val_bpc": record["val_ema_loss" if ema else "val_loss"],
                 "val_bpc_global": record["val_loss"], "compute_s": record["compute_s"],
                 "sync_s": record["allreduce_s"]}
        history.append(entry)
        if rank == 0:
            log.info("round %d step %d %.0fs: train %.3f bpc, validation %.3f bpc (sync %.1f ms)", entry["round"],
                     entry["steps"], entry["elapsed_s"], entry["train_bpc"], entry["val_bpc"], entry["sync_s"] * 1e3)

    stop = StopRule(rounds=args.rounds, tau=args.tau, round_seconds=args.round_seconds)
    plan = FitPlan(strategy=strategy, stop=stop, evaluation=EvalPlan(every=args.eval_every), average=ema,
                   weight_ema=args.ema or None, progress=progress)
    kept = run_rounds(exchange, plan, global_flat, on_record=on_record)
    steps, rounds = progress.steps_done, progress.round
    # the last round is always scored: its val_loss is the last global weights' probe bits per character
    probe_global = history[-1]["val_bpc_global"] if ema is not None else None
    net.set_flat(kept)
    final = _val_bpc(net, val.x, val.y, world)
    if rank != 0:
        return
    wall = time.time() - t_start
    text = sample_text(net, corpus, prime=args.prime, length=args.sample_length, temperature=args.temperature,
                       seed=args.seed, context=args.sample_context)
    result = {
        "workers": world, "strategy": str(args.strategy), "tau": args.tau, "hidden": args.hidden,
        "num_layers": args.num_layers, "seq_len": args.seq_len, "batch_size": args.batch_size, "lr": args.lr,
        "embed_dim": args.embed_dim, "round_seconds": args.round_seconds, "lr_policy": "inv",
        "lr_gamma": args.lr_gamma, "parameters": int(global_flat.numel()), "steps_per_worker": steps,
        "rounds": rounds, "wall_s": round(wall, 1), "validation_bpc": final, "ema": args.ema,
        "probe_bpc_of_last_global_weights": probe_global, "validation_chars": int(val.y.size),
        "validation_window": args.eval_seq_len, "target_bpc": args.target_bpc, "reached": final < args.target_bpc,
        "hidden_state": (("training: carried from batch to batch along contiguous streams (truncated BPTT "
                          "of seq_len)" if args.carry_state else
                          "training: reset to zero at every sequence of seq_len (not carried across batches)")
                         + "; validation: carried through windows of validation_window characters"),
        "sample": {"prime": args.prime, "temperature": args.temperature, "text": text},
        "history": history, "torch": torch.__version__, "threads_per_worker": args.threads,
    }
    print(f"\nvalidation: {final:.3f} bits per character after {wall / 60:.1f} min "
          f"({steps} steps per worker, {world} workers)\n")
    print(args.prime + text + "\n")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        from sparknet.model_io import save_model

        save_model(out / "model", net_def, net.get_weights(), solver=solver, metadata={"vocab": "".join(corpus.vocab), "corpus": "shakespeare",
                                                  "validation_bpc": final}, overwrite=True)
        (out / "result.json").write_text(json.dumps(result, indent=1))
        log.info("saved %s and %s", out / "model", out / "result.json")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a tiny LSTM for 3 rounds of 10 steps on the first 20,000 characters (seconds); "
                        "flags given explicitly still win")
    p.add_argument("--workers", type=int, default=2, help="worker processes (gloo on loopback)")
    p.add_argument("--strategy", default="average", help="average, diloco or easgd")
    p.add_argument("--ema", type=float, default=0.9,
                   help="evaluate and keep a moving average of the global weights over rounds (Polyak "
                        "averaging), this decay per round; 0 keeps the last global weights")
    p.add_argument("--tau", type=int, default=1000, help="local steps between averagings (at most)")
    p.add_argument("--minutes", type=float, default=14.5, help="time budget, start to the end of the final evaluation")
    p.add_argument("--target-bpc", type=float, default=2.0, help="stop once validation bits per character is below")
    p.add_argument("--rounds", type=int, default=None, help="stop after this many rounds (default: no limit)")
    p.add_argument("--round-seconds", type=float, default=4.0,
                   help="a round also ends after this many seconds (time-budgeted rounds: no straggler wait)")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64, help="characters per sequence (the truncated BPTT length)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-gamma", type=float, default=1e-3, help="'inv' decay: lr * (1 + gamma * step) ** -0.75")
    p.add_argument("--rms-decay", type=float, default=0.95)
    p.add_argument("--clip", type=float, default=5.0, help="gradient norm clipping (0: off)")
    p.add_argument("--eval-every", type=int, default=15, help="rounds between validation probes")
    p.add_argument("--eval-seq-len", type=int, default=1024,
                   help="validation window: the state is carried through it (the first characters of a window "
                        "lack context, so short windows overstate bits per character)")
    p.add_argument("--eval-sequences", type=int, default=40, help="validation windows per probe")
    p.add_argument("--final-eval-s", type=float, default=60.0, help="seconds kept for the final full evaluation")
    p.add_argument("--final-sequences", type=int, default=None,
                   help="evaluate the final weights on this many validation windows (default: all of them)")
    p.add_argument("--train-chars", type=int, default=None, help="use only the first N training characters")
    p.add_argument("--block-chars", type=int, default=1 << 16,
                   help="the training text is dealt to the workers in blocks of this many characters")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--carry-state", action=argparse.BooleanOptionalAction, default=True,
                   help="carry the LSTM state from batch to batch (stateful truncated BPTT); "
                        "--no-carry-state starts every sequence from zero")
    p.add_argument("--prime", default="ROMEO:")
    p.add_argument("--sample-context", type=int, default=256, help="characters the model sees per sampled one")
    p.add_argument("--sample-length", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--out", default=None, help="folder for the model and result.json")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    return p


# What --quick sets, for every flag left at its default.
QUICK = {"tau": 10, "rounds": 3, "round_seconds": 30.0, "hidden": 32, "embed_dim": 16, "seq_len": 32,
         "batch_size": 8, "eval_every": 1, "eval_seq_len": 128, "eval_sequences": 4, "final_sequences": 16,
         "final_eval_s": 0.0, "train_chars": 20_000, "block_chars": 2_000, "sample_length": 40,
         "sample_context": 64, "target_bpc": 0.0}


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    for name in ("workers", "tau", "seq_len", "batch_size", "hidden", "eval_every"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    return args


def main(argv=None) -> dict:
    """Run the example (``--workers`` processes); returns rank 0's result (also ``result.json`` under ``--out``)."""
    import tempfile

    args = parse_args(argv)
    _setup_logging()
    t_start = time.time()
    shakespeare()  # fetch and cache once, before the workers read it
    with tempfile.TemporaryDirectory(prefix="char-lstm-") as tmp:
        args.result_file = str(Path(tmp) / "result.json")
        if args.workers == 1:
            _worker(0, 1, _free_port(), args, t_start)
        else:
            mp.spawn(_spawned_worker, args=(args.workers, _free_port(), args, t_start), nprocs=args.workers, join=True)
        result = json.loads(Path(args.result_file).read_text())
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
