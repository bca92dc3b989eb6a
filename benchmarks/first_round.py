"""How long a user waits for the first round: ``sparknet train`` from its start to its first round's start.

    python benchmarks/first_round.py                               # this tree, 3 runs of each engine
    python benchmarks/first_round.py --baseline-rev 095604d       # beside an earlier commit, runs alternating

Each run is ``sparknet train --model lenet --dataset mnist --workers 2 --rounds 2`` (``--workers`` sets K; MNIST
cached, the arrays dealt from written by an earlier run), started as a fresh process. Its metrics file is read every
50 ms from the command's start: the first round began when its record appeared less the round's own time and its
evaluation's (a record is written when its round and evaluation end), the same reading for any commit. The summary's
own ``first_round_s`` (the command's age at the first round's start, in commits that have it) is kept beside it.
With ``--baseline-rev`` that commit is checked out in a temporary worktree, removed at the end, and its runs
alternate with this tree's, each run alone. The load average is sampled before and during each run. Prints and saves
JSON.

``--variant NAME:KEY=VALUE`` runs this tree under that name with those environment settings, in place of its plain
run (``--variant ahead:SPARKNET_SESSION_AHEAD=1 --variant jvm:SPARKNET_SESSION_AHEAD=0``: the whole session started
ahead beside the driver JVM alone, in one run); a KEY that starts with ``--`` is a flag of the command
(``--variant path:--data=T.parquet --variant uri:--data=file:///.../T.parquet``: a table read on the driver beside
the same table read by Spark's workers). ``--warm`` first runs each tree once, untimed, and waits for its
driver JVM to write its class archive (as a user's first run does), so that the timed runs start as a user's later
runs do. ``--trimmed-java`` runs every command on a copy of this machine's Java without its base class archives, as a
Java trimmed with jlink is (the Spark lab's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench import LoadSampler, commit_of, save_json, source_trees  # noqa: E402

COMMAND = ["train", "--model", "lenet", "--dataset", "mnist", "--lr", "0.05", "--rounds", "2", "--quiet"]
POLL_S = 0.05


def _records(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line still being written
            break
    return out


def trimmed_java(where: Path) -> Path:
    """A copy of this machine's Java as jlink makes one: its launcher and JVM copied (Java finds its home from them),
    the rest linked, and no base class archive (``lib/server/classes*.jsa``). Returns the new Java home."""
    from sparknet.spark.session import java_executable

    home = Path(os.path.realpath(java_executable())).parent.parent
    where.mkdir()
    for entry in home.iterdir():
        if entry.name not in ("bin", "lib"):
            (where / entry.name).symlink_to(entry)
    for folder in ("bin", "lib", "lib/server"):
        (where / folder).mkdir()
        for entry in (home / folder).iterdir():
            if (folder, entry.name) == ("lib", "server"):
                continue
            if folder == "lib/server" and entry.name.startswith("classes"):  # the base archives
                continue
            target = where / folder / entry.name
            if entry.name in ("java", "libjvm.so"):
                shutil.copy2(entry, target)
            else:
                target.symlink_to(entry)
    return where


def settle_class_archive(timeout_s: float = 300.0) -> None:
    """Wait (at most ``timeout_s``) for the driver JVMs still writing their class archive as they exit, then date the
    dumps two minutes back: the next session maps one, as a user's run a minute after the first does."""
    from sparknet.datasets.cache import cache_root

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and subprocess.run(["pgrep", "-f", "Archive[C]lassesAtExit"],
                                                         capture_output=True).returncode == 0:
        time.sleep(1.0)
    old = time.time() - 120
    for dump in (cache_root() / "jvm").glob("spark-*.*.jsa"):
        os.utime(dump, (old, old))


