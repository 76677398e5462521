"""Server lifecycle shared by the server engines (SGLang, vLLM): one launch serves a whole job.

`Supervisor` owns the server process of one job:

- launch: the engine's command (the job's own interpreter, i.e. the role's, runs the server
  module), on 127.0.0.1 and a free port unless one is configured, with the engine's extra
  environment. It runs under a small guard process (`GUARD`, standard library only) that leads
  its own process group: the kernel sends the guard SIGTERM when the job dies, even by SIGKILL
  (PR_SET_PDEATHSIG), and the guard then terminates the whole group, so not even a killed job
  leaves a server or one of its worker processes behind;
- health: `/health` polled until it answers 200, within `startup_timeout` seconds; if the
  process exits first, the error says so at once, with its exit code and the tail of its log.
  Only our own server counts: a fixed port that another process holds is refused before the
  launch (naming the port and that process), and a 200 is accepted only when the process
  listening on the port is in the group this launch started (`draftsmith.runtime.ports`);
- log: every line the server prints goes to the job's stderr (the rule's log) with a prefix,
  and the last lines are kept for error messages;
- shutdown: on leaving the `with` block (normally, on an error, or on SIGTERM/SIGHUP/SIGINT,
  which the supervisor turns into exceptions) the whole process group gets SIGTERM, then
  SIGKILL after a grace period;
- restarts: `run_requests` sends a list of requests with bounded concurrency; when the server
  dies mid-way it is relaunched (at most `retries` times per job) and only the requests without
  an answer are sent again.

Every process of a server carries DRAFTSMITH_SERVER=<tag> in its environment, which is how
`server_processes(tag)` (and the tests) find what is left of it.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.runtime.ports import PortTaken, check_free, holder, in_group, listeners, listening
from draftsmith.runtime.serverhosts import proc_stat

log = logging.getLogger("draftsmith.engines.server")

MARKER = "DRAFTSMITH_SERVER"
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
# What a request raises when the server is unreachable or broke the connection.
TRANSPORT_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


class ServerError(RuntimeError):
    """The server could not be started, or kept failing; the message carries its log tail.
    `summary`: the same in one line, naming the server, where its log is and what to do (the
    command line prints it last, draftsmith.cli); `kind`: "exited" (during start-up),
    "timeout", "port" or "died"."""

    def __init__(self, message: str, summary: str = "", kind: str = "died"):
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]
        self.kind = kind

    def one_line(self) -> str:
        return self.summary


class RequestRejected(RuntimeError):
    """The server answered a request with a 4xx status: sending it again cannot help."""


class Terminated(SystemExit):
    """The job received a termination signal (the server is shut down on the way out)."""


@dataclass
class ServerSpec:
    """How to launch one server. `command(port)` is the full argv (interpreter first)."""

    name: str
    command: Callable[[int], list[str]]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0  # 0 = a free port, chosen at each launch
    startup_timeout: float = 600.0
    health_path: str = "/health"
    grace: float = 15.0  # seconds between SIGTERM and SIGKILL at shutdown
    port_key: str = "the server's port setting"  # the config key `port` came from (messages)

    def key(self, name: str) -> str:
        """The config key `name` of this server's engine section (the section `port_key`
        names), for messages that say what to change."""
        section = self.port_key.split(".")[0] if "." in self.port_key else ""
        return f"{section}.{name}" if section else f"the engine's {name}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The guard: argv = [job pid, grace seconds, server argv...]. It starts the server in its own
# process group and terminates that group when the job is gone (SIGTERM from PR_SET_PDEATHSIG,
# or a parent pid that changed before the signal was armed) or when the server exits.
GUARD = r"""
import os, signal, subprocess, sys, time
job, grace, argv = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:]
SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
child = None

def exited(pid):
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0  # not child.poll(): wait() holds its lock
    except ChildProcessError:
        return True

def stop_group(*_):
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)  # the group's signal reaches the guard too
    os.killpg(0, signal.SIGTERM)
    end = time.monotonic() + grace
    while child is not None and not exited(child.pid) and time.monotonic() < end:
        time.sleep(0.1)
    os.killpg(0, signal.SIGKILL)  # stragglers, and the guard itself

for s in SIGNALS:
    signal.signal(s, stop_group)
