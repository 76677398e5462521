"""Server lifecycle (draftsmith.engines.server): health, fail-fast start-up, log tail, restarts that resume,
shutdown by process group, and no process left after the job is killed.

The managed process here is a small standard-library HTTP program (it has a worker child, as
SGLang's server has its scheduler); what is tested is the lifecycle code, not a server's
behaviour: the SGLang engine is tested against the real SGLang server in test_sglang.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from draftsmith.engines.server import (
    ServerError,
    ServerSpec,
    Supervisor,
    free_port,
    http_json,
    run_requests,
    server_down,
    server_processes,
)

ROOT = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent(
    """
    import http.server, json, os, subprocess, sys, time
    port, crash_after, flag = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    crash = crash_after > 0 and (flag == "always" or not os.path.exists(flag))
    served = 0
    print(f"program up, worker {worker.pid}", flush=True)

    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def do_GET(self):
            self._send(200, {"ok": True})

        def do_POST(self):
            global served
            x = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["x"]
            if x < 0:
                return self._send(400, {"error": f"negative x {x}"})
            time.sleep(0.05)
            served += 1
            print(f"served x={x}", flush=True)  # before the answer: the log has every line
            self._send(200, {"y": 2 * x})
            if crash and served == crash_after:
                if flag != "always":
                    open(flag, "w").close()
                print("crashing on purpose", flush=True)
                os._exit(1)

    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


class Log:
    """A log stream collecting the lines the supervisor forwards."""

    def __init__(self):
        self.lines: list[str] = []

    def write(self, text):
        self.lines.extend(text.splitlines())

    def flush(self):
        pass


def spec(tmp_path, crash_after=0, flag=None, **kw) -> ServerSpec:
    prog = tmp_path / "program.py"
    prog.write_text(PROGRAM)
    flag = str(flag or tmp_path / "crashed")
    return ServerSpec(
        name="prog",
        command=lambda port: [sys.executable, str(prog), str(port), str(crash_after), flag],
        startup_timeout=kw.pop("startup_timeout", 30),
        grace=kw.pop("grace", 3),
        **kw,
    )


def send(url, item):
    return http_json(f"{url}/double", {"x": item}, timeout=30)["y"]


def test_serves_every_request_and_stops_the_whole_group(tmp_path):
    log = Log()
    with Supervisor(spec(tmp_path), retries=0, log_stream=log) as sup:
        tag = sup.tag
        assert len(server_processes(tag)) == 3  # guard, program, its worker
        done = []
        out = run_requests(
            sup, list(range(10)), send, concurrency=3, on_done=lambda i, r: done.append(i)
        )
    assert out == [2 * i for i in range(10)]
    assert sorted(done) == list(range(10))
    assert server_processes(tag) == []
    assert "[prog] program up" in "\n".join(log.lines)
    assert sum(line.startswith("[prog] served") for line in log.lines) == 10


def test_a_server_that_dies_at_start_fails_fast_with_its_log(tmp_path):
    bad = ServerSpec(
        name="prog",
        command=lambda port: [sys.executable, "-c", "print('error: unknown flag --nope'); exit(3)"],
    )
    t0 = time.monotonic()
    with pytest.raises(ServerError) as err, Supervisor(bad, log_stream=Log()):
        pass
    assert time.monotonic() - t0 < 15
    assert "exited during start-up (exit code 3)" in str(err.value)
    assert "unknown flag --nope" in str(err.value)


def test_startup_timeout_stops_the_process(tmp_path):
    slow = ServerSpec(
        name="prog",
        command=lambda port: [
            sys.executable,
            "-c",
            "import time; print('loading'); time.sleep(120)",
        ],
        startup_timeout=2,
        grace=2,
    )
    sup = Supervisor(slow, log_stream=Log())
    with pytest.raises(ServerError, match=r"not healthy .* after 2 s(.|\n)*loading"):
        sup.__enter__()
    assert server_processes(sup.tag) == []


def test_a_server_dying_mid_way_is_restarted_and_only_unanswered_requests_resent(tmp_path):
    log = Log()
    with Supervisor(spec(tmp_path, crash_after=4), retries=2, log_stream=log) as sup:
        out = run_requests(sup, list(range(12)), send, concurrency=2)
        assert sup.stats()["server_restarts"] == 1 and sup.stats()["server_launches"] == 2
    assert out == [2 * i for i in range(12)]
    text = "\n".join(log.lines)
    first, second = text.split("crashing on purpose")
    served = [int(x.split("=")[1]) for x in first.split() if x.startswith("x=")]
    again = [int(x.split("=")[1]) for x in second.split() if x.startswith("x=")]
    assert len(served) == 4 and sorted(served + again) == list(range(12))  # none sent twice


def test_restarts_are_bounded(tmp_path):
    with (
        pytest.raises(ServerError, match=r"1 restart\(s\) are spent(.|\n)*crashing on purpose"),
        Supervisor(
            spec(tmp_path, crash_after=2, flag="always"), retries=1, log_stream=Log()
        ) as sup,
    ):
        run_requests(sup, list(range(10)), send, concurrency=1)
    assert server_processes(sup.tag) == []


