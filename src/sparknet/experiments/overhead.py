"""Figure 4 of the SparkNet paper: speedup against the communication overhead S (in units of C).

    sparknet experiment speedup-vs-overhead --quick     # uses OUT/speedup-grid.json, or runs the quick grid
    sparknet experiment speedup-vs-overhead --grid runs/experiments/speedup-grid.json

From the speedup grid's counts (N_a, and M_a for every K and tau) and the step time C(b)
measured here, the time to accuracy ``a`` is

- one worker:            N_a * C
- naive scheme:          N_a * (C/K + S)              speedup C / (C/K + S)  (Amdahl's law)
- averaging / DiLoCo:    M_a * (tau*C + S)            speedup max over tau of N_a*C / (M_a*(tau*C + S))

so every speedup depends on S only through S/C, which is swept from 0.1 to 1000. The naive
curve is below 1 as soon as S >= C (C/K + S > C); periodic averaging keeps a speedup at
large S by choosing a large tau. The best tau for every S is written into the JSON.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from sparknet.experiments import load_data, make_model, make_solver, median_step_time, pyplot, run_experiment
from sparknet.experiments.speedup_grid import Config as GridConfig, solver_for

__all__ = ["Config", "QUICK", "run", "plot", "naive_speedup", "periodic_speedup"]

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Config:
    """Settings of the speedup-against-overhead curves."""

    grid: str | None = None
    """A speedup-grid JSON to use (default: speedup-grid.json in the output folder, else the grid is run)."""
    workers: tuple[int, ...] | None = None
    """Rows of the grid to draw, one panel each (default every K > 1)."""
    s_over_c_min: float = 0.1
    """Smallest S/C."""
    s_over_c_max: float = 1000.0
    """Largest S/C."""
    points: int = 81
    """Points on the log-spaced S/C axis."""
    timed_steps: int = 50
    """Steps timed to measure C(b) (the median is used)."""

    def __post_init__(self):
        if self.workers is not None:
            self.workers = tuple(int(k) for k in self.workers)
            if min(self.workers, default=2) < 2:
                raise ValueError(f"workers must be at least 2 (K = 1 has nothing to compare), got {self.workers}")
        if not 0 < self.s_over_c_min < self.s_over_c_max:
            raise ValueError(f"need 0 < s_over_c_min < s_over_c_max, got {self.s_over_c_min}, {self.s_over_c_max}")
        if self.points < 2 or self.timed_steps < 1:
            raise ValueError("points must be at least 2 and timed_steps at least 1")


QUICK: dict = {"points": 41, "timed_steps": 20}
"""``--quick``: fewer points and timed steps (the grid it reads decides the rest)."""


def naive_speedup(s_over_c: float, workers: int) -> float:
    """C / (C/K + S) with C = 1: the naive scheme's speedup (the paper's Amdahl bound)."""
    return 1.0 / (1.0 / workers + s_over_c)


def periodic_speedup(s_over_c: float, n_a: int, cells: list[dict]) -> tuple[float | None, int | None]:
    """max over tau of N_a / (M_a * (tau + S/C)) over the reached ``cells`` of one K; and the best tau."""
    reached = [(n_a / (c["rounds"] * (c["tau"] + s_over_c)), c["tau"]) for c in cells
               if c.get("reached") and c.get("rounds")]
    return max(reached, key=lambda pair: pair[0], default=(None, None))


def _grid(config: Config, out_dir: Path | None, quick: bool) -> tuple[dict, str]:
    if config.grid is not None:
        return json.loads(Path(config.grid).read_text()), str(config.grid)
    if out_dir is not None and (out_dir / "speedup-grid.json").exists():
        path = out_dir / "speedup-grid.json"
        grid = json.loads(path.read_text())
        if bool(grid.get("quick")) == quick:
            return grid, str(path)
        log.warning("%s is a %s grid; running the %s one", path, "quick" if grid.get("quick") else "full",
                    "quick" if quick else "full")
    log.info("no speedup grid to read: running it first")
    grid = run_experiment("speedup-grid", quick=quick, out=out_dir, plot=True)
    return grid, grid["json_path"]


def run(config: Config, out_dir: Path | None = None, *, quick: bool = False) -> dict:
    """Measure C(b), then turn the grid's counts into speedup curves against S/C."""
    import numpy as np

    grid, grid_path = _grid(config, out_dir, quick)
    gcfg = GridConfig(**{k: v for k, v in grid["config"].items() if k in GridConfig.__dataclass_fields__})
    train, _ = load_data(gcfg.dataset, train_samples=gcfg.train_samples, test_samples=1)
    step = median_step_time(make_model(gcfg.model, gcfg.batch_size), make_solver(**solver_for(gcfg, "average")),
                            train, batch_size=gcfg.batch_size, steps=config.timed_steps, threads=1)
    c = step["median_s"]
    workers = config.workers or tuple(k for k in grid["workers"] if k > 1)
    missing = [k for k in workers if k not in grid["workers"]]
    if missing:
        raise ValueError(f"the grid in {grid_path} has no row for K = {missing} (it has {grid['workers']})")
    s_over_c = [float(v) for v in np.logspace(math.log10(config.s_over_c_min), math.log10(config.s_over_c_max),
                                              config.points)]
    curves = []
    for k in workers:
        entry = {"workers": k, "naive": [naive_speedup(s, k) for s in s_over_c]}
        for strategy in grid["strategies"]:
            cells = [x for x in grid["cells"] if x["strategy"] == strategy and x["workers"] == k]
            n_a = grid["N_a"][strategy]
            pairs = [periodic_speedup(s, n_a, cells) for s in s_over_c]
            entry[strategy] = [p[0] for p in pairs]
            entry[f"{strategy}_best_tau"] = [p[1] for p in pairs]
        curves.append(entry)
    checks = {
        "naive_below_1_for_s_ge_c": all(v < 1 for e in curves for s, v in zip(s_over_c, e["naive"]) if s >= 1),
        "naive_at_smallest_s": {str(e["workers"]): e["naive"][0] for e in curves},
        "all_speedups_positive": all(v is None or v > 0 for e in curves for s in grid["strategies"] for v in e[s]),
    }
    return {"grid": grid_path, "C_s": c, "step_time": step, "model": gcfg.model, "batch_size": gcfg.batch_size,
            "target": gcfg.target, "N_a": grid["N_a"], "strategies": grid["strategies"], "s_over_c": s_over_c,
            "S_s": [s * c for s in s_over_c], "curves": curves, "checks": checks}