if os.getppid() != job:
    stop_group()
child = subprocess.Popen(argv)
if os.getppid() != job:
    stop_group()
code = child.wait()
for s in SIGNALS:
    signal.signal(s, signal.SIG_IGN)
os.killpg(0, signal.SIGTERM)  # the server's workers, if it left any
print(f"[guard] server exited with code {code}", flush=True)
sys.exit(code if code >= 0 else 128 - code)
"""


def _arm_parent_death_signal() -> None:
    """preexec_fn of the guard: SIGTERM when the job's launching thread dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def http_json(url: str, payload: dict | None = None, timeout: float = 60.0):
    """GET (payload None) or POST JSON; returns the decoded JSON body.

    A 4xx answer raises `RequestRejected` with the server's message; a 5xx answer raises
    urllib's HTTPError (retried by `run_requests`).
    """
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as e:
        if 400 <= e.code < 500:
            detail = e.read().decode("utf-8", "replace")[:2000]
            raise RequestRejected(f"{url}: HTTP {e.code}: {detail}") from None
        raise
    return json.loads(body) if body else None


def answers_health(url: str, timeout: float) -> bool:
    """Whether the health endpoint `url` answers 200 within `timeout` seconds."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200
    except TRANSPORT_ERRORS:
        return False


class Server:
    """One server process: start, wait until healthy, stream its log, stop its process group."""

    def __init__(self, spec: ServerSpec, tag: str, log_stream=None, tail_lines: int = 60):
        self.spec, self.tag = spec, tag
        self.log_stream = log_stream or sys.stderr
        self.tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._reader: threading.Thread | None = None
        # where a reader finds the server's output (its lines go to `log_stream`)
        self.log_where = f"the lines marked [{spec.name}] in this job's log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        if self.spec.port:  # a fixed port: refuse one that another process holds
            try:
                check_free(self.spec.port, key=self.spec.port_key)
            except PortTaken as e:
                raise ServerError(
                    f"{self.spec.name}: {e}",
                    f"{self.spec.name} server not launched: {e}".replace("\n", " "),
                    kind="port",
                ) from None
        self.port = self.spec.port or free_port()
        argv = self.spec.command(self.port)
        env = {**os.environ, **self.spec.env, MARKER: self.tag}
        log.info("%s: launching on port %d: %s", self.spec.name, self.port, " ".join(argv))
        self.tail.clear()
        guard = [sys.executable, "-c", GUARD, str(os.getpid()), str(self.spec.grace)]
        # Popen from the main thread: the death signal follows the thread that forked.
        self.proc = subprocess.Popen(
            guard + argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals all of it
            preexec_fn=_arm_parent_death_signal,
        )
        self._reader = threading.Thread(target=self._pump, args=(self.proc,), daemon=True)
        self._reader.start()

    def _pump(self, proc: subprocess.Popen) -> None:
        prefix = f"[{self.spec.name}] "
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self.tail.append(line)
            with contextlib.suppress(ValueError, OSError):  # log closed at interpreter exit
                self.log_stream.write(prefix + line + "\n")
                self.log_stream.flush()
        proc.stdout.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 30) -> str:
        if self._reader is not None:
            self._reader.join(timeout=2)  # the last lines of a process that just exited
        return "\n".join(list(self.tail)[-n:])

    def died(self, what: str, kind: str = "died") -> ServerError:
        code = self.proc.returncode if self.proc else None
        todo = {
            "exited": f"check the launch flags ({self.spec.key('extra_args')}), the target and "
            "the role's environment, then rerun",
        }.get(kind, "rerun; if it keeps dying, look for an out-of-memory kill or a crash there")
        return ServerError(
            f"{self.spec.name} server {what} (exit code {code}); last lines of its log:\n"
            f"{self.log_tail()}",
            f"{self.spec.name} server {what} (exit code {code}); its output: {self.log_where}; "
            f"{todo}",
            kind=kind,
        )

    def wait_ready(self) -> None:
        """Poll the health endpoint; fail fast if the process exits, or after the timeout."""
        deadline = time.monotonic() + self.spec.startup_timeout
        t0 = time.monotonic()
        while True:
            if not self.alive():
                raise self.died("exited during start-up", kind="exited")
            if answers_health(self.url + self.spec.health_path, 5) and self.answered_by_ours():
                log.info(
                    "%s: healthy after %.1f s (pid %d, port %d)",
                    self.spec.name,
                    time.monotonic() - t0,
                    self.proc.pid,
                    self.port,
                )
                return
            if time.monotonic() > deadline:
                self.stop()
                what = (
                    f"{self.spec.name} server not healthy at {self.url}{self.spec.health_path} "
                    f"after {self.spec.startup_timeout:.0f} s"
                )
                raise ServerError(
                    f"{what} (raise the startup timeout if it is only slow); last lines of its "
                    f"log:\n{self.log_tail()}",
                    f"{what}; its output: {self.log_where}; raise "
                    f"{self.spec.key('startup_timeout')} if it is only slow",
                    kind="timeout",
                )
            time.sleep(0.5)

    def answered_by_ours(self) -> bool:
        """Whether the process listening on the port is in the process group this launch
        started (the guard leads it). Another process there is an error: the job never sends
        it a request. Where /proc shows no sockets (not Linux) the check cannot run."""
        if not Path("/proc/net/tcp").exists():
            return True
        pids = listeners(self.port)
        if pids and in_group(pids, self.proc.pid):
            return True
        if not pids and not listening(self.port):
            return False  # the answer came before the socket showed up: ask again
        self.stop()
        message = (
            f"{self.spec.name}: port {self.port} answered, but from {holder(self.port)}, not "
            f"from the server this job launched (pid {self.proc.pid}); nothing was sent to it. "
            f"Another job with the same port? Use {self.spec.port_key}: 0 (a free port per launch)"
        )
        raise ServerError(message, message, kind="port")

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period; idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # session leader: its pid is the group id
        for sig, patience in ((signal.SIGTERM, self.spec.grace), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)
            if _group_gone(pgid, self.proc, patience):
                break
        if self._reader is not None:
            self._reader.join(timeout=5)
        log.info("%s: stopped (exit code %s)", self.spec.name, self.proc.returncode)


def _group_gone(pgid: int, proc: subprocess.Popen, patience: float) -> bool:
    """Wait up to `patience` s until no live process of group `pgid` is left (reaping the
    leader; zombies count as gone: their reaping is up to their new parent)."""
    deadline = time.monotonic() + patience
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.1)
        if not _live_members(pgid):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)


def _live_members(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = proc_stat(entry)
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != b"Z":
                pids.append(int(entry))
    return pids


def server_processes(tag: str) -> list[int]:
    """Pids of live processes whose DRAFTSMITH_SERVER starts with `tag` (a supervisor's tag is
    `<job pid>-<random>`, so `f"{pid}-"` finds every server process a job started)."""
    needle = f"{MARKER}={tag}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
            state = proc_stat(entry)[0]
        except OSError:
            continue
        if state != b"Z" and any(e.startswith(needle) for e in env):
            pids.append(int(entry))
    return pids


class Supervisor:
    """The server of one job: launched on entry, relaunched (bounded) when it dies, stopped on
    exit. Termination signals become `Terminated` while the supervisor is active."""

    def __init__(self, spec: ServerSpec, retries: int = 2, log_stream=None, tag: str = ""):
        self.spec, self.retries = spec, int(retries)
        self.tag = tag or f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.server = Server(spec, self.tag, log_stream)
        self.restarts = 0
        self.launches = 0
        self.startup_seconds: list[float] = []
        self._old_handlers: dict = {}

    @property
    def url(self) -> str:
        return self.server.url

    def _on_signal(self, signum, _frame):
        raise Terminated(128 + signum)

    def __enter__(self) -> Supervisor:
        if threading.current_thread() is threading.main_thread():
            for sig in HANDLED_SIGNALS:
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._launch()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        # ignore further signals while stopping: a second SIGTERM must not skip the cleanup
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)
        try:
            self.server.stop()
        finally:
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)
            self._old_handlers.clear()

    def _launch(self) -> None:
        """Start the server and wait until it is healthy; a server that exits during start-up
        (an out-of-memory kill, a crash while loading) is launched again while the job's
        retries last. A timeout or a taken port is not: another try cannot help."""
        while True:
            t0 = time.monotonic()
            self.launches += 1
            self.server.start()
            try:
                self.server.wait_ready()
            except ServerError as e:
                if e.kind != "exited" or self.restarts >= self.retries:
                    raise
                self.restarts += 1
                log.warning(
                    "%s: exited during start-up; launch %d of %d. Last lines:\n%s",
                    self.spec.name, self.restarts + 1, self.retries + 1, self.server.log_tail(10),
                )  # fmt: skip
                self.server.stop()
                continue
            self.startup_seconds.append(round(time.monotonic() - t0, 2))
            return

    def alive(self) -> bool:
        return self.server.alive()

    def restart(self, reason: str) -> None:
        """Relaunch after the server died; raises once the job's retries are spent."""
        if self.restarts >= self.retries:
            self.server.stop()
            raise self.server.died(f"died ({reason}) and the {self.retries} restart(s) are spent")
        self.restarts += 1
        log.warning(
            "%s: server died (%s, exit code %s); restart %d of %d. Last lines:\n%s",
            self.spec.name,
            reason,
            self.server.proc.returncode if self.server.proc else None,
            self.restarts,
            self.retries,
            self.server.log_tail(10),
        )
        self.server.stop()
        self._launch()

    def stats(self) -> dict:
        """The same keys as a shared server's lease (draftsmith.engines.sharedserver), so that
        reports read alike whichever served the job."""
        return {
            "server_mode": "job",
            "server_started_by_this_job": True,
            "server_launches": self.launches,
            "server_restarts": self.restarts,
            "server_startup_seconds": self.startup_seconds,
            "server_wait_seconds": round(sum(self.startup_seconds), 2),
        }


