"""`sparknet train` in one process writes the metrics contract."""

import json

import pytest

from sparknet._fields import from_args
from sparknet.cli import main
from sparknet.config import DistributedConfig
from sparknet.metrics import read_metrics


def _python(*args: str):
    """This interpreter run with ``args`` in a process of its own (two minutes at most)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def test_train_writes_eval_and_summary_records(tmp_path):
    out = tmp_path / "m.jsonl"
    rc = main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "60", "--eval-every", "30",
               "--tau", "10", "--batch-size", "32", "--lr", "0.05", "--lr-policy", "fixed", "--threads", "1",
               "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    records = read_metrics(out)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [30, 60]
    for r in evals:
        assert set(r) >= {"step", "samples", "wall_s", "loss", "test_accuracy"}
    summary = records[-1]
    assert summary["event"] == "summary"
    assert summary["samples"] == 60 * 32
    assert summary["samples_per_s"] > 0
    assert summary["test_accuracy"] > 0.5  # synthetic classes are separable; chance is 0.1
    json.dumps(summary)


def test_bad_flag_values_exit_with_a_message(capsys):
    assert main(["train", "--steps", "0", "--quiet"]) == 2
    with pytest.raises(SystemExit) as info:  # refused by the flag's choices, before anything loads
        main(["train", "--dataset", "imagenet-22k", "--steps", "1", "--quiet"])
    assert info.value.code == 2 and "invalid choice: 'imagenet-22k'" in capsys.readouterr().err


def test_a_config_file_value_is_checked_as_a_flag_is(tmp_path, caplog):
    cfg = tmp_path / "run.toml"
    cfg.write_text('dataset = "imagenet-22k"\nsteps = 1\n')
    assert main(["train", "--config", str(cfg), "--quiet"]) == 2  # argparse leaves defaults unchecked: the config
    assert "unknown data set 'imagenet-22k'" in caplog.text


def test_version(capsys):
    assert main(["version"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch"].startswith("2.13") and info["pyspark"].startswith("4.")
    out = _python("-c", "import sys\nfrom sparknet.cli import main\nmain(['version'])\n"
                        "print(sorted({'torch', 'pyspark'} & set(sys.modules)))")
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "[]", out  # read from the packages, not loaded


def test_save_model_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from sparknet.model_io import load_model

    model_dir, tb = tmp_path / "model", tmp_path / "tb"
    rc = main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "20", "--eval-every", "10",
               "--threads", "1", "--model-dir", str(model_dir), "--tensorboard", str(tb), "--quiet"])
    assert rc == 0
    saved = load_model(model_dir)
    assert saved.weights.numel > 0
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert acc.Tags()["scalars"], "no scalars were written"


def test_every_built_in_sequence_data_set_trains_the_char_lstm(tmp_path):
    """synthetic-sequences names its vocabulary from its tokens (it once failed with a KeyError)."""
    out = tmp_path / "m.jsonl"
    rc = main(["train", "--model", "char_lstm", "--dataset", "synthetic-sequences", "--steps", "60",
               "--batch-size", "32", "--lr", "0.05", "--threads", "1", "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    summary = read_metrics(out)[-1]
    assert summary["event"] == "summary" and summary["steps"] == 60
    assert summary["test_accuracy"] > 1 / 16 * 2  # the next token follows a rule; chance is 1/16


def test_the_gpt_char_transformer_learns_a_sequence_data_set_from_the_command_line(tmp_path):
    out = tmp_path / "m.jsonl"
    rc = main(["train", "--model", "gpt-char", "--dataset", "synthetic-sequences", "--steps", "40", "--batch-size",
               "16", "--solver-type", "adam", "--lr", "0.002", "--lr-policy", "fixed", "--weight-decay", "0",
               "--threads", "2", "--metrics-out", str(out), "--quiet"])
    assert rc == 0
    summary = read_metrics(out)[-1]
    assert summary["steps"] == 40 and summary["test_accuracy"] > 1 / 16 * 2, summary


def test_config_file_and_flags_merge_and_print_config_round_trips(tmp_path, capsys):
    from sparknet.cli import parse_args, print_config

    cfg = tmp_path / "run.toml"
    cfg.write_text('model = "mlp"\nbatch-size = 16\nlr = 0.05\nengine = "barrier"\nworkers = 2\nauto_tau = true\n')
    args = parse_args(["train", "--config", str(cfg), "--lr", "0.2"])
    assert (args.model, args.batch_size, args.lr, args.engine, args.workers, args.auto_tau) == \
        ("mlp", 16, 0.2, "barrier", 2, True)  # the flag given wins over the file
    assert args.tau == 50 and args.dataset == "mnist"  # neither: the defaults
    printed = print_config(args)
    again = tmp_path / "again.toml"
    again.write_text(printed)
    assert print_config(parse_args(["train", "--config", str(again)])) == printed
    assert main(["train", "--config", str(cfg), "--print-config"]) == 0
    out = capsys.readouterr().out
    assert "lr = 0.05" in out and 'engine = "barrier"' in out and "batch_size = 16" in out


def test_the_engines_settings_are_flags_and_config_keys(tmp_path, capsys):
    from sparknet._fields import from_args
    from sparknet.cli import parse_args, print_config
    from sparknet.spark import EngineOptions

    args = parse_args(["train", "--round-timeout-s", "90", "--rounds-transport", "spark", "--no-worker-state-on-driver"])
    assert from_args(EngineOptions, args) == EngineOptions(round_timeout_s=90.0, rounds_transport="spark",
                                                           worker_state_on_driver=False)
    assert from_args(EngineOptions, parse_args(["train"])) == EngineOptions()
    cfg = tmp_path / "run.toml"
    cfg.write_text("max-restarts = 1\nstorage_level = \"MEMORY_ONLY_2\"\n")
    printed = print_config(parse_args(["train", "--config", str(cfg)]))
    assert "# Spark engines\n" in printed and "max_restarts = 1\n" in printed
    assert 'storage_level = "MEMORY_ONLY_2"' in printed
    with pytest.raises(SystemExit):  # injected faults are set in code only
        parse_args(["train", "--fault", "rank=1,round=2,kind=kill"])
    assert "unrecognized arguments: --fault" in capsys.readouterr().err


@pytest.mark.parametrize("text, match", [("lr_rate = 0.1\n", "unknown setting 'lr_rate'"),
                                         ("[training]\nlr = 0.1\n", "is a table"),
                                         ("lr = \n", "not a TOML file")])
def test_a_bad_config_file_is_refused_by_name(tmp_path, capsys, text, match):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(SystemExit) as info:
        main(["train", "--config", str(cfg)])
    assert info.value.code == 2 and match in capsys.readouterr().err


def test_enumerated_flags_list_and_check_their_choices(capsys):
    with pytest.raises(SystemExit) as info:
        main(["train", "--model", "resnet9000"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'resnet9000'" in err and "lenet" in err
    with pytest.raises(SystemExit):
        main(["train", "--dataset", "imagenet"])
    assert "mnist-small" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--combiner", "median-of-nothing"])
    from sparknet.cli import parse_args

    assert parse_args(["train", "--model", "char-lstm", "--dataset", "mnist_small"]).model == "char_lstm"
    from sparknet.config import RunConfig

    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        RunConfig(model="resnet")


def test_help_shows_every_default(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Base learning rate. (default: 0.01)" in out
    assert "(default: 50)" in out and "(default: rounds)" in out and "(default: None)" not in out


def test_old_flag_names_warn_and_still_work(caplog):
    from sparknet.cli import parse_args

    with caplog.at_level("WARNING", logger="sparknet"):
        args = parse_args(["train", "--save-model", "out/m"])
        scored = parse_args(["predict", "--model", "out/m", "--data", "d", "--out", "o"])
    assert args.model_dir == "out/m" and scored.model_dir == "out/m"
    assert "--save-model is the old name of --model-dir" in caplog.text
    assert "--model is the old name of --model-dir" in caplog.text


def test_python_m_sparknet_and_version():
    from sparknet import __version__

    out = _python("-m", "sparknet", "--version")
    assert out.returncode == 0 and out.stdout.strip() == f"sparknet {__version__}", out


def test_a_command_that_returns_leaves_what_is_alive_frozen_for_the_interpreter_s_end():
    """The interpreter's last collections would walk every object of torch, pyspark and pandas after the result is
    out (0.4 s of a Spark run's exit): what lives when the command returns is frozen first, its exit code kept."""
    probe = ("import atexit, gc, sys\n"
             "atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr))\n"
             "sys.argv = ['sparknet', 'version']\n"
             "from sparknet.__main__ import main\n"
             "sys.exit(main())\n")
    out = _python("-c", probe)
    assert out.returncode == 0 and "sparknet" in out.stdout, out
    frozen = int(out.stderr.split("frozen ")[-1])
    assert frozen > 10_000, out.stderr  # the modules' objects, at least


@pytest.mark.parametrize("argv, master", [
    ("train --workers 2", "local[2]"),  # the configuration's resolved_master
    ("train --model lenet --workers=4 --lr 0.05", "local[4]"),
    ("train --workers 2 --procs-per-worker 2 --engine barrier", "local[4]"),
    ("train --engine barrier", "local[1]"),
    ("train --workers 4 --master local[2]", "local[2]"),
    ("train --master local-cluster[2,1,1024]", "local-cluster[2,1,1024]"),
    ("train --workers 2 --master sc://localhost:15002", "sc://localhost:15002"),
    ("train --workers 4 --strategy diloco", "local[4]"),
    ("train --workers 2 --verbose", "local[2]"),  # its logs are set before the JVM starts (cli.prepare)
    ("train", None),  # one worker, the rounds engine: one process
    ("train --workers 1 --steps 20", None),
    ("train --workers 2 --strategy async", None),  # the parameter server's road
    ("train --workers 2 --prototxt net.prototxt", None),  # Caffe files' road
    ("train --workers 2 --print-config", None),
    ("train --workers 2 --tau 0", None),  # settings the command itself refuses
    ("version", None),
    ("predict --model-dir m --data d --out o", "local[*]"),  # get_session's default
    ("predict --model-dir m --data d --out o --master local[2]", "local[2]"),
    ("data extended-mnist --out o --samples 10 --master local[2]", "local[2]"),
    ("doctor", None),  # its session takes settings of its own (--executor-memory...)
])
def test_the_master_of_the_session_started_ahead_is_the_one_the_command_asks_for(argv, master):
    from sparknet import cli

    args = cli.parse_args(argv.split())
    assert cli.session_master(args) == master
    if master is not None and argv.startswith("train"):
        assert cli.road(from_args(DistributedConfig, args)) is cli.Road.SPARK


@pytest.mark.parametrize("argv, name", [
    ("train --workers 2", "sparknet"), ("predict --model-dir m --data d --out o", "sparknet-predict"),
    ("data extended-mnist --out o --samples 10", "sparknet-data")])
def test_a_session_started_ahead_has_the_name_the_command_gives_its_own(argv, name):
    from sparknet import cli

    assert cli.session_app_name(cli.parse_args(argv.split())) == name  # test_session_logs: predict's session has it


def test_a_config_file_s_workers_start_spark_ahead_as_the_flags_would(tmp_path):
    from sparknet import cli

    path = tmp_path / "run.toml"
    path.write_text("workers = 2\nengine = \"barrier\"\n")
    assert cli.session_master(cli.parse_args(["train", "--config", str(path)])) == "local[2]"
    assert cli.session_master(cli.parse_args(["train", "--config", str(path), "--workers", "3"])) == "local[3]"


@pytest.mark.parametrize("argv, shown", [
    ("--help", "usage: sparknet"), ("--version", "sparknet "), ("train --help", "--target-accuracy"),
    ("train --workers 2 --lrr 3", "unrecognized arguments: --lrr 3"), ("train --workers two", "invalid int value"),
    ("trian --workers 2", "invalid choice: 'trian'"), ("export --help", "--format"), ("sample --help", "--prime"),
    ("predict --help", "--probability-col"), ("caffe --help", "{inspect,export,import}"),
    ("caffe import --help", "--prototxt"), ("experiment --help", "speedup-grid"),
    ("experiment speedup-grid --help", "--large-batch-reference"), ("experiment scaling --lrr 1", "--lrr"),
])
def test_the_command_answers_help_and_mistyped_flags_before_it_loads_torch_or_starts_spark(argv, shown):
    """``python -m sparknet`` parses its command line first: ``--help`` and a mistyped flag are answered with no torch
    loaded and no JVM or daemon started (a mistyped flag of a Spark run took 3-5 s, its JVM started ahead)."""
    probe = ("import sys, threading\n"
             f"sys.argv = ['sparknet', *{argv.split()!r}]\n"
             "from sparknet.__main__ import main\n"
             "try:\n"
             "    main()\n"
             "except SystemExit as e:\n"
             "    print('exit', e.code, 'torch' in sys.modules, 'py4j' in sys.modules, threading.active_count(),\n"
             "          file=sys.stderr)\n")
    out = _python("-c", probe)
    assert shown in out.stdout + out.stderr, out
    code = 0 if "help" in argv or "version" in argv else 2
    assert out.stderr.strip().splitlines()[-1] == f"exit {code} False False 1", out.stderr


@pytest.mark.parametrize("master,here", [
    ("local[*]", True), ("local[2]", True),
    ("local-cluster[2,1,1024]", True),  # executors of this machine, in this network namespace
    ("spark://10.0.0.1:7077", False), ("sc://localhost:15002", False),  # the Connect server's executors are its own
])
def test_which_sessions_load_the_python_daemon_ahead(master, here):
    from sparknet.__main__ import on_one_machine

    assert on_one_machine(master) is here


@pytest.mark.parametrize("cores,setting,ahead", [
    (2, None, False), (3, None, False), (4, None, True), (16, None, True),
    (16, "0", False), (2, "1", True), (2, "yes", False),  # not 0 or 1: the cores decide
])
def test_the_whole_session_starts_ahead_where_cores_are_spare_or_the_setting_says_so(monkeypatch, cores, setting,
                                                                                     ahead):
    from sparknet.spark import session

    monkeypatch.setattr(session.os, "sched_getaffinity", lambda pid: set(range(cores)))
    if setting is None:
        monkeypatch.delenv(session.SESSION_AHEAD_ENV, raising=False)
    else:
        monkeypatch.setenv(session.SESSION_AHEAD_ENV, setting)
    assert session.starts_session_ahead() is ahead


def test_the_daemon_is_loaded_ahead_only_where_sparknets_own_runs_on_this_interpreter(tmp_path, monkeypatch):
    import sys

    from sparknet.spark.session import forks_sparknet_daemon

    monkeypatch.setenv("SPARK_CONF_DIR", str(tmp_path))  # no spark-defaults.conf in it
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    assert forks_sparknet_daemon()
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    assert forks_sparknet_daemon()
    monkeypatch.setenv("PYSPARK_PYTHON", "/bin/sh")  # another interpreter runs the workers
    assert not forks_sparknet_daemon()
    monkeypatch.delenv("PYSPARK_PYTHON")
    (tmp_path / "spark-defaults.conf").write_text("spark.python.daemon.module   my.daemon\n")  # the user's daemon
    assert not forks_sparknet_daemon()


def test_import_sparknet_and_its_session_module_load_no_torch():
    """What ``python -m sparknet`` loads before it starts the driver JVM: no torch, so the JVM starts while torch
    loads; the API's names still import on first use."""
    script = ("import sys, sparknet, sparknet.spark.session, sparknet.__main__\n"
              "print('torch' in sys.modules)\n"
              "from sparknet import Net, zoo\n"
              "from sparknet.spark import SparkTrainer\n"
              "print('torch' in sys.modules, Net.__module__, zoo.__name__, SparkTrainer.__module__)\n")
    out = _python("-c", script)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "sparknet.net", "sparknet.zoo", "sparknet.spark.trainer"]