def plot(result: dict, path: str | Path) -> None:
    """One panel per K: speedup against S/C (log-log) for naive, averaging and DiLoCo."""
    plt = pyplot()
    curves = result["curves"]
    cols = min(len(curves), 2)
    rows = math.ceil(len(curves) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.6 * rows), squeeze=False)
    x = result["s_over_c"]
    colors = {"average": "tab:blue", "diloco": "tab:green", "easgd": "tab:purple"}
    for ax, entry in zip(axes.flat, curves):
        ax.plot(x, entry["naive"], color="tab:red", ls="--", label="naive: C/(C/K+S)")
        for strategy in result["strategies"]:
            ys = [float("nan") if v is None else v for v in entry[strategy]]
            ax.plot(x, ys, color=colors.get(strategy, "black"), ls="-", label=f"{strategy} (best τ)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axvline(1.0, color="gray", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", xlabel="S / C  (communication time per sync / step time)",
               ylabel="speedup over one worker")
        ax.set_title(f"K = {entry['workers']}", fontsize=10)
        ax.grid(True, which="both", alpha=0.2)
        ax.legend(fontsize=7, loc="lower left")
    for ax in list(axes.flat)[len(curves):]:
        ax.axis("off")
    fig.suptitle(f"Speedup to {result['target']} against S/C ({result['model']}, b={result['batch_size']}, "
                 f"C = {result['C_s'] * 1000:.1f} ms measured here)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
