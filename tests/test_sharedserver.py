"""One server for the jobs of a run (draftsmith.engines.sharedserver): leases share one launch, the
host stops the server after the run's last capture, after the idle timeout, when the run's
Snakemake process is gone (kill -9 included) or when the host itself is killed, and relaunches
a server that died; Snakemake's own service() cannot express segment mode's order.

The managed process is test_server.py's standard-library HTTP program (with a worker child);
the real SGLang capture server through a shared host: tests/test_workflow_segments_sglang.py.
Fast suite: 9 tests, 39-46 s measured on 2 cores shared with other work (load average 3-5).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_server import PROGRAM

from draftsmith.engines.server import ServerError, ServerSpec, http_json, server_processes
from draftsmith.engines.sharedserver import SCRATCH, SharedServer, pid_alive, spec_key

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def owner(monkeypatch):
    """A stand-in for the run's Snakemake process: the host follows it (draftsmith.runtime.lifeline)."""
    proc = subprocess.Popen(["sleep", "600"])
    monkeypatch.setenv("DRAFTSMITH_JOB_PARENT", str(proc.pid))
    yield proc
    proc.kill()
    proc.wait()


def spec(tmp_path: Path) -> ServerSpec:
    prog = tmp_path / "program.py"
    prog.write_text(PROGRAM)
    return ServerSpec(
        name="prog",
        command=lambda port: [sys.executable, str(prog), str(port), "0", "never"],
        env={"PROG_SCRATCH": SCRATCH},
        startup_timeout=30,
        grace=3,
    )


def lease(tmp_path: Path, owner, **kw) -> SharedServer:
    kw.setdefault("idle_timeout", 60)
    kw.setdefault("retries", 1)
    return SharedServer(spec(tmp_path), tmp_path / "servers", owner=owner.pid, **kw)


def gone(host_pid: int, timeout: float = 30) -> bool:
    """Whether the host and every process of its server end within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not pid_alive(host_pid) and not server_processes(f"{host_pid}-"):
            return True
        time.sleep(0.2)
    return False


def cleanup(host_pid: int) -> None:
    for pid in [host_pid, *server_processes(f"{host_pid}-")]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def double(url: str, x: int) -> int:
    return http_json(f"{url}/double", {"x": x}, timeout=30)["y"]


def test_leases_share_one_launch_and_the_last_capture_stops_it(tmp_path, owner):
    with lease(tmp_path, owner) as a:
        host = a.info["host_pid"]
        try:
            assert a.started_host and double(a.url, 2) == 4
            assert Path(a.scratch).is_dir() and str(a.scratch) != SCRATCH
            assert len(server_processes(f"{host}-")) == 3  # guard, program, its worker
            with lease(tmp_path, owner) as b:  # a second job at the same time
                assert b.info["host_pid"] == host and not b.started_host
                assert b.url == a.url and double(b.url, 3) == 6
        except BaseException:
            cleanup(host)
            raise
    time.sleep(2)  # no lease now, but no last capture either: the host waits
    assert pid_alive(host)
    with lease(tmp_path, owner, last=True) as c:
        assert c.info["host_pid"] == host and c.stats()["server_launches"] == 1
        assert c.stats()["server_started_by_this_job"] is False
    assert gone(host, 15), "the last capture's lease ended: the host must stop"
    assert not Path(a.scratch).exists()
    info = json.loads((a.dir / "host.json").read_text())
    assert info["state"] == "stopped" and "last capture" in info["error"]


def test_idle_timeout_stops_the_host(tmp_path, owner):
    with lease(tmp_path, owner, idle_timeout=1) as a:
        host = a.info["host_pid"]
    assert gone(host, 15)
    # the next capture of the run starts a new host
    with lease(tmp_path, owner, idle_timeout=1) as b:
        assert b.started_host and b.info["host_pid"] != host
    assert gone(b.info["host_pid"], 15)


@pytest.mark.parametrize("who", ["run", "host"])
def test_a_killed_run_or_host_leaves_no_process(tmp_path, owner, who):
    """kill -9 of the run's Snakemake process (the lifeline stops the host, which stops the
    server's group) or of the host itself (the guard's parent-death signal)."""
    with lease(tmp_path, owner) as a:
        host = a.info["host_pid"]
    try:
        os.kill(owner.pid if who == "run" else host, signal.SIGKILL)
        assert gone(host, 30), f"processes left: {server_processes(f'{host}-')}"
    finally:
        cleanup(host)


def test_a_dead_server_is_relaunched_for_the_lease(tmp_path, owner):
    with lease(tmp_path, owner) as a:
        host = a.info["host_pid"]
        try:
            os.killpg(a.info["server_pid"], signal.SIGKILL)
            deadline = time.monotonic() + 10
            while a.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not a.alive()
            a.restart("test")
            assert a.alive() and double(a.url, 5) == 10
            assert a.stats()["server_launches"] == 2 and a.stats()["server_restarts"] == 1
        finally:
            cleanup(host)


def test_a_host_serves_only_its_own_run(tmp_path, owner):
    """A host belongs to one run: a job of another run (another Snakemake pid) starts its own."""
    other = subprocess.Popen(["sleep", "600"])
    try:
        with lease(tmp_path, owner) as a:
            host = a.info["host_pid"]
            b = SharedServer(spec(tmp_path), tmp_path / "servers", owner=other.pid,
                             idle_timeout=60, retries=0)  # fmt: skip
            assert not b._usable(json.loads((a.dir / "host.json").read_text()))
    finally:
        other.kill()
        cleanup(host)


TOY = """
rule all:
    input: "train/3.done"

