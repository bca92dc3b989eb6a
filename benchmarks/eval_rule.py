"""Which evaluation rule ends a run at its target soonest: the per-round scores of seeded runs, replayed.

    python benchmarks/eval_rule.py scores --seeds 0,1,2,3,4,5   # a run per seed, every round's weights scored
    python benchmarks/eval_rule.py replay                       # every rule over those scores

A seeded run's weights do not depend on when it is evaluated, so one run of the README's quick start per seed
(``--seed S``, 70 rounds of τ = 50, a checkpoint every round, no evaluation until the end) gives every round's
weights. ``scores`` scores each of them on the whole test set and on the 2,000-row screen, and times both, beside
the run's own round times and the load average. ``replay`` then runs each rule as the loop's evaluation does it
(:class:`sparknet.loop.EvalPlan`: a due evaluation put off while evaluations have taken more than the budget's
share of the time; a screen, then the whole set when the screen is within ``k`` standard errors and a row of the
target; every tenth evaluation whole), charging the measured round, screen and whole-set times with ±10% jitter,
200 times a seed. It reports each rule's time to its end over the best possible one (the first round whose whole-set
score reaches the target, and one whole pass), with the evaluations at their measured cost and at a quarter and four
times it (a cheaper or a dearer validation set). A whole pass after a screen scores the rows the screen left out, as
the loop does since a2cd673 (the whole set's time less the screen's); ``--whole-after-screen whole`` charges the
whole set's time, as the loop did before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, save_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCORES = ROOT / "benchmarks" / "results" / "eval_rule_scores.json"
TARGET, SCREEN_ROWS, ROUNDS, TAU, REPLAYS = 0.99, 2000, 70, 50, 200
RULES = [(0.05, 3), *((b, k) for b in (0.1, 0.2, 0.25, 0.3, 1.0) for k in (0, 0.5, 1, 2, 3))]
"""(budget, k): the rule before this study (0.05 of the time, three standard errors), then each other pair."""


def _score_run(checkpoints: Path) -> list[dict]:
    """Every checkpoint of a run scored on the whole test set and on the screen, each timed."""
    import torch

    from sparknet._app import build_model, load_training_data
    from sparknet.checkpoint import CheckpointManager
    from sparknet.config import RunConfig
    from sparknet.net import Net

    run = RunConfig(model="lenet", dataset="mnist", lr=0.05)
    _, test, info = load_training_data(run)
    net = Net(build_model(run, info), run.solver(), batch_size=64)
    net.set_validation_data(test)
    torch.set_num_threads(os.cpu_count() or 1)  # as the driver scores
    manager, rows = CheckpointManager(str(checkpoints), keep=ROUNDS + 1), []
    for r in manager.rounds():
        net.set_weights(manager.load(r).weights)
        t = time.perf_counter()
        whole = net.evaluate().accuracy
        whole_s, t = time.perf_counter() - t, time.perf_counter()
        screen = net.evaluate(sample=SCREEN_ROWS).accuracy
        rows.append({"round": r, "whole": whole, "screen": screen, "whole_s": whole_s,
                     "screen_s": time.perf_counter() - t})
    return rows


def scores(args) -> int:
    out = {"command": None, "target": TARGET, "screen_rows": SCREEN_ROWS, "cpu_count": os.cpu_count(), "seeds": {}}
    for seed in (int(s) for s in args.seeds.split(",")):
        with tempfile.TemporaryDirectory(prefix="sparknet-eval-rule-") as tmp:
            cmd = ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers", "2", "--lr", "0.05",
                   "--seed", str(seed), "--steps", str(ROUNDS * TAU), "--eval-every-rounds", str(10 * ROUNDS),
                   "--checkpoint-dir", f"{tmp}/ck", "--checkpoint-every", "1", "--checkpoint-keep", str(ROUNDS + 1),
                   "--quiet", "--metrics-out", f"{tmp}/run.jsonl"]
            out["command"] = " ".join([*cmd[:11], "S", *cmd[12:17], "DIR", *cmd[18:22]])  # seed and folder named
            with LoadSampler() as load:
                subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=1800)
                records = [json.loads(line) for line in Path(f"{tmp}/run.jsonl").read_text().splitlines()]
                rows = _score_run(Path(f"{tmp}/ck"))
            round_s = [r["round_s"] for r in records if r.get("round") and "round_s" in r]
            out["seeds"][str(seed)] = {"round_s": statistics.mean(round_s), "rounds": rows, **load.to_dict()}
            first = next((r["round"] for r in rows if r["whole"] >= TARGET), None)
            print(f"seed {seed}: round {statistics.mean(round_s):.2f} s, whole set "
                  f"{statistics.mean(r['whole_s'] for r in rows):.2f} s, screen "
                  f"{statistics.mean(r['screen_s'] for r in rows):.2f} s, first at {TARGET:.0%}: round {first}",
                  flush=True)
    print(save_json(out, args.out))
    return 0


def _margin(k: float) -> float:
    return k * math.sqrt(TARGET * (1 - TARGET) / SCREEN_ROWS) + 1 / SCREEN_ROWS


def _replay(rows, round_s, screen_s, whole_s, budget, k, rng, full_every=10, rest=True) -> float | None:
    """Seconds from the first round's start to the evaluation that reaches the target, under one rule (``None``:
    none does within the run's rounds); ``rest``: a whole pass after a screen scores only what it left out."""
    now = spent = 0.0
    done = since_whole = 0
    for r in rows:
        now += round_s * rng.uniform(0.9, 1.1)
        if budget < 1 and done > 0 and spent > budget * now:
            continue
        done += 1
        screened = since_whole + 1 < full_every
        if screened:
            s = screen_s * rng.uniform(0.9, 1.1)
            now, spent = now + s, spent + s
            if r["screen"] < TARGET - _margin(k):
                since_whole += 1
                continue
        w = (whole_s - screen_s * (screened and rest)) * rng.uniform(0.9, 1.1)
        now, spent, since_whole = now + w, spent + w, 0
        if r["whole"] >= TARGET:
            return now
    return None  # not within the run's rounds