@pytest.mark.parametrize("argv, refused", [
    ("--workers 1 --strategy diloco", "a run of one worker in this process, without Spark, does not read --strategy"),
    ("--warmup-steps 100 --compression int8", "does not read --warmup-steps, --compression"),
    ("--eval-every-rounds 3", "--eval-every-rounds (in one process: --eval-every STEPS)"),
    ("--staging-dir /tmp/s", "--staging-dir (the Spark engines')"),
    ("--workers 2 --eval-every 100", "a run on Spark does not read --eval-every (on Spark: --eval-every-rounds N)"),
    ("--workers 2 --combiner mean", "--combiner (--strategy async's)"),
    ("--workers 2 --snapshot-every 5", "--snapshot-every (a Caffe run's, with --prototxt or --solver)"),
    ("--workers 2 --strategy async --compression int8 --link-latency 50ms",
     "parameter server (epochs, not rounds, each evaluated and, with --checkpoint-dir, checkpointed; no Spark "
     "engine) does not read --compression, --link-latency: choose another --strategy, or drop them"),
    ("--workers 2 --strategy async --engine barrier --rounds 3", "does not read --engine, --rounds"),
    ("--workers 2 --strategy async --eval-every 10", "does not read --eval-every"),
    ("--eval-sharded", "a run of one worker in this process, without Spark, does not read --eval-sharded"),
    ("--workers 2 --strategy async --eval-sharded", "does not read --eval-sharded"),
    ("--solver s.prototxt --workers 2 --eval-sharded", "a Caffe run on the rounds engine (its test nets "
     "score the weights, at its test_interval) does not read --eval-sharded"),
    ("--solver s.prototxt --profile-dir p --profile-round 3", "does not read --profile-dir, --profile-round"),
    ("--solver s.prototxt --model mlp", "a Caffe run (its net's data layers say what trains on what"),
    ("--solver s.prototxt --target-accuracy 0.9", "a Caffe run of one worker in this process (its tests and "
                                                  "snapshots are its solver's) does not read --target-accuracy"),
    ("--solver s.prototxt --checkpoint-dir ck", "does not read --checkpoint-dir"),
    ("--solver s.prototxt --data t.parquet --model mlp --task regression", "does not read --model, --data, --task"),
    ("--solver s.prototxt --workers 2 --target-accuracy 0.9", "a Caffe run on the rounds engine (its test nets "
     "score the weights, at its test_interval) does not read --target-accuracy: add --engine barrier"),
    ("--solver s.prototxt --workers 2 --engine barrier --eval-every-rounds 2", "does not read --eval-every-rounds"),
])
def test_a_setting_the_run_s_road_does_not_read_is_refused_before_anything_starts(argv, refused, caplog,
                                                                                  monkeypatch):
    """Each road reads its own settings; one given to a road that would leave it unread (a checkpoint folder for
    the parameter server, a strategy for one process) is refused, naming it, before any data, torch or Spark."""
    import sys

    from sparknet import cli

    monkeypatch.delitem(sys.modules, "sparknet.ps.session", raising=False)  # a road's code: imported as taken
    args = cli.parse_args(["train", *argv.split()])
    assert cli.session_master(args) is None  # no session started ahead for it
    assert cli.main(["train", *argv.split()]) == 2
    assert refused in caplog.text
    assert "sparknet.ps.session" not in sys.modules


