"""One server per stage for the range jobs of one run: with `sglang.shared_server: run` (what
`auto` gives), every regenerate and capture job of a run (offline or segment mode) leases its
stage's server instead of launching one (docs/scale.md). The first job that needs it starts a
*host*,

    python -m draftsmith shared-server host <dir>

a small process in a session of its own (Snakemake stopping the job does not stop it) that
launches the server with `draftsmith.engines.server.Server` (guard process, process group, health,
log) and owns it; the jobs only send requests. Its directory,
`state/servers/<key>-<node>-<run>` (key: the server's argv, which holds every setting of the
config: target, tp_size, extra_args, layer ids; so a job never uses a server launched with other
settings, nor one of another run), holds:

- `spec.json`: what to launch (written by the job that starts the host);
- `host.json`: written by the host only, atomically: its pid, its run (`owner`, the Snakemake
  process of the jobs, DRAFTSMITH_JOB_PARENT; on SLURM the allocation), the server's url,
  `state` (starting, ready, failed, stopped), `generation` (one per launch), the start-up
  seconds of each launch and the GPUs the server holds;
- `start.lock`: flock held by a job while it finds or starts the host and takes its lease, and
  by the host while it decides to stop, so a job never leases a host that is stopping;
- `users.lock`: every job using the server holds a shared flock on it, which the kernel drops
  when the job ends, even by SIGKILL: the host is unused when it can lock it exclusively;
- `last`: written by a capture of the run's last segment index when it is done (segment mode);
- `host.log`: the host's and the server's output.

The host stops the server's process group and exits when (1) `last` exists and no job holds a
lease, (2) no job held one for `sglang.idle_timeout` seconds, (3) the run is gone (the host
imports draftsmith, so draftsmith.runtime.lifeline sends it SIGTERM when the Snakemake process ends,
even by kill -9), (4) it gets SIGTERM, SIGINT or SIGHUP, or (5) the server died more than
`sglang.retries` times (each death is relaunched once no job's request can still be answered:
at once). A host killed by SIGKILL takes its server with it (the guard's parent-death signal).

GPUs: every job that leases a server declares the server's GPUs to Snakemake, so a host holds
GPUs that Snakemake does not count only while it is idle between two jobs. Before a job starts a
server of its own or leases another stage's, and before training starts, the run's idle hosts
that hold GPUs are stopped and waited for (draftsmith.runtime.serverhosts.release_gpu_hosts).
On SLURM each job, each job of a group submission too, is a job step of its own under a
Snakemake process of its own, and SLURM ends a step's processes with it: there the host is a
step of its own that the allocation owns (`owner` slurm<job id>, draftsmith.runtime.slurmstep),
so the range jobs of one group submission lease one server, and it ends with the allocation
(docs/scale.md).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from draftsmith.engines.server import (
    HANDLED_SIGNALS,
    Server,
    ServerError,
    ServerSpec,
    Terminated,
)
from draftsmith.runtime import slurmstep
from draftsmith.runtime.files import atomic_write_json, flocked
from draftsmith.runtime.serverhosts import (
    idle,
    pid_alive,
    read_json,
    release_gpu_hosts,
)

log = logging.getLogger("draftsmith.engines.server")

PORT_MARK = 1 << 20  # no port: `spec.command(PORT_MARK)` marks where the port goes
SCRATCH = "{scratch}"  # in a spec's env values: the host's scratch directory (dump files)
POLL = 0.5


def template(spec: ServerSpec) -> dict:
    """The launch of `spec` as JSON: its name and argv, with "{port}" where the port goes."""
    argv = [a.replace(str(PORT_MARK), "{port}") for a in spec.command(PORT_MARK)]
    return {"name": spec.name, "argv": argv}


def spec_key(spec: ServerSpec) -> str:
    """The directory of the run's server for `spec`: its argv holds every setting of the
    config (model, flags, layer ids); not its environment, which carries the launching job's
    own choices (OMP_WAIT_POLICY for the load it started under, draftsmith.runtime.threads) that
    differ between the jobs of one run and change no result."""
    return hashlib.sha256(json.dumps(template(spec), sort_keys=True).encode()).hexdigest()[:16]


def run_dir_name(spec: ServerSpec, owner: int | str) -> str:
    """`<key>-<node>-<owner>` (owner: the run's pid, or `slurm<job id>` for a SLURM allocation):
    one directory per server settings and run, so two runs (two SLURM jobs on two nodes sharing
    the project's filesystem) never meet in one host's files."""
    return f"{spec_key(spec)}-{socket.gethostname().split('.')[0]}-{owner}"


class SharedServer:
    """A job's lease on the run's shared server; it stands where a `Supervisor` does (url,
    alive, restart, stats). `last`: this job is a capture of the run's last segment index;
    `gpus`: the GPUs the server holds (0 on a CPU role)."""

    def __init__(self, spec: ServerSpec, root: Path, *, owner: int | str, idle_timeout: float,
                 retries: int, last: bool = False, scratch_root: str = "",
                 gpus: int = 0):  # fmt: skip
        owner = owner if slurmstep.is_allocation(owner) else int(owner)
        self.spec, self.owner, self.last, self.gpus = spec, owner, last, int(gpus)
        self.dir = Path(root) / run_dir_name(spec, self.owner)
        self.settings = {"idle_timeout": float(idle_timeout), "retries": int(retries),
                         "scratch_root": scratch_root or tempfile.gettempdir()}  # fmt: skip
        self.info: dict = {}
        self.restarts, self.started_host, self.wait_seconds = 0, False, 0.0
        self._users = self._host = None
        self._old_handlers: dict = {}
        self.server = self  # run_rows stops `sup.server` on an error: here that is the lease

    @property
    def url(self) -> str:
        return self.info["url"]

    @property
    def scratch(self) -> Path:
        return Path(self.info["scratch"])

    def __enter__(self) -> SharedServer:
        for sig in HANDLED_SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._attach()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _on_signal(self, signum, _frame):
        raise Terminated(128 + signum)

    def _attach(self) -> None:
        t0 = time.monotonic()
        if self.gpus:  # before this job's own lock: two stages' jobs never wait on each other
            release_gpu_hosts(self.dir.parent, self.owner, keep=self.dir.name)
        self.dir.mkdir(parents=True, exist_ok=True)
        with flocked(self.dir / "start.lock", fcntl.LOCK_EX):
            self._users = open(self.dir / "users.lock", "a+")  # noqa: SIM115 (held until exit)
            fcntl.flock(self._users, fcntl.LOCK_SH)
            info = read_json(self.dir / "host.json")
            if not self._usable(info):
                self._start_host()
            self.info = self._wait(lambda i: i.get("state") == "ready")
        self.wait_seconds = round(time.monotonic() - t0, 2)
        log.info(
            "%s: the run's shared server at %s (host pid %d, %s, launch %d took %.1f s; this "
            "job waited %.1f s); its log: %s",
            self.spec.name, self.url, self.info["host_pid"],
            "started by this job" if self.started_host else "already up",
            self.info["generation"], self.info["startup_seconds"][-1], self.wait_seconds,
            self.dir / "host.log",
        )  # fmt: skip

    def _usable(self, info: dict) -> bool:
        return (
            info.get("owner") == self.owner
            and info.get("state") in ("starting", "ready")
            and pid_alive(info.get("host_pid", 0), str(self.dir))
        )

    def _start_host(self) -> None:
        step = slurmstep.is_allocation(self.owner)  # a step of its own for the allocation
        full_env = slurmstep.without_lifeline(self.spec.env) if step else self.spec.env
        atomic_write_json(
            self.dir / "spec.json",
            {**template(self.spec), "full_env": full_env, "owner": self.owner,
             "startup_timeout": self.spec.startup_timeout, "grace": self.spec.grace,
             "health_path": self.spec.health_path, "gpus": self.gpus, **self.settings},
        )  # fmt: skip
        (self.dir / "host.json").unlink(missing_ok=True)
        package_root = str(Path(__file__).resolve().parents[2])
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "draftsmith", "shared-server", "host", str(self.dir)]
        env = {**os.environ, "PYTHONPATH": path}
        if step:
            argv, env = slurmstep.step_launch(argv, env, self.owner, gpus=self.gpus,
                                              name=f"{self.spec.name}-server")  # fmt: skip
        with open(self.dir / "host.log", "ab") as out:
            proc = subprocess.Popen(
                argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,  # outlives this job; the run's end stops it
            )  # fmt: skip
        self.started_host, self._host = True, proc
        log.info("%s: started the run's server host (pid %d%s)", self.spec.name, proc.pid,
                 ", a SLURM step" if step else "")  # fmt: skip

    def _wait(self, done) -> dict:
        """host.json once `done(info)`; ServerError when the host failed or is gone."""
        deadline = time.monotonic() + self.spec.startup_timeout + 60
        while True:
            info = read_json(self.dir / "host.json")
            if info and done(info):
                return info
            if (
                info.get("state") in ("failed", "stopped")
                or (info and not pid_alive(info["host_pid"], str(self.dir)))
                or (not info and self._host is not None and self._host.poll() is not None)
            ):
                what = (
                    f"{self.spec.name}: the run's shared server is {info.get('state', 'gone')}"
                    f": {info.get('error', '')}"
                )
                raise ServerError(
                    f"{what}; last lines of {self.dir / 'host.log'}:\n"
                    f"{tail(self.dir / 'host.log')}",
                    f"{what}; its log: {self.dir / 'host.log'}; fix what it shows (launch flags "
                    f"in {self.spec.key('extra_args')}, the target, memory), then rerun",
                )
            if time.monotonic() > deadline:
                what = (
                    f"{self.spec.name}: the run's shared server not ready after "
                    f"{self.spec.startup_timeout:.0f} s"
                )
                raise ServerError(
                    f"{what}; last lines of its log:\n{tail(self.dir / 'host.log')}",
                    f"{what}; its log: {self.dir / 'host.log'}; raise "
                    f"{self.spec.key('startup_timeout')} if it is only slow",
                    kind="timeout",
                )
            time.sleep(POLL)

    def alive(self) -> bool:
        info = read_json(self.dir / "host.json")
        return (
            info.get("state") == "ready"
            and info.get("generation") == self.info.get("generation")
            and pid_alive(info["host_pid"], str(self.dir))
            and pid_alive(info["server_pid"])
        )

    def restart(self, reason: str) -> None:
        """The host relaunches a dead server itself: wait for the next launch to be ready."""
        generation = self.info["generation"]
        log.warning("%s: shared server down (%s); waiting for its relaunch", self.spec.name, reason)
        self.info = self._wait(lambda i: i.get("state") == "ready" and i["generation"] > generation)
        self.restarts += 1

    def stop(self) -> None:
        """What run_rows calls on an error: other jobs may still use the server, so only this
        job's lease ends (at exit); the host stops the server."""

    def __exit__(self, *exc) -> None:
        if self.last and exc[0] is None and self.info:  # a capture of the last index done
            (self.dir / "last").touch()
        if self._users is not None:
            self._users.close()  # the lease: the host stops once no job holds one
            self._users = None
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)
        self._old_handlers.clear()

    def stats(self) -> dict:
        return {
            "server_mode": "run",
            "server_host_pid": self.info.get("host_pid"),
            "server_started_by_this_job": self.started_host,
            "server_launches": self.info.get("generation", 0),
            "server_startup_seconds": self.info.get("startup_seconds", []),
            "server_wait_seconds": self.wait_seconds,
            "server_restarts": self.restarts,
        }


def serve(spec: ServerSpec, stack: contextlib.ExitStack, *, share: dict | None, retries: int,
          idle_timeout: float, gpus: int = 0, scratch_root: str = ""):  # fmt: skip
    """A job's server for `spec`, entered on `stack`: a lease on its stage's shared server when
    `share` ({"dir", "owner", "last"}) is given, else a `Supervisor` of the job's own, launched
    once the run's idle hosts that hold GPUs are stopped (`gpus`: the GPUs it will hold)."""
    if share is None:
        from draftsmith.engines.server import Supervisor

        if gpus:
            release_gpu_hosts()
        return stack.enter_context(Supervisor(spec, retries=retries))
    lease = SharedServer(
        spec,
        Path(share["dir"]),
        owner=share["owner"],
        idle_timeout=idle_timeout,
        retries=retries,
        last=bool(share.get("last")),
        scratch_root=scratch_root,
        gpus=gpus,
    )
    return stack.enter_context(lease)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


class Host:
    """The process that owns a shared server (`python -m draftsmith shared-server host <dir>`)."""

    def __init__(self, d: Path):
        self.dir = d
        self.cfg = json.loads((d / "spec.json").read_text())
        self.scratch = tempfile.mkdtemp(prefix="draftsmith-shared-", dir=self.cfg["scratch_root"])
        env = {k: v.replace(SCRATCH, self.scratch) for k, v in self.cfg["full_env"].items()}
        argv = self.cfg["argv"]
        self.spec = ServerSpec(
            name=self.cfg["name"],
            command=lambda port: [a.replace("{port}", str(port)) for a in argv],
            env=env,
            startup_timeout=float(self.cfg["startup_timeout"]),
            grace=float(self.cfg["grace"]),
            health_path=self.cfg["health_path"],
        )
        self.server = Server(self.spec, f"{os.getpid()}-{uuid.uuid4().hex[:8]}", sys.stdout)
        self.server.log_where = str(d / "host.log")
        self.state = {"host_pid": os.getpid(), "owner": self.cfg["owner"], "state": "starting",
                      "generation": 0, "startup_seconds": [], "scratch": self.scratch,
                      "gpus": int(self.cfg["gpus"]),
                      "node": socket.gethostname()}  # fmt: skip

    def publish(self, **changes) -> None:
        self.state.update(changes)
        atomic_write_json(self.dir / "host.json", self.state)

    def launch(self) -> None:
        self.publish(state="starting")
        t0 = time.monotonic()
        self.server.start()
        self.server.wait_ready()
        seconds = round(time.monotonic() - t0, 2)
        self.publish(
            state="ready",
            url=self.server.url,
            server_pid=self.server.proc.pid,
            generation=self.state["generation"] + 1,
            startup_seconds=[*self.state["startup_seconds"], seconds],
        )

    def first_launch(self) -> int:
        """Launch until healthy; a server that exits during start-up is launched again while
        `sglang.retries` last (those deaths count against them); the deaths."""
        deaths = 0
        while True:
            try:
                self.launch()
                return deaths
            except ServerError as e:
                if e.kind != "exited" or deaths >= int(self.cfg["retries"]):
                    raise
                deaths += 1
                print(f"[host] server exited during start-up; relaunch {deaths}", flush=True)
                self.server.stop()

    def should_stop(self, idle_since: float | None) -> tuple[bool, float | None]:
        """(stop now, idle since): under start.lock, so no job attaches meanwhile; on stop the
        host is marked stopped before the lock is released."""
        try:
            with flocked(self.dir / "start.lock", fcntl.LOCK_EX | fcntl.LOCK_NB):
                if not idle(self.dir):
                    return False, None
                idle_since = idle_since or time.monotonic()
                last = (self.dir / "last").exists()
                if last or time.monotonic() - idle_since >= float(self.cfg["idle_timeout"]):
                    why = "the run's last capture is done" if last else "idle timeout"
                    self.publish(state="stopped", error=why)
                    print(f"[host] stopping: {why}", flush=True)
                    return True, idle_since
                return False, idle_since
        except BlockingIOError:
            return False, None  # a job is attaching

    def run(self) -> int:
        for sig in HANDLED_SIGNALS:
            signal.signal(sig, _terminate)
        (self.dir / "last").unlink(missing_ok=True)
        deaths, idle_since = 0, None
        try:
            deaths = self.first_launch()
            while True:
                time.sleep(POLL)
                if not self.server.alive():
                    deaths += 1
                    if deaths > int(self.cfg["retries"]):
                        self.publish(state="failed", error=f"server died {deaths} times")
                        return 1
                    print(f"[host] server died; relaunch {deaths}", flush=True)
                    self.server.stop()
                    self.launch()
                    continue
                stop, idle_since = self.should_stop(idle_since)
                if stop:
                    return 0
        except ServerError as e:
            self.publish(state="failed", error=str(e).splitlines()[0])
            return 1
        finally:
            if self.state["state"] not in ("failed", "stopped"):
                self.publish(state="stopped", error="host terminated")
            for sig in HANDLED_SIGNALS:  # a second signal must not skip the cleanup
                signal.signal(sig, signal.SIG_IGN)
            self.server.stop()
            shutil.rmtree(self.scratch, ignore_errors=True)


def _terminate(signum, _frame):
    raise Terminated(128 + signum)


def main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m draftsmith shared-server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("command", choices=["host"], help="run the host of a shared server")
    ap.add_argument("dir", type=Path, help="its directory, with spec.json (<root>/<key>)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[host] %(message)s", stream=sys.stdout)
    try:
        code = Host(args.dir).run()
    except Terminated as e:
        code = e.code
    raise SystemExit(code)