rule server:
    output: service("server.sock")
    shell: "touch {output}; sleep 600"

rule capture:  # index i waits for the training of i - 2, as segment_capture does
    input: "server.sock", lambda w: [f"train/{int(w.i) - 2}.done"] if int(w.i) >= 2 else []
    output: "cap/{i}.done"
    shell: "touch {output}"

rule train:
    input: "cap/{i}.done", lambda w: [f"train/{int(w.i) - 1}.done"] if int(w.i) >= 1 else []
    output: "train/{i}.done"
    shell: "touch {output}"
"""


def test_snakemake_service_cannot_express_the_segment_order(tmp_path):
    """Why draftsmith.engines.sharedserver exists: a service() output joins its consumers into one
    group, and the capture of index i waiting for the training of i - 2 leaves that group and
    comes back into it, which Snakemake refuses (docs/scale.md)."""
    (tmp_path / "Snakefile").write_text(TOY)
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-2000:]
    assert "depends on rule(s) train from outside the group" in out, out[-2000:]


def test_a_server_that_cannot_start_fails_the_lease_with_its_log(tmp_path, owner):
    bad = ServerSpec(
        name="prog",
        command=lambda port: [sys.executable, "-c", "print('error: unknown flag --nope'); exit(3)"],
        startup_timeout=30,
    )
    t0 = time.monotonic()
    with pytest.raises(ServerError, match="unknown flag --nope"):
        with SharedServer(bad, tmp_path / "servers", owner=owner.pid, idle_timeout=60, retries=0):
            pass
    assert time.monotonic() - t0 < 25  # at once, not after the start-up timeout


def test_one_key_for_the_jobs_of_a_run_another_for_other_settings(tmp_path):
    """The jobs of one run differ in their own environment (OMP_WAIT_POLICY chosen for the
    load each started under, draftsmith.runtime.threads): one server still; other flags: another."""
    a, b, c = spec(tmp_path), spec(tmp_path), spec(tmp_path)
    a.env = {**a.env, "OMP_WAIT_POLICY": "PASSIVE"}
    c.command = lambda port: [sys.executable, "-c", "pass", str(port)]
    assert spec_key(a) == spec_key(b) != spec_key(c)


def other_spec(tmp_path: Path) -> ServerSpec:
    """The same program under another argv: another key, as another stage's server is."""
    s = spec(tmp_path)
    base = s.command
    s.command = lambda port: [*base(port), "other-stage"]
    return s