def test_every_setting_a_road_leaves_unread_is_a_setting():
    """A name in the roads' table that is no field would refuse nothing: every one is a field of its kind."""
    import dataclasses

    from sparknet import roads

    tables = [*roads._UNREAD.values(), *(roads._caffe_unread(DistributedConfig(workers=k, engine=engine))
                                       for k, engine in ((1, "rounds"), (2, "rounds"), (2, "barrier")))]
    from sparknet.ps.config import AsyncConfig

    for _, _, unread in tables:
        for kind, names in unread.items():
            kind = AsyncConfig if kind == roads.AsyncConfig else kind  # named there: roads imports no ps
            fields = {f.name for f in dataclasses.fields(kind)}
            assert set(names or ()) <= fields, (kind.__name__, set(names or ()) - fields)


def test_a_program_calling_a_road_s_entry_point_gets_the_command_s_refusal(tmp_path):
    """train_local, run_async, train_distributed and train_caffe_files refuse the settings their road leaves unread,
    as sparknet train does, before any data is read or any session started."""
    from sparknet.caffe.cli import train_caffe_files
    from sparknet.config import CaffeTrainFlags, RunConfig
    from sparknet.ps.session import run_async
    from sparknet.spark.run import train_distributed
    from sparknet.train import train_local

    run = RunConfig(model="mlp", dataset="synthetic", steps=5, quiet=True)
    with pytest.raises(ValueError, match="one worker in this process, without Spark, does not read --strategy"):
        train_local(run, DistributedConfig(strategy="diloco"))
    with pytest.raises(ValueError, match="parameter server .* does not read --compression"):
        run_async(run, DistributedConfig(workers=2, strategy="async", compression="int8"))
    with pytest.raises(ValueError, match="a run on Spark does not read --eval-every"):
        train_distributed(RunConfig(model="mlp", dataset="synthetic", eval_every=10), DistributedConfig(workers=2))
    with pytest.raises(ValueError, match="a Caffe run .* does not read --model"):
        train_caffe_files(run, DistributedConfig(), CaffeTrainFlags(solver=str(tmp_path / "s.prototxt")))


