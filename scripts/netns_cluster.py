"""A multi-host Spark standalone cluster in a box: every worker "host" in its own network and mount namespace.

One machine plays a cluster the way a real one behaves towards a job: a private bridge holds
the driver's address (``10.x.y.1``, in this machine's own namespace, where the master and the
driver run) and one address per worker host. Each worker runs in its own Linux network
namespace (its own loopback, its own hostname, ``/etc/hosts`` naming every host) and its own
mount namespace (a private ``/tmp`` and a private, empty home folder), so an executor can reach
neither the driver's loopback nor the driver's local files: exactly what a real cluster refuses.

Run a command against it (root needed: ``ip netns``, ``unshare``, ``mount``)::

    python scripts/netns_cluster.py                    # sparknet train --model lenet --dataset mnist --workers 2
    python scripts/netns_cluster.py --workers 3 -- sparknet train --workers 3 --master '$SPARKNET_MASTER'

The command runs in this machine's namespace with ``SPARKNET_MASTER`` (``spark://10.x.y.1:PORT``),
``SPARKNET_MASTER_UI``, ``SPARK_LOCAL_IP`` (the driver's bridge address: a driver must
advertise an address executors can reach) and ``PYSPARK_PYTHON`` set; a literal
``$SPARKNET_MASTER`` in its arguments is replaced. The exit status is the command's.

From Python (the tests' fixture)::

    with NetnsCluster(workers=2) as cluster:
        spark = SparkSession.builder.master(cluster.master).config(map=cluster.driver_conf()).getOrCreate()
        cluster.kill_host(1)      # every process of host 1 killed, its link down
        cluster.start_host(1)     # back again

Everything it starts is stopped by pid (and every process left in a worker's namespace, which
only this rig can have started), and every namespace, link, bridge and ``/etc/netns`` entry it
made is removed, on success, failure, SIGTERM and Ctrl-C. A rig records its maker (``/run/sparknet-rigs``); one
whose maker was killed before it could clean up, and in which nothing runs, is removed by the next rig to start.
Traffic stays on the bridge.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

__all__ = ["NetnsCluster", "RigError", "rig_unavailable", "remove_stale_rigs"]

DRIVER_NAME = "sparknet-driver"


class RigError(RuntimeError):
    """The cluster could not start (or a host could not be started again)."""


def rig_unavailable() -> str | None:
    """Why this machine cannot run the rig (``None``: it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "the multi-host rig needs root (ip netns, unshare, mount)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the multi-host rig needs the {tool!r} command"
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        return "Spark needs Java (java on PATH or JAVA_HOME)"
    return None


def _run(*cmd: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if check and out.returncode != 0:
        raise RigError(f"{' '.join(cmd)} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out


def _stat(pid: int, field: int) -> str | None:
    """Field ``field`` of ``/proc/<pid>/stat`` counted after the command's name (0: the state), or ``None`` where the
    process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[field]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    return _stat(pid, 0) not in (None, "Z")


def _stop(pid: int, grace_s: float = 15.0) -> None:
    """TERM a process group we started (its leader is ``pid``), then KILL what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)
        if not _alive(pid):
            return


OWNERS = Path("/run/sparknet-rigs")
"""One file a rig, named by its tag: the pid and start time of the process that made it. A rig whose maker is gone
(killed before it could remove what it made) and in whose namespaces nothing runs is removed by the next rig."""


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks since boot): with its pid, what names it across pid reuse."""
    return _stat(pid, 19)


def remove_stale_rigs() -> list[str]:
    """Remove the namespaces, ``/etc/netns`` entries and bridge of every rig whose maker is no longer running and in
    whose namespaces no process runs; returns their tags. A rig without an owner file (made by an older rig) is left
    alone: nothing says it is not another's."""
    removed = []
    for owner in sorted(OWNERS.glob("*")) if OWNERS.is_dir() else []:
        tag = owner.name
        try:
            pid, started = owner.read_text().split()
        except (OSError, ValueError):
            continue
        if _start_time(int(pid)) == started:
            continue  # its maker still runs: the rig is in use (or being made)
        names = [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
                 if line.split() and line.split()[0].startswith(f"sn{tag}w")]
        if any(_run("ip", "netns", "pids", ns, check=False).stdout.split() for ns in names):
            continue  # something still runs inside: not ours to end
        for ns in names:
            _run("ip", "netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        _run("ip", "link", "del", f"snb{tag}", check=False)
        owner.unlink(missing_ok=True)
        removed.append(tag)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.231.0.0/16 that no interface of this machine uses."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    for _ in range(100):
        net = ipaddress.IPv4Network(f"10.231.{secrets.randbelow(254) + 1}.0/24")
        if f" {str(net.network_address)[:-1]}" not in used:
            return net
    raise RigError("found no free 10.231.x.0/24 subnet for the bridge")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class NetnsCluster:
    """A Spark standalone master (on the bridge, in this namespace) and ``workers`` worker hosts.

    Parameters
    ----------
    workers : int
        Worker hosts, each its own network and mount namespace.
    cores, memory : int, str
        What each worker offers to executors.
    folder : path, optional
        Logs and each host's private home (default: a new temporary folder, removed on a clean stop).
    timeout_s : float
        Longest wait for the master and the workers to come up.
    """

    def __init__(self, workers: int = 2, *, cores: int = 1, memory: str = "1g", folder: str | None = None,
                 timeout_s: float = 120.0):
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers, self.cores, self.memory, self.timeout_s = workers, cores, memory, timeout_s
        self._own_folder = folder is None
        self.folder = Path(folder or tempfile.mkdtemp(prefix="sparknet-netns-")).resolve()
        self.tag = secrets.token_hex(2)
        self.bridge = f"snb{self.tag}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.driver_ip = ""
        self.master = ""
        self.master_ui = ""
        self._master_pid: int | None = None
        self._hosts: dict[int, int | None] = {}  # host index -> worker pid (None: down)
        self._made: list[tuple[str, str]] = []  # ("netns" | "bridge" | "etc", name): what stop() removes
        self.python = sys.executable
        import pyspark

        self.spark_home = os.path.dirname(pyspark.__file__)

    # -- names ----------------------------------------------------------------------------------
    def host_ip(self, i: int) -> str:
        return str(self.subnet.network_address + 10 + i)

    def hostname(self, i: int) -> str:
        return f"sparknet-w{i}"

    def netns(self, i: int) -> str:
        return f"sn{self.tag}w{i}"

    def _veth(self, i: int) -> tuple[str, str]:
        return f"snh{self.tag}{i}", f"snn{self.tag}{i}"

    def driver_conf(self) -> dict[str, str]:
        """Spark settings a driver in this namespace needs: an address the executors can reach."""
        return {"spark.driver.host": self.driver_ip, "spark.driver.bindAddress": self.driver_ip,
                "spark.pyspark.python": self.python, "spark.executor.memory": "768m",
                "spark.cores.max": str(self.workers * self.cores)}

    def env(self) -> dict[str, str]:
        """The environment of a command run against the cluster."""
        return {**os.environ, "SPARKNET_MASTER": self.master, "SPARKNET_MASTER_UI": self.master_ui,
                "SPARK_LOCAL_IP": self.driver_ip, "PYSPARK_PYTHON": self.python,
                "PYSPARK_DRIVER_PYTHON": self.python, "SPARKNET_CLUSTER_DIR": str(self.folder)}

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> NetnsCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(keep_logs=exc[0] is not None)

    def start(self) -> None:
        why = rig_unavailable()
        if why:
            raise RigError(why)
        try:
            self._network()
            self._start_master()
            for i in range(1, self.workers + 1):
                self.start_host(i, wait=False)
            self.wait_for_workers(self.workers)
        except BaseException:
            self.stop(keep_logs=True)
            raise

    def _network(self) -> None:
        for tag in remove_stale_rigs():
            print(f"netns_cluster: removed rig {tag}, left behind by a process that is gone", file=sys.stderr)
        OWNERS.mkdir(parents=True, exist_ok=True)  # this rig's owner, before anything of it exists
        (OWNERS / self.tag).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
        self._made.append(("owner", str(OWNERS / self.tag)))
        self.subnet = _free_subnet()
        self.driver_ip = str(self.subnet.network_address + 1)
        prefix = self.subnet.prefixlen
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        self._made.append(("bridge", self.bridge))
        _run("ip", "addr", "add", f"{self.driver_ip}/{prefix}", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        hosts = [f"127.0.0.1 localhost", f"{self.driver_ip} {DRIVER_NAME}"]
        hosts += [f"{self.host_ip(i)} {self.hostname(i)}" for i in range(1, self.workers + 1)]
        for i in range(1, self.workers + 1):
            ns, (outside, inside) = self.netns(i), self._veth(i)
            _run("ip", "netns", "add", ns)
            self._made.append(("netns", ns))
            etc = Path("/etc/netns") / ns  # `ip netns exec` mounts these over /etc/hosts and /etc/hostname
            etc.mkdir(parents=True, exist_ok=True)
            self._made.append(("etc", str(etc)))
            (etc / "hosts").write_text("\n".join(hosts) + "\n")
            (etc / "hostname").write_text(self.hostname(i) + "\n")
            _run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _run("ip", "link", "set", inside, "netns", ns)
            _run("ip", "link", "set", outside, "master", self.bridge, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.host_ip(i)}/{prefix}", "dev", inside)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def _spawn(self, argv: list[str], log: Path, env: dict) -> int:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                    start_new_session=True)
        return proc.pid

    def _spark_env(self, local_ip: str) -> dict:
        return {**os.environ, "SPARK_HOME": self.spark_home, "SPARK_LOCAL_IP": local_ip,
                "SPARK_DAEMON_MEMORY": "512m", "PYSPARK_PYTHON": self.python, "SPARK_NO_DAEMONIZE": "1"}

    def _start_master(self) -> None:
        port, ui = _free_port(self.driver_ip), _free_port(self.driver_ip)
        self.master, self.master_ui = f"spark://{self.driver_ip}:{port}", f"http://{self.driver_ip}:{ui}"
        (self.folder / "logs").mkdir(parents=True, exist_ok=True)
        self._master_pid = self._spawn(
            [f"{self.spark_home}/bin/spark-class", "org.apache.spark.deploy.master.Master", "--host", self.driver_ip,
             "--port", str(port), "--webui-port", str(ui)], self.folder / "logs" / "master.log",
            self._spark_env(self.driver_ip))
        self._wait(lambda state: state is not None, "the master to answer")

    def start_host(self, i: int, *, wait: bool = True) -> None:
        """Start worker host ``i`` (its link up, a fresh worker JVM in its namespaces)."""
        if self._hosts.get(i):
            raise RigError(f"host {i} is already up")
        _run("ip", "link", "set", self._veth(i)[0], "up")
        home = self.folder / f"host{i}" / "home"
        home.mkdir(parents=True, exist_ok=True)
        keep = sorted({str(Path(p).resolve()) for p in (Path(__file__).resolve().parents[1], sys.prefix,
                                                        sys.base_prefix, self.spark_home)})
        inner = [self.python, str(Path(__file__).resolve()), "_enter", "--hostname", self.hostname(i),
                 "--home", str(home), *[a for p in keep for a in ("--keep", p)], "--",
                 f"{self.spark_home}/bin/spark-class", "org.apache.spark.deploy.worker.Worker",
                 "--host", self.host_ip(i), "--cores", str(self.cores), "--memory", self.memory,
                 "--webui-port", "0", "--work-dir", "/tmp/spark-work", self.master]
        argv = ["ip", "netns", "exec", self.netns(i), "unshare", "--mount", "--uts", "--propagation", "private",
                "--", *inner]
        self._hosts[i] = self._spawn(argv, self.folder / "logs" / f"host{i}.log", self._spark_env(self.host_ip(i)))
        if wait:
            self.wait_for_workers(sum(1 for pid in self._hosts.values() if pid))

    def host_up(self, i: int) -> bool:
        """Whether host ``i``'s worker was started and not killed since."""
        return bool(self._hosts.get(i))

    def kill_host(self, i: int) -> None:
        """Lose host ``i`` as a machine is lost: every process in it killed at once, its link down."""
        self._kill_namespace(i)
        self._hosts[i] = None
        _run("ip", "link", "set", self._veth(i)[0], "down", check=False)

    def link_bytes(self, i: int) -> int:
        """Bytes host ``i``'s link has carried both ways since it was made: what left or reached the host over
        the network (traffic between processes on the host stays on its loopback)."""
        stats = Path("/sys/class/net") / self._veth(i)[0] / "statistics"
        return sum(int((stats / name).read_text()) for name in ("rx_bytes", "tx_bytes"))

    def kill_executors(self, i: int) -> int:
        """Lose host ``i``'s executors as a crashed executor is lost (SIGKILL to each executor JVM; its Python
        workers end with it); the host and its worker daemon stay up, and the master starts new executors.
        Returns how many were killed."""
        killed = 0
        for pid in (int(p) for p in _run("ip", "netns", "pids", self.netns(i), check=False).stdout.split()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"CoarseGrainedExecutorBackend" in cmdline:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        return killed

    def _kill_namespace(self, i: int) -> None:
        for _ in range(50):  # bounded: a process forking while we kill is caught on the next pass
            pids = [int(p) for p in _run("ip", "netns", "pids", self.netns(i), check=False).stdout.split()]
            pids = [p for p in pids if _alive(p)]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        raise RigError(f"processes of host {i} survived SIGKILL")

    def state(self) -> dict | None:
        """The master's JSON status (``None`` when it does not answer)."""
        try:
            with urllib.request.urlopen(self.master_ui + "/json/", timeout=5) as r:
                return json.load(r)
        except OSError:
            return None

    def wait_for_workers(self, n: int) -> None:
        self._wait(lambda s: s is not None and int(s.get("aliveworkers", 0)) >= n, f"{n} alive workers")

    def _wait(self, ok, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for name, pid in [("master", self._master_pid), *((f"host {i}", p) for i, p in self._hosts.items())]:
                if pid and not _alive(pid):
                    raise RigError(f"the {name} JVM exited while waiting for {what}; see {self.folder}/logs")
            if ok(self.state()):
                return
            time.sleep(0.5)
        raise RigError(f"timed out after {self.timeout_s:g} s waiting for {what}; see {self.folder}/logs")

    def stop(self, *, keep_logs: bool = False) -> None:
        """Stop every process this rig started and remove everything it made (safe to call twice)."""
        errors = []
        for i, pid in list(self._hosts.items()):
            if pid:
                _stop(pid)
            try:
                self._kill_namespace(i)
            except (RigError, subprocess.SubprocessError) as e:
                errors.append(str(e))
            self._hosts[i] = None
        if self._master_pid:
            _stop(self._master_pid)
            self._master_pid = None
        for kind, name in reversed(self._made):
            if kind == "netns":
                out = _run("ip", "netns", "del", name, check=False)
            elif kind == "bridge":
                out = _run("ip", "link", "del", name, check=False)
            elif kind == "owner":  # last: what it owned is gone (or named in the errors, and left to its maker)
                if not errors:
                    Path(name).unlink(missing_ok=True)
                continue
            else:
                shutil.rmtree(name, ignore_errors=True)
                continue
            if out.returncode:
                errors.append(out.stderr.strip())
        self._made.clear()
        if self._own_folder and not keep_logs and not errors:
            shutil.rmtree(self.folder, ignore_errors=True)
        if errors:
            raise RigError("the rig did not come down cleanly: " + "; ".join(errors))


# -- inside a worker host's namespaces ------------------------------------------------------------
def _enter(args: argparse.Namespace) -> None:
    """Set up a host's private mounts and hostname (we are its first process), then exec the worker."""
    socket.sethostname(args.hostname)
    home = os.path.expanduser("~")
    hidden = {root: os.open(root, os.O_RDONLY | os.O_DIRECTORY) for root in (home, "/tmp")}  # to bind back from
    subprocess.run(["mount", "--bind", args.home, home], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=1777", "tmpfs", "/tmp"], check=True)
    for path in args.keep:  # the code, Python and Spark where they lie under the home or /tmp (pyenv, a clone)
        for root, fd in hidden.items():
            if path.startswith(root.rstrip("/") + "/"):
                os.makedirs(path, exist_ok=True)
                rel = path[len(root.rstrip("/")) + 1:]
                subprocess.run(["mount", "--no-canonicalize", "--bind", f"/proc/{os.getpid()}/fd/{fd}/{rel}", path],
                               check=True)
                break
    for fd in hidden.values():
        os.close(fd)
    os.makedirs("/tmp/spark-work", exist_ok=True)
    os.execvp(args.command[0], args.command)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb")
    enter = sub.add_parser("_enter", help=argparse.SUPPRESS)
    enter.add_argument("--hostname", required=True)
    enter.add_argument("--home", required=True)
    enter.add_argument("--keep", action="append", default=[])
    enter.add_argument("command", nargs=argparse.REMAINDER)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_enter"]:
        args = p.parse_args(argv)
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        _enter(args)
        return 1
    cut = argv.index("--") if "--" in argv else len(argv)
    opts = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    opts.add_argument("--workers", type=int, default=2)
    opts.add_argument("--cores", type=int, default=1)
    opts.add_argument("--memory", default="1g")
    opts.add_argument("--timeout", type=float, default=120.0)
    args = opts.parse_args(argv[:cut])
    command = argv[cut + 1:] or ["sparknet", "train", "--model", "lenet", "--dataset", "mnist", "--workers",
                                 str(args.workers), "--master", "$SPARKNET_MASTER"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with NetnsCluster(args.workers, cores=args.cores, memory=args.memory, timeout_s=args.timeout) as cluster:
        command = [a.replace("$SPARKNET_MASTER", cluster.master) for a in command]
        print(f"netns_cluster: {cluster.master}, {args.workers} worker hosts on {cluster.subnet}; running "
              f"{' '.join(command)}", file=sys.stderr)
        proc = subprocess.Popen(command, env=cluster.env())
        try:
            return proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