def server_down(sup, grace: float = 10.0) -> bool:
    """Whether `sup`'s server is down. A process killed a moment ago can refuse connections
    while it still looks alive, so a live one that fails its health check is watched for up to
    `grace` seconds: down once it exits, up once it answers."""
    deadline = time.monotonic() + grace
    while sup.alive():
        if answers_health(sup.url + sup.spec.health_path, 2):
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def run_requests(
    supervisor: Supervisor,
    items: Sequence,
    send: Callable[[str, object], object],
    *,
    concurrency: int,
    attempts: int = 3,
    on_done: Callable[[int, object], None] | None = None,
) -> list:
    """`send(base_url, item)` for every item, at most `concurrency` at a time; results in order.

    A request that fails while the server is down is not counted against the item: the server
    is restarted (bounded by the supervisor's retries) and every item still without a result is
    sent again. A request that fails while the server stays up is retried up to `attempts`
    times in all. `on_done(index, result)` runs (in the calling thread) as results arrive.
    """
    results: list = [None] * len(items)
    pending = list(range(len(items)))
    tries = [0] * len(items)
    with ThreadPoolExecutor(max_workers=max(1, int(concurrency))) as pool:
        while pending:
            futures = {pool.submit(send, supervisor.url, items[i]): i for i in pending}
            failed: list[tuple[int, BaseException]] = []
            try:
                remaining = set(futures)
                while remaining:
                    done, remaining = wait(remaining, timeout=1.0, return_when="FIRST_COMPLETED")
                    for fut in done:
                        i = futures[fut]
                        err = fut.exception()
                        if err is None:
                            results[i] = fut.result()
                            if on_done is not None:
                                on_done(i, results[i])
                        else:
                            failed.append((i, err))
            except BaseException:
                # stop the server first: requests in flight then fail at once instead of
                # holding the pool's exit until they time out
                for fut in futures:
                    fut.cancel()
                supervisor.server.stop()
                raise
            pending = sorted(i for i, _ in failed)
            if not pending:
                break
            if server_down(supervisor):
                supervisor.restart(f"{len(pending)} request(s) unanswered")
                continue
            for i, err in failed:
                tries[i] += 1
                if tries[i] >= attempts or not isinstance(err, TRANSPORT_ERRORS):
                    raise ServerError(
                        f"request {i} failed {tries[i]} time(s) with the server up: "
                        f"{type(err).__name__}: {err}"
                    ) from err
            log.warning("%d request(s) failed with the server up; retrying them", len(pending))
            time.sleep(1.0)
    return results