def replay(args) -> int:
    from sparknet.loop import screen_margin

    assert abs(_margin(1) - screen_margin(TARGET, SCREEN_ROWS)) < 1e-12  # k = 1 is the loop's margin
    data = json.loads(Path(args.scores).read_text())
    table = []
    for scale in (0.25, 1.0, 4.0):
        for budget, k in RULES:
            per_seed, missed = [], 0
            for seed, run in data["seeds"].items():
                rows, rng = run["rounds"], random.Random(int(seed))
                screen_s = scale * statistics.mean(r["screen_s"] for r in rows)
                whole_s = scale * statistics.mean(r["whole_s"] for r in rows)
                best = next(r["round"] for r in rows if r["whole"] >= TARGET) * run["round_s"] + whole_s
                times = [_replay(rows, run["round_s"], screen_s, whole_s, budget, k, rng, rest=args.whole_after_screen
                                 == "rest") for _ in range(REPLAYS)]
                missed += sum(t is None for t in times)
                # a replay that missed the target in the run's rounds counts as their time: a bound from below
                per_seed.append(statistics.mean(len(rows) * run["round_s"] if t is None else t for t in times) / best)
            table.append({"eval_cost": scale, "budget": budget, "k": k, "mean_over_best": statistics.mean(per_seed),
                          "worst_seed_over_best": max(per_seed), "missed": missed / (REPLAYS * len(per_seed))})
            print(f"evaluations x{scale:<4g} budget {budget:<4g} k = {k}: {statistics.mean(per_seed):.2f} of the best "
                  f"time on average, {max(per_seed):.2f} on the worst seed"
                  + (f", {table[-1]['missed']:.0%} not at the target in {ROUNDS} rounds" if missed else ""), flush=True)
    print(save_json({"scores": str(Path(args.scores).name), "seeds": list(data["seeds"]),
                     "whole_after_screen": args.whole_after_screen, "table": table}, args.out))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    s = sub.add_parser("scores", help="a run per seed, every round's weights scored")
    s.add_argument("--seeds", default="0,1,2,3,4,5")
    s.add_argument("--out", default=str(SCORES))
    r = sub.add_parser("replay", help="every rule over the scores")
    r.add_argument("--scores", default=str(SCORES))
    r.add_argument("--out", default=str(SCORES.with_name("eval_rule_replay.json")))
    r.add_argument("--whole-after-screen", choices=("rest", "whole"), default="rest",
                   help="what a whole pass after a screen scores: the rows it left out (the loop), or all of them")
    args = p.parse_args(argv)
    return scores(args) if args.what == "scores" else replay(args)


if __name__ == "__main__":
    sys.exit(main())