def test_the_local_engine_trains_one_worker_in_this_process(tmp_path):
    out = tmp_path / "m.jsonl"
    assert main(["train", "--engine", "local", "--model", "mlp", "--dataset", "synthetic", "--steps", "20",
                 "--tau", "10", "--threads", "1", "--metrics-out", str(out), "--quiet"]) == 0
    summary = read_metrics(out)[-1]
    assert summary["event"] == "summary" and summary["engine"] == "local" and summary["steps"] == 20
    assert main(["train", "--engine", "local", "--workers", "2", "--quiet"]) == 2


def test_profile_dir_traces_one_round_of_a_run_in_one_process(tmp_path, caplog):
    """--profile-dir has torch's profiler trace round --profile-round of the worker: a Chrome trace and its table of
    ops by their own CPU time; --profile-round alone, or a round below 0, is refused."""
    folder = tmp_path / "traces"
    assert main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "60", "--tau", "20", "--quiet",
                 "--profile-dir", str(folder), "--profile-round", "0"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["worker-0-round0.json", "worker-0-round0.txt"]
    events = json.loads((folder / "worker-0-round0.json").read_text())["traceEvents"]
    assert {"aten::addmm", "aten::mm"} <= {e.get("name") for e in events}
    table = (folder / "worker-0-round0.txt").read_text()
    assert "Self CPU" in table and "aten::addmm" in table
    (tmp_path / "a-file").write_text("")  # a folder that cannot be made: the run goes on and says why
    assert main(["train", "--model", "mlp", "--dataset", "synthetic", "--steps", "40", "--tau", "20", "--quiet",
                 "--profile-dir", str(tmp_path / "a-file" / "traces")]) == 0
    assert "round 1's trace could not be written to" in caplog.text and "the fit goes on without it" in caplog.text
    assert main(["train", "--profile-round", "2"]) == 2
    assert "--profile-round says which round --profile-dir traces: give --profile-dir too" in caplog.text
    assert main(["train", "--profile-dir", str(folder), "--profile-round", "-1"]) == 2
    assert "profile_round must be at least 0" in caplog.text
