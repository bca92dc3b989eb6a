"""Figure 6 of the SparkNet paper: test accuracy against wall time for several tau, K workers on Spark.

    sparknet experiment tau-sensitivity --quick     # MNIST 5k subset, tau in {5, 25, 100}
    sparknet experiment tau-sensitivity             # LeNet on MNIST, tau in {10, 50, 200, 1000}

Each tau is one :class:`~sparknet.spark.SparkTrainer` fit on the rounds engine (one Spark job
per round: broadcast, tau local steps, tree aggregation), averaging, the same number of local
steps per worker. The global weights are evaluated every ``eval_every`` steps (every
``max(1, eval_every // tau)`` rounds). Evaluation runs on the driver between rounds; it is
measurement, not training, so the curves are drawn against wall time minus the evaluation
time and minus the fit's setup (data staging, the same for every tau); all three are in
the JSON. One untimed single-step fit runs first.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparknet.experiments import SparkExperimentConfig, make_solver, measured, pyplot, spark_fit, spark_stage

__all__ = ["Config", "QUICK", "run", "plot"]


@dataclass(kw_only=True)
class Config(SparkExperimentConfig):
    """Settings of the tau-sensitivity runs."""

    taus: tuple[int, ...] = (10, 50, 200, 1000)
    """Local steps per round, one fit each."""
    engine: str = "rounds"
    """rounds (SparkNet's scheme) or barrier."""
    strategy: str = "average"
    """average or diloco."""
    steps: int = 2000
    """Local steps per worker of every fit."""
    eval_every: int = 200
    """Local steps between evaluations."""
    weight_decay: float = 5e-4
    """Weight decay."""

    def __post_init__(self):
        super().__post_init__()
        self._check("steps", "eval_every", counts=("taus",),
                    choices={"engine": ("rounds", "barrier"), "strategy": ("average", "diloco", "easgd")})

    def solver(self):
        return make_solver("sgd", self.lr, self.momentum, self.weight_decay, lr_policy="inv", gamma=1e-4, power=0.75)


QUICK: dict = {"dataset": "mnist-small", "taus": (5, 25, 100), "steps": 300, "eval_every": 25}


def _fit(config: Config, tau: int, spark, df, test) -> dict:
    fit = spark_fit(config, spark, df, test, solver=config.solver(), engine=config.engine, strategy=config.strategy,
                    tau=tau, steps=config.steps, eval_every_rounds=max(1, config.eval_every // tau))
    curve, eval_total = [], 0.0
    rounds = fit.rounds
    for h in rounds:
        eval_total += h.get("eval_s") or 0.0
        if h.get("val_accuracy") is not None:
            curve.append({"round": h["round"], "steps": h["total_steps"], "accuracy": h["val_accuracy"],
                          "wall_s": h["wall_s"], "train_wall_s": h["wall_s"] - eval_total})
    s = fit.result.summary
    return {"tau": tau, "ok": True, "curve": curve, "wall_s": fit.wall_s, "setup_s": s.get("setup_s"),
            "rounds": s.get("rounds"), "final_accuracy": s.get("test_accuracy"),
            "samples_per_s": s.get("samples_per_s"), "eval_s": eval_total,
            "mean_round_s": sum(h["round_s"] for h in rounds) / len(rounds) if rounds else None,
            "mean_comm_s": sum(h.get("comm_s", 0.0) for h in rounds) / len(rounds) if rounds else None}


def run(config: Config, out_dir: Path | None = None, *, quick: bool = False, spark=None) -> dict:
    """One fit per tau on one Spark session; returns the result body."""
    train, test = config.data()
    with spark_stage(config, train, spark, engine=config.engine) as (session, df, warmup_s):
        runs = [measured(f"tau-sensitivity: tau = {tau}", {"tau": tau}, _fit, config, tau, session, df, test)
                for tau in config.taus]
    summary = {str(r["tau"]): ({"final_accuracy": r["final_accuracy"], "wall_s": round(r["wall_s"], 1)}
                               if r.get("ok") else "failed") for r in runs}
    return {"workers": config.workers, "engine": config.engine, "strategy": config.strategy,
            "spark_warmup_s": warmup_s, "runs": runs, "summary": summary}


def plot(result: dict, path: str | Path) -> None:
    """Test accuracy against wall time (evaluation excluded), one line per tau."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2), layout="constrained")
    for r in result["runs"]:
        if r.get("ok") and r["curve"]:
            setup = r.get("setup_s") or 0.0
            ax.plot([p["train_wall_s"] - setup for p in r["curve"]], [p["accuracy"] for p in r["curve"]], marker=".",
                    label=f"τ = {r['tau']} ({r['rounds']} rounds, {r['curve'][-1]['train_wall_s'] - setup:.0f} s)")
        elif not r.get("ok"):
            ax.plot([], [], label=f"τ = {r['tau']}: failed")
    cfg = result.get("config", {})
    ax.set(xlabel="wall-clock seconds of training (setup and evaluation excluded)", ylabel="test accuracy")
    accs = [p["accuracy"] for r in result["runs"] if r.get("ok") for p in r["curve"]]
    if accs:
        ax.set_ylim(max(min(accs), max(accs) - 0.15), min(1.0, max(accs) + 0.01))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"τ sensitivity: K = {result['workers']}, {result['engine']} engine, {result['strategy']}, "
                 f"{cfg.get('steps')} steps per worker ({cfg.get('dataset')})", fontsize=9)
    fig.savefig(path, dpi=90)
    plt.close(fig)
