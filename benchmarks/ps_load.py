"""Load test of the parameter server: many clients pushing LeNet-sized deltas on loopback.

Run it with::

    python benchmarks/ps_load.py                       # 16 client processes, 30 s, LeNet size
    python benchmarks/ps_load.py --clients 4 --seconds 5 --mode threads

A :class:`~sparknet.ps.ParameterServer` with the ``delta`` combiner runs in this process;
``--clients`` client processes (or threads) connect over loopback and push, back to back,
a flat delta of ``--numel`` float32 values (LeNet's 431,080 by default), each push answered
with the server's new copy (one round trip, as in training). Client ``c`` always pushes the
constant ``(c + 1) * 2**-12`` and the initial weights are multiples of ``2**-12`` too, so
every float32 sum is exact: at the end the server's weights must equal the initial weights
plus the exact sum of every accepted delta, and the count of accepted pushes must equal the
count sent (nothing lost, nothing applied twice).

Pushes in the first ``--warmup`` seconds count toward that check but not toward the rates
and latencies, which cover the next ``--seconds``. Prints and saves JSON (default
``benchmarks/results/ps_load.json``): pushes per second overall and per one-second window,
p50/p99 latency, and the server's counters.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import platform
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler  # noqa: E402

UNIT = 2.0 ** -12


def client_loop(endpoint: str, job_id: bytes, secret: bytes, keys, client: int, numel: int, ready, go, schedule,
                results) -> None:
    """One client: say it is ready, wait for ``go``, pull once, push its constant delta until the end.

    ``schedule`` holds (start, measure_from, stop) as Unix times, set before ``go``.
    """
    from sparknet.ps import PSClient, Status

    delta = np.full(numel, (client + 1) * UNIT, dtype=np.float32)
    sent = applied = 0
    latencies: list[float] = []
    times: list[float] = []
    error = None
    try:
        with PSClient(endpoint, job_id, secret, keys=keys, worker=client, timeout=60) as c:
            ready.put(client)
            if not go.wait(600):
                raise TimeoutError("no start signal within 600 s")
            start_at, measure_from, stop_at = schedule[:]
            while time.time() < start_at:
                time.sleep(0.001)
            reply = c.pull(0)
            step = 0
            while time.time() < stop_at:
                step += 1
                t = time.time()
                sent += 1
                reply = c.push(step, delta, reply.version)
                applied += reply.status is Status.APPLIED
                if t >= measure_from:
                    latencies.append(reply.latency_s)
                    times.append(t + reply.latency_s)
    except Exception as e:  # reported to the parent, which fails the run
        error = f"{type(e).__name__}: {e}"
    results.put({"client": client, "sent": sent, "applied": applied, "latencies": latencies, "times": times,
                 "error": error})


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of pushes before measuring")
    p.add_argument("--numel", type=int, default=431_080, help="elements per push (LeNet: 431,080)")
    p.add_argument("--mode", choices=("processes", "threads"), default="processes")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ps_load.json"))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    load = LoadSampler().start()

    from sparknet.ps import ParameterServer

    initial = (np.arange(args.numel) % 64).astype(np.float32) * np.float32(UNIT)
    server = ParameterServer(initial, "delta", host=args.host, num_workers=args.clients).start()
    workers: list = []
    try:
        creds = server.new_job()
        if args.mode == "processes":
            ctx = mp.get_context("spawn")
            results, ready, go, schedule = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Array("d", 3)
            spawn = ctx.Process
        else:
            import queue

            results, ready, go, schedule = queue.Queue(), queue.Queue(), threading.Event(), [0.0, 0.0, 0.0]
            spawn = threading.Thread
        workers = [spawn(target=client_loop, args=(server.endpoint, creds.job_id, creds.secret, server.client_keys, c,
                                                   args.numel, ready, go, schedule, results))
                   for c in range(args.clients)]
        for w in workers:
            w.start()
        for _ in workers:  # every client imported, connected and waiting
            ready.get(timeout=600)
        start_at = time.time() + 0.5
        measure_from = start_at + args.warmup
        stop_at = measure_from + args.seconds
        schedule[:] = [start_at, measure_from, stop_at]
        go.set()
        got = [results.get(timeout=stop_at - time.time() + 120) for _ in workers]
        for w in workers:
            w.join(30)
        stats = server.stats()
        final = server.weights()
    finally:
        server.stop()
        for w in workers:
            if isinstance(w, mp.process.BaseProcess) and w.is_alive():
                w.terminate()
                w.join(5)

    errors = [r["error"] for r in got if r["error"]]
    got.sort(key=lambda r: r["client"])
    sent = sum(r["sent"] for r in got)
    lat = np.array([x for r in got for x in r["latencies"]]) * 1e3
    done_times = np.array([x for r in got for x in r["times"]])
    windows = np.histogram(done_times, bins=max(1, int(args.seconds)), range=(measure_from, measure_from + int(args.seconds)))[0] if len(done_times) else np.array([0])
    expected = initial.astype(np.float64) + UNIT * sum((r["client"] + 1) * stats["applied_by_worker"].get(r["client"], 0) for r in got)
    exact = bool(np.array_equal(final.astype(np.float64), expected))
    counts_match = (stats["pushes_applied"] == sent and stats["pushes_received"] == sent
                    and all(stats["applied_by_worker"].get(r["client"], 0) == r["sent"] == r["applied"] for r in got))
    measured = len(lat)
    mb = args.numel * 4 / 1e6
    summary = {
        "benchmark": "ps_load",
        "config": {"clients": args.clients, "mode": args.mode, "seconds": args.seconds, "warmup_s": args.warmup,
                   "numel": args.numel, "payload_mb": mb, "combiner": "delta", "host": args.host},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **load.stop(),
        "pushes_sent": sent,
        "pushes_applied": stats["pushes_applied"],
        "pushes_measured": measured,
        "pushes_per_s": measured / args.seconds,
        "pushes_per_s_windows": {"min": int(windows.min()), "median": float(np.median(windows)), "max": int(windows.max())},
        "mb_per_s_each_way": measured * mb / args.seconds,
        "latency_ms": {"p50": float(np.percentile(lat, 50)) if measured else None,
                       "p99": float(np.percentile(lat, 99)) if measured else None,
                       "mean": float(lat.mean()) if measured else None,
                       "max": float(lat.max()) if measured else None},
        "per_client_pushes": [r["sent"] for r in got],
        "server_busy_fraction": stats["busy_s"] / (args.seconds + args.warmup),
        "staleness": {"mean": stats["staleness_mean"], "max": stats["staleness_max"],
                      "histogram": stats["staleness_histogram"]},
        "rejected": stats["rejected"],
        "weights_exact": exact,
        "accepted_equals_sent": counts_match,
        "errors": errors,
    }
    print(json.dumps(summary, indent=1))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    if errors or not exact or not counts_match or stats["rejected_total"]:
        raise SystemExit("ps_load: FAILED (see errors, weights_exact, accepted_equals_sent, rejected)")
    return summary


if __name__ == "__main__":
    main()
