"""A job only talks to a server it started. A stand-in foreign server (it
answers 200 on every path, as a healthy SGLang would) holds the port; the supervisor must not
take it for its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest
from test_server import Log, spec

from draftsmith.engines.server import ServerError, ServerSpec, Supervisor, free_port
from draftsmith.runtime.ports import PortTaken, check_free, listeners

FOREIGN = textwrap.dedent(
    """
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def start_foreign(port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", FOREIGN, str(port)])
    for _ in range(100):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the foreign server did not come up")


@pytest.fixture
def foreign():
    port = free_port()
    proc = start_foreign(port)
    yield port, proc
    proc.kill()
    proc.wait()


def test_listeners_finds_the_process_on_the_port(foreign):
    port, proc = foreign
    assert listeners(port) == {proc.pid}
    with pytest.raises(PortTaken, match=rf"port {port} .* in use by pid {proc.pid} \("):
        check_free(port)
    check_free(free_port())  # a free one passes


def test_a_taken_fixed_port_is_an_error_naming_the_port_and_its_holder(foreign, tmp_path):
    port, proc = foreign
    with (
        pytest.raises(ServerError, match=rf"port {port} .*pid {proc.pid} \(.*-c"),
        Supervisor(spec(tmp_path, port=port), retries=0, log_stream=Log()),
    ):
        pytest.fail("the supervisor took the foreign server for its own")
    assert proc.poll() is None  # the foreign server was left alone


def test_a_health_answer_from_another_process_is_refused(tmp_path):
    """The free port is taken by someone else between the choice and the bind (the race of two
    jobs): our process never listens, the foreign one answers /health. Not ours: an error."""
    started = []

    def command(port):
        started.append(start_foreign(port))
        return [sys.executable, "-c", "import time; time.sleep(60)"]

    bad = ServerSpec(name="prog", command=command, startup_timeout=20, grace=1)
    try:
        with (
            pytest.raises(ServerError, match=r"answered, but from pid \d+ .*not from the server"),
            Supervisor(bad, retries=0, log_stream=Log()),
        ):
            pytest.fail("the supervisor took the foreign server for its own")
    finally:
        for p in started:
            p.kill()
            p.wait()


def test_our_own_server_on_a_fixed_free_port_still_works(tmp_path):
    port = free_port()
    with Supervisor(spec(tmp_path, port=port), retries=0, log_stream=Log()) as sup:
        assert sup.url.endswith(f":{port}")
        assert os.getpgid(next(iter(listeners(port)))) != os.getpgid(0)
