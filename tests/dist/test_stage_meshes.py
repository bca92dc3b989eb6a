"""A Python worker that Spark reuses for a second barrier stage, where it is another rank: two real gloo processes
swap ranks between two process groups, sharding a replica with FSDP2 in each (a data-parallel x model-parallel mesh
of 2 x 1, so each rank's model-parallel group is its own).

DTensor caches its sharding decisions with the device mesh they were made on, and a mesh compares equal to any other
of the same shape whatever its groups: unless the first group's end forgets them, the second stage's net is handed
the first stage's mesh, whose group this process never joined."""

import os
import tempfile

import pytest
import torch.distributed as dist

from _two_ranks import run_two_ranks
from sparknet import zoo
from sparknet.net import Net
from sparknet.parallel.mesh import cut_shard, init_layout, leave_process_group


def _shard(out, key):
    layout = init_layout(1, copies=2)  # one worker of two processes, its replica sharded over both (a stage's mesh)
    whole = Net(zoo.mlp(input_shape=[6], hidden=[7], num_classes=3), seed=4)
    net = Net(zoo.mlp(input_shape=[6], hidden=[7], num_classes=3), seed=4, device="meta")
    net.shard(layout.inner_mesh, "cpu")  # built on its parts: FSDP2 makes them through DTensor's cached decisions
    mine = whole.cut_layouts(shard=2)[layout.inner_rank]
    net.set_flat(cut_shard(whole.get_flat(), mine))
    try:
        out[key] = net.shard_layout() == mine
    except RuntimeError as exc:
        out[key] = str(exc)


def _two_stages(rank, out, folder, leave):
    _shard(out, f"first{rank}")
    dist.barrier()
    if leave:
        leave_process_group()  # what a barrier stage's task does as it ends
    else:
        dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'second')}", rank=1 - rank,
                            world_size=2)
    _shard(out, f"second{1 - rank}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("leave", [True, False])
def test_a_process_that_is_another_rank_in_a_later_stage_shards_on_that_stages_groups(leave):
    with tempfile.TemporaryDirectory(prefix="sparknet-stages-") as folder:
        out = run_two_ranks(_two_stages, folder, leave)
    assert out["first0"] is True and out["first1"] is True
    if leave:
        assert out["second0"] is True and out["second1"] is True
    else:  # torch's own teardown keeps the old meshes, the failure leave_process_group exists for: each rank of the
        # second stage is handed the first's, in which it had the other place, and holds the other rank's part (or
        # fails on a process group that is gone)
        assert all(out[f"second{r}"] is not True for r in (0, 1)), out