def one_run(src: Path, engine: str, work: Path, timeout_s: float, java_home: Path | None = None,
            setting: dict | None = None, workers: int = 2) -> dict:
    """One command on ``workers`` workers from the tree at ``src``, its environment with ``setting`` added, timed to
    its first round's start and to its end."""
    metrics = work / f"run-{time.monotonic_ns()}.jsonl"
    setting = setting or {}
    env = {**os.environ, **{k: v for k, v in setting.items() if not k.startswith("--")},
           "PYTHONPATH": os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])}
    if java_home is not None:
        env["JAVA_HOME"] = str(java_home)
    flags = [part for k, v in setting.items() if k.startswith("--") for part in (k, v)]
    cmd = [sys.executable, "-m", "sparknet", *COMMAND, "--workers", str(workers), "--engine", engine, *flags,
           "--metrics-out", str(metrics)]
    with LoadSampler() as load:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        first = None
        try:
            while proc.poll() is None and time.perf_counter() - t0 < timeout_s:
                if first is None:
                    seen = next((r for r in _records(metrics) if r.get("event") == "round"), None)
                    if seen is not None:
                        first = time.perf_counter() - t0 - seen["round_s"] - seen.get("eval_s", 0.0)
                time.sleep(POLL_S)
            if proc.poll() is None:
                raise SystemExit(f"{' '.join(cmd)} ran past {timeout_s:g} s")
        finally:
            if proc.poll() is None:
                proc.kill()
            _, err = proc.communicate(timeout=60)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    summary = next(r for r in reversed(_records(metrics)) if r.get("event") == "summary")
    return {"first_round_s": None if first is None else round(first, 2), "command_s": round(wall, 2),
            "summary_first_round_s": summary.get("first_round_s"), "setup_s": summary.get("setup_s"),
            "phases_s": summary.get("phases_s"),
            **load.to_dict()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", default="rounds,barrier")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--baseline-rev", default=None, help="an earlier commit to run beside this tree")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each run may take")
    p.add_argument("--warm", action="store_true", help="one untimed run of each tree first, its class archive written")
    p.add_argument("--trimmed-java", action="store_true",
                   help="run on a copy of this machine's Java without base class archives (as jlink makes one)")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                   help="this tree with these environment settings (a KEY that starts with --: a flag of the "
                   "command), under this name, in place of its plain run (repeatable)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "first_round.json"))
    args = p.parse_args(argv)
    variants = {}
    for spec in args.variant:
        name, _, pairs = spec.partition(":")
        variants[name] = dict(pair.split("=", 1) for pair in pairs.split(",") if pair)
    engines = [e for e in args.engines.split(",") if e]
    report = {"benchmark": "first_round", "command": "sparknet " + " ".join([*COMMAND, "--workers", str(args.workers)]),
              "cpu_count": os.cpu_count(),
              "commit": commit_of(), "baseline_rev": args.baseline_rev,
              "trimmed_java": args.trimmed_java, "warm": args.warm, "variants": variants, "runs": []}
    with tempfile.TemporaryDirectory(prefix="sparknet-first-round-") as tmp, \
            source_trees(ROOT, args.baseline_rev, Path(tmp)) as sources:
        java_home = trimmed_java(Path(tmp) / "java") if args.trimmed_java else None
        trees = {name: (src, {}) for name, src in sources.items() if not (variants and src == ROOT / "src")}
        trees.update({name: (ROOT / "src", setting) for name, setting in variants.items()})
        if args.warm:
            for src, setting in trees.values():
                one_run(src, engines[0], Path(tmp), args.timeout, java_home, setting, args.workers)
            settle_class_archive()
        for repeat in range(args.repeats):
            for engine in engines:
                for name, (src, setting) in trees.items():
                    run = {"tree": name, "engine": engine, "repeat": repeat,
                           **one_run(src, engine, Path(tmp), args.timeout, java_home, setting, args.workers)}
                    print(json.dumps(run), flush=True)
                    report["runs"].append(run)
    report["median_first_round_s"] = {
        f"{name}, {engine}": statistics.median(r["first_round_s"] for r in report["runs"]
                                               if r["tree"] == name and r["engine"] == engine)
        for name in trees for engine in engines}
    print(json.dumps(report["median_first_round_s"]))
    save_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
