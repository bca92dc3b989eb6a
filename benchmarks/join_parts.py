"""What the driver spends cutting a sharded replica's state into its parts and joining them again: AlexNet's
60,965,224 weights (the seed's model, built on the meta device: no values but the flat buffer) cut into the parts of
2 and 4 processes as FSDP2 shards them, and joined.

    python benchmarks/join_parts.py                       # this tree, about ten seconds
    python benchmarks/join_parts.py --baseline 39e0c2c    # and that commit's tree beside it, alternately

The driver cuts the starting state once (``parallel.mesh.cut_shard`` for each part) and joins the first worker's parts
of the global weights every round their state is due (``parallel.mesh.join_shards``). Each tree is timed in a fresh
interpreter, its best of ``--repeats`` joins; the trees take turns ``--rounds`` times. Prints and saves JSON with the
load average sampled before and during.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, save_json, source_trees  # noqa: E402

PROBE = r"""
import json, sys, time
import torch
from sparknet import zoo
from sparknet.net import Net
from sparknet.parallel.mesh import cut_shard, join_shards

net = Net(zoo.alexnet(batch_size=2), device="meta")
values = sum(t.numel() for ts in net.weights.values() for t in ts)
whole = torch.randn(values, generator=torch.Generator().manual_seed(0))
out = {"values": whole.numel()}
for parts in (2, 4):
    # the layouts of a replica sharded over `parts` processes (an older tree named them Net.shard_layouts)
    layouts = net.cut_layouts(shard=parts) if hasattr(net, "cut_layouts") else net.shard_layouts(parts)
    t = time.perf_counter()
    pieces = [cut_shard(whole, layout) for layout in layouts]
    cut_s = time.perf_counter() - t
    joins = []
    for _ in range(int(sys.argv[1])):
        t = time.perf_counter()
        joined = join_shards(pieces, layouts)
        joins.append(time.perf_counter() - t)
    assert torch.equal(joined, whole)
    out[str(parts)] = {"cut_s": round(cut_s, 4), "join_s": round(min(joins), 4)}
print(json.dumps(out))
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="a commit to time beside this tree")
    p.add_argument("--rounds", type=int, default=2, help="turns each tree takes")
    p.add_argument("--repeats", type=int, default=3, help="joins in each turn (the best counts)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "join_parts.json"))
    args = p.parse_args(argv)
    runs: dict[str, list] = {}
    with tempfile.TemporaryDirectory(prefix="sparknet-join-") as where, LoadSampler() as load, \
            source_trees(ROOT, args.baseline, Path(where)) as trees:
        for _ in range(args.rounds):
            for name, src in trees.items():
                env = {**os.environ, "PYTHONPATH": str(src)}
                done = subprocess.run([sys.executable, "-c", PROBE, str(args.repeats)], env=env, check=True,
                                      capture_output=True, text=True, timeout=600)
                runs.setdefault(name, []).append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(json.dumps({name: runs[name][-1]}), flush=True)
    report = {"benchmark": "join_parts", "model": "alexnet", "runs": runs, **load.to_dict()}
    save_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
