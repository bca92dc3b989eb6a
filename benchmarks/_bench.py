"""What every benchmark here shares: the load average sampled while it runs, a user's command timed, and the
multi-host rig.

A figure is only worth what the machine was doing beside it: :class:`LoadSampler` records the
1-minute load average before a run and every few seconds during it, and :func:`timed_command`
times a command from its start (its interpreter, Spark session and JVMs included) to its end,
which is what a user waits for.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

from sparknet.metrics import LoadSampler

__all__ = ["LoadSampler", "timed_command", "last_summary", "save_json", "source_trees", "rig_module", "commit_of"]


@contextmanager
def source_trees(root: Path, baseline_rev: str | None, where: Path):
    """``{name: src folder}``: this tree's ``src``, and with ``baseline_rev`` that commit's, checked out in a worktree
    under ``where`` (first in the dict) and removed on exit."""
    trees = {"this tree": root / "src"}
    worktree = where / "baseline"
    if baseline_rev:
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), baseline_rev], cwd=root, check=True,
                       capture_output=True)
        trees = {f"baseline {baseline_rev}": worktree / "src", **trees}
    try:
        yield trees
    finally:
        if baseline_rev:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=root, capture_output=True)


def commit_of(tree: Path = Path(__file__).resolve().parents[1]) -> str | None:
    """The short commit a checkout is at (default: this one's); ``None`` outside git."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          timeout=30)
    return done.stdout.strip() or None


def save_json(result: dict, out: str | Path) -> Path:
    """Write ``result`` as indented JSON to ``out`` (its folder made if missing); the path written."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def last_summary(metrics: Path) -> dict:
    """The ``"event": "summary"`` record of a ``--metrics-out`` file."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return next(r for r in reversed(records) if r.get("event") == "summary")


def timed_command(cmd: list[str], *, cwd: Path, env: dict | None = None, timeout_s: float = 1800.0,
                  check: bool = True) -> dict:
    """Run ``cmd`` and time it from its start to its end; the load average beside it, and its exit code; raise if it
    failed (unless ``check`` is false: a command expected to refuse its input)."""
    with LoadSampler() as load:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - t0
    if check and proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"command": " ".join(cmd), "command_wall_s": round(wall, 2), "exit": proc.returncode,
            "stdout_tail": proc.stdout[-2000:], **load.to_dict()}


def rig_module():
    """``scripts/netns_cluster.py``, the multi-host rig, as a module: a script beside the package, not part of it."""
    spec = importlib.util.spec_from_file_location(
        "netns_cluster", Path(__file__).resolve().parents[1] / "scripts" / "netns_cluster.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
