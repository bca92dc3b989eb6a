"""The rows of a split copy's two gloo ranks: shared whole (each rank gets both partitions), or streamed (each rank
reads its own partition, and every batch is the two ranks' shares joined, the same on both)."""

from __future__ import annotations

import numpy as np

from _two_ranks import run_two_ranks


ROWS = (5, 12)  # rank 0's partition is smaller than some of its shares


def _partition(folder: str, rank: int):
    from sparknet.rowfile import RowFileWriter

    n = ROWS[rank]
    x = (1000 * rank + np.arange(n * 3, dtype=np.float32)).reshape(n, 3)
    y = 100 * rank + np.arange(n, dtype=np.int64)
    rows, _ = RowFileWriter.write(f"{folder}/p{rank}", [(x, y, {})])
    return rows


def _rank(rank, out, folder, batches):
    from sparknet.parallel import SharedStream, init_layout

    layout = init_layout(2)
    rows = _partition(folder, rank)
    shared = SharedStream(rows.stream(seed=rank, sample_shape=(3,)), layout)
    alone = rows.stream(seed=rank, sample_shape=(3,))  # the same stream, drawn by hand: this rank's shares
    out[f"rows{rank}"] = shared.rows
    for i, b in enumerate(batches):
        x, y = shared.next_batch(b)
        share = min(b // 2 + (rank < b % 2), ROWS[rank])
        out[f"batch{rank}_{i}"] = (x, y)
        out[f"share{rank}_{i}"] = alone.next_batch(share) if share else (np.zeros((0, 3)), np.zeros(0))
        out[f"epoch{rank}_{i}"] = shared.epoch
        if i == 2:
            saved = shared.state()
    again = SharedStream(rows.stream(seed=rank, sample_shape=(3,)), layout)  # resumed in a new stream
    again.load_state(saved)
    for i, b in enumerate(batches[3:], start=3):
        out[f"again{rank}_{i}"] = again.next_batch(b)


def test_the_two_ranks_draw_the_same_batches_each_from_its_own_partition(tmp_path):
    batches = [7, 7, 9, 4, 1, 7]
    out = run_two_ranks(_rank, str(tmp_path), batches)
    assert out["rows0"] == out["rows1"] == sum(ROWS)
    drawn = 0
    for i, b in enumerate(batches):
        (x0, y0), (x1, y1) = out[f"batch0_{i}"], out[f"batch1_{i}"]
        np.testing.assert_array_equal(x0, x1)
        np.testing.assert_array_equal(y0, y1)
        # rank 0's share first, then rank 1's, each the next rows of that rank's own stream; rank 0 holds only 5 rows
        shares = [min(b // 2 + (r < b % 2), ROWS[r]) for r in (0, 1)]
        assert len(x0) == len(y0) == sum(shares)
        for part, (xs, ys) in zip(np.split(np.arange(len(x0)), [shares[0]]), (out[f"share{r}_{i}"] for r in (0, 1))):
            np.testing.assert_array_equal(x0[part], xs)
            np.testing.assert_array_equal(y0[part], ys)
        assert set(y0[:shares[0]] // 100) <= {0} and set(y0[shares[0]:] // 100) <= {1}
        drawn += sum(shares)
        assert out[f"epoch0_{i}"] == out[f"epoch1_{i}"] == drawn // sum(ROWS)
    assert drawn > sum(ROWS)  # the copy made a second pass
    for i in range(3, len(batches)):  # a stream resumed from its state draws what the first drew next
        for r in (0, 1):
            for a, b in zip(out[f"again{r}_{i}"], out[f"batch{r}_{i}"]):
                np.testing.assert_array_equal(a, b)


def _share_rank(rank, out, folder):
    from sparknet.parallel import init_layout, share_data_over_mp

    x, y = _partition(folder, rank).arrays()  # memory maps of 5 and 12 rows
    layout = init_layout(2)
    out[f"shared{rank}"] = share_data_over_mp(x, y, layout)
    out[f"one{rank}"] = share_data_over_mp(*((None, None) if rank else (x, y)), layout)  # rank 1 has no rows


def test_ranks_of_unequal_partitions_share_all_their_rows_in_rank_order(tmp_path):
    out = run_two_ranks(_share_rank, str(tmp_path))
    x, y = out["shared0"]
    for a, b in zip(out["shared0"], out["shared1"]):
        np.testing.assert_array_equal(a, b)
    assert x.shape == (17, 3) and x.dtype == np.float32 and y.dtype == np.int64
    np.testing.assert_array_equal(y, np.concatenate([np.arange(5), 100 + np.arange(12)]))
    np.testing.assert_array_equal(x[5:], (1000 + np.arange(36, dtype=np.float32)).reshape(12, 3))
    for r in (0, 1):
        np.testing.assert_array_equal(out[f"one{r}"][0], x[:5])
        np.testing.assert_array_equal(out[f"one{r}"][1], y[:5])