def test_a_rejected_request_is_not_retried(tmp_path):
    with (
        pytest.raises(ServerError, match="HTTP 400.*negative x -1"),
        Supervisor(spec(tmp_path), log_stream=Log()) as sup,
    ):
        run_requests(sup, [1, -1, 2], send, concurrency=1)


JOB = """
import sys, time
sys.path.insert(0, {root!r})
from draftsmith.engines.server import ServerSpec, Supervisor
spec = ServerSpec(name="prog", grace=3, command=lambda port: [sys.executable, {prog!r}, str(port), "0", "x"])
with Supervisor(spec, tag={tag!r}):
    print("READY", flush=True)
    time.sleep(600)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_a_killed_job_leaves_no_server_process(tmp_path, sig):
    prog = tmp_path / "program.py"
    prog.write_text(PROGRAM)
    tag = f"test-{os.getpid()}-{sig.name}"
    job = subprocess.Popen(
        [sys.executable, "-c", JOB.format(root=str(ROOT), prog=str(prog), tag=tag)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert job.stdout.readline().strip() == "READY"
        assert len(server_processes(tag)) == 3
        job.send_signal(sig)
        job.wait(timeout=30)
        deadline = time.monotonic() + 20
        while server_processes(tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server_processes(tag) == []
    finally:
        job.kill()
        for pid in server_processes(tag):
            os.kill(pid, signal.SIGKILL)


class Dying:
    """A supervisor whose process was just killed: connections are refused at once, but the
    process looks alive until `alive_for` seconds have passed (the kernel tears it down)."""

    def __init__(self, alive_for: float):
        self.spec = ServerSpec(name="prog", command=lambda port: [])
        self.url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        self.until = time.monotonic() + alive_for

    def alive(self) -> bool:
        return time.monotonic() < self.until


def test_a_server_killed_a_moment_ago_is_down_not_a_row_failure(tmp_path):
    # A CI run once failed here: the rows were retried against a killed server that still looked alive, and
    # their retries ran out before the restart
    t0 = time.monotonic()
    assert server_down(Dying(alive_for=1.5), grace=10)
    assert 1.4 < time.monotonic() - t0 < 5
    assert not server_down(Dying(alive_for=60), grace=1)  # a live process stays up (bounded)
    with Supervisor(spec(tmp_path), retries=0, log_stream=Log()) as sup:
        t0 = time.monotonic()
        assert not server_down(sup) and time.monotonic() - t0 < 2
        os.killpg(sup.server.proc.pid, signal.SIGKILL)
        assert server_down(sup)


def flaky_spec(tmp_path) -> ServerSpec:
    """PROGRAM behind a start that exits with code 3 the first time (as an out-of-memory kill
    while loading would), and serves from the second launch on."""
    prog = tmp_path / "program.py"
    prog.write_text(PROGRAM)
    first = tmp_path / "started-once"
    start = (
        "import os, sys\n"
        f"if not os.path.exists({str(first)!r}):\n"
        f"    open({str(first)!r}, 'w').close(); print('dying while loading'); sys.exit(3)\n"
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n"
    )
    return ServerSpec(
        name="prog",
        command=lambda port: [sys.executable, "-c", start, str(prog), str(port), "0", "never"],
        startup_timeout=30,
        grace=3,
    )


def test_a_server_that_exits_during_start_up_is_launched_again(tmp_path):
    log = Log()
    with Supervisor(flaky_spec(tmp_path), retries=1, log_stream=log) as sup:
        assert send(sup.url, 4) == 8
        stats = sup.stats()
    assert stats["server_launches"] == 2 and stats["server_restarts"] == 1, stats
    assert len(stats["server_startup_seconds"]) == 1  # the healthy launch's
    assert "[prog] dying while loading" in "\n".join(log.lines)


def test_start_up_failures_end_in_one_line_naming_the_server_and_its_log(tmp_path):
    with pytest.raises(ServerError) as err, Supervisor(flaky_spec(tmp_path), retries=0):
        pass
    line = err.value.one_line()
    assert err.value.kind == "exited" and "\n" not in line, line
    assert "prog server exited during start-up (exit code 3)" in line
    assert "[prog]" in line and "extra_args" in line  # where its output is, what to do
    assert "dying while loading" in str(err.value)  # the details keep the log's tail

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        fixed = spec(tmp_path, port=port, port_key="sglang.port")
        with pytest.raises(ServerError) as err, Supervisor(fixed, retries=2):
            pass
    line = err.value.one_line()
    assert err.value.kind == "port" and "\n" not in line and "sglang.port" in line, line


def test_the_command_line_ends_a_server_error_with_its_one_line_form(monkeypatch, capsys):
    import types

    from draftsmith import cli

    def main():
        raise ServerError("details\nmore lines", "sglang server exited; its log: x; do y")

    monkeypatch.setattr(
        cli.importlib, "import_module", lambda name: types.SimpleNamespace(main=main)
    )
    with pytest.raises(SystemExit) as done:
        cli.main(["regenerate"])
    assert done.value.code == "draftsmith regenerate: error: sglang server exited; its log: x; do y"
    assert "details\nmore lines" in capsys.readouterr().err
