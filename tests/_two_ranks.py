"""Two gloo processes on loopback, for the tests that check sparknet against a by-hand reference.

``run_two_ranks(fn, *args)`` runs ``fn(rank, out, *args)`` in two new processes joined in
one gloo group (they meet through a file in a fresh folder, not a port another process could take in
between) and returns what they put in ``out`` (a manager dict). A rank that raises reports its
traceback there and the caller's assertion fails with it.

Both ranks meet at a barrier before they tear the group down, and each leaves with
``os._exit`` once its results are in ``out``: gloo's threads can otherwise abort the
interpreter's own shutdown ("terminate called without an active exception", SIGABRT), which
``mp.start_processes`` reports as a failed process although the work was done.
"""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# The ranks fork from one server process per test process that has torch and sparknet loaded already
# (started at the first call): a spawned rank would import them again, about three CPU-seconds each.
mp.set_forkserver_preload(["torch", "torch.distributed", "sparknet.net", "sparknet.loop", "sparknet.collective",
                           "sparknet.parallel"])


def run_two_ranks(fn, *args, timeout_s: float = 60.0) -> dict:
    manager = mp.Manager()
    try:
        out = manager.dict()
        with tempfile.TemporaryDirectory(prefix="sparknet-two-ranks-") as folder:
            store = os.path.join(folder, "store")
            mp.start_processes(_entry, args=(store, out, fn, args, timeout_s), nprocs=2, join=True,
                               start_method="forkserver")
        errors = {k: v for k, v in out.items() if str(k).startswith("error")}
        assert not errors, "\n".join(errors.values())
        return dict(out)
    finally:
        manager.shutdown()


def _entry(rank, store, out, fn, args, timeout_s):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        torch.set_num_threads(1)
        fn(rank, out, *args)
        dist.barrier()  # neither rank closes its pairs while the other still uses them
    except Exception:  # reported to the parent, which fails the test with the traceback
        out[f"error{rank}"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the results are in ``out``; skip an interpreter teardown that gloo can abort