def test_an_idle_server_holding_gpus_is_stopped_before_other_gpu_work(tmp_path, owner):
    """A host whose server holds GPUs is stopped (and waited for) when another stage's job with
    GPUs attaches, or when training starts (release_gpu_hosts); never while a job leases it;
    a CPU host only when training starts (gpus_only False)."""
    from draftsmith.runtime.serverhosts import release_gpu_hosts

    root = tmp_path / "servers"
    with lease(tmp_path, owner, gpus=2) as a:
        host = a.info["host_pid"]
        try:
            assert json.loads((a.dir / "host.json").read_text())["gpus"] == 2
            assert release_gpu_hosts(root, owner.pid) == []  # leased: its GPUs are counted
        except BaseException:
            cleanup(host)
            raise
    assert pid_alive(host)  # idle, holding GPUs Snakemake no longer counts
    other = SharedServer(other_spec(tmp_path), root, owner=owner.pid, idle_timeout=60,
                         retries=1, gpus=2)  # fmt: skip
    with other as b:
        assert gone(host, 5), "an idle GPU server must be gone before another one starts"
        assert json.loads((a.dir / "host.json").read_text())["state"] == "stopped"
        second = b.info["host_pid"]
    try:
        with lease(tmp_path, owner) as c:  # a CPU server of the first key: started again
            cpu_host = c.info["host_pid"]
        assert release_gpu_hosts(root, owner.pid) == [b.dir.name]  # training with GPUs
        assert gone(second, 5) and pid_alive(cpu_host)
        assert release_gpu_hosts(root, owner.pid, gpus_only=False) == [c.dir.name]
        assert gone(cpu_host, 5)
    finally:
        cleanup(second)


SERVICE_TOY = """
rule all:
    input: expand("out/{i}.txt", i=range(4))
rule serve:
    output: service("server.ready")
    threads: 1
    shell: "touch {output}; exec sleep 60"
rule consume:
    input: "server.ready"
    output: "out/{i}.txt"
    threads: 1
    shell: "echo {wildcards.i} > {output}"
"""


def test_snakemake_service_runs_every_range_job_of_a_stage_at_once(tmp_path):
    """Why the range jobs share a host of ours rather than a service() rule: Snakemake runs a
    service and all its consumers as one group, at once, with their threads summed, so a stage
    of more range jobs than the machine has cores cannot run locally at all (here 4 one-thread
    consumers and the server on 2 cores; a real stage has hundreds; docs/scale.md)."""
    (tmp_path / "Snakefile").write_text(SERVICE_TOY)
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-2000:]
    assert "Not enough resources were provided" in out, out[-2000:]
    assert not list(tmp_path.glob("out/*.txt"))  # no range job ran


def test_a_shared_server_that_exits_during_start_up_is_launched_again(tmp_path, owner):
    from test_server import flaky_spec

    shared = SharedServer(flaky_spec(tmp_path), tmp_path / "servers", owner=owner.pid,
                          idle_timeout=1, retries=1)  # fmt: skip
    with shared as a:
        assert double(a.url, 5) == 10
        host = a.info["host_pid"]
    assert "exited during start-up; relaunch 1" in (a.dir / "host.log").read_text()
    assert gone(host, 15)
    (tmp_path / "again").mkdir()
    retries0 = SharedServer(flaky_spec(tmp_path / "again"), tmp_path / "servers2",
                            owner=owner.pid, idle_timeout=1, retries=0)  # fmt: skip
    with pytest.raises(ServerError) as err, retries0:
        pass
    line = err.value.one_line()
    assert "\n" not in line and str(retries0.dir / "host.log") in line, line
