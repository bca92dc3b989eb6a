"""What ``validationFraction``'s hash costs: a pass over a cached MNIST-sized DataFrame with and without it.

    python benchmarks/held_out_hash.py --repeats 5 --out benchmarks/results/held_out_hash.json

The Estimator's ``validationFraction`` holds out the rows whose seeded hash of their features and label falls in the
share (:func:`sparknet.spark.data.held_out`): the same rows however the data is partitioned, with no sort. Each of a
fit's reads of the two DataFrames (the training rows' conversion, the validation rows' collection) hashes every row
again. The peer is what ``validationIndicatorCol`` costs: a boolean column the user made beforehand, read as it is.

On ``local[2]``, 60,000 rows of 784 float32 numbers and a label, made from arrays and cached: each pass counts the
rows of ``filter(F)`` for ``F`` the hash's held-out rows, its training rows, the indicator's held-out rows, and none
(every row, the scan alone), passes alternating, ``--repeats`` times each; the load average is sampled before and
during. Time nothing else while it runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from _bench import LoadSampler, commit_of, save_json

ROWS, WIDTH, SHARE, SEED = 60_000, 784, 0.1, 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/held_out_hash.json")
    args = parser.parse_args(argv)

    import numpy as np
    from pyspark.sql import functions as F

    from sparknet.spark.data import frame_from_arrays, held_out
    from sparknet.spark.session import get_session

    spark = get_session("local[2]")
    try:
        rng = np.random.default_rng(0)
        x = rng.random((ROWS, WIDTH), dtype=np.float32)
        y = rng.integers(0, 10, ROWS)
        hashed = held_out(SEED, ["features", "label"], SHARE)
        frame = frame_from_arrays(spark, x, y).withColumn("held", hashed).repartition(2).cache()
        rows = frame.count()  # made and cached: the indicator is the hash's own rows, stored
        passes = {"scan alone": F.lit(True), "hash: held-out rows": hashed, "hash: training rows": ~hashed,
                  "indicator: held-out rows": F.col("held")}
        counts = {name: frame.filter(cond).count() for name, cond in passes.items()}  # a warm-up pass each
        seconds: dict[str, list[float]] = {name: [] for name in passes}
        with LoadSampler() as load:
            for _ in range(args.repeats):
                for name, cond in passes.items():
                    t0 = time.perf_counter()
                    frame.filter(cond).count()
                    seconds[name].append(round(time.perf_counter() - t0, 4))
        medians = {name: statistics.median(s) for name, s in seconds.items()}
        result = {"commit": commit_of(), "master": "local[2]", "rows": rows, "width": WIDTH, "share": SHARE,
                  "rows_kept": counts, "seconds": seconds, "medians_s": medians,
                  "hash_cost_per_pass_s": round(medians["hash: held-out rows"] - medians["scan alone"], 4),
                  **load.to_dict()}
    finally:
        spark.stop()
    print(json.dumps({k: result[k] for k in ("medians_s", "hash_cost_per_pass_s", "rows_kept")}))
    save_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
