"""Who holds a TCP port on this machine: a job only talks to a server it started.

- `check_free(port)`: before a launch on a fixed port (a server engine's port setting), refuse a port that is
  taken, naming it and the process listening there (pid and command line, when visible).
- `listeners(port)`: the pids with a listening socket on `port` (Linux: /proc/net/tcp{,6}, then
  each process's fds). `draftsmith.engines.server.Server.wait_ready` accepts a health answer only when a
  listener belongs to the process group it launched, so a foreign server that took the port
  (another job with the same fixed port, or a race on a free one) is an error, not a peer.
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path

LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


class PortTaken(RuntimeError):
    """A fixed port that something else already listens on."""


def _listen_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f[9])
    return inodes


def listening(port: int) -> bool:
    """Whether any socket (of any user) listens on `port`."""
    return bool(_listen_inodes(port))


def listeners(port: int) -> set[int]:
    """Pids of the processes (visible to this user) with a socket listening on `port`."""
    inodes = {f"socket:[{i}]" for i in _listen_inodes(port)}
    pids: set[int] = set()
    if not inodes:
        return pids
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in inodes:
                    pids.add(int(proc.name))
                    break
            except OSError:
                continue
    return pids


def describe(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        cmd = "?"
    return f"pid {pid} ({' '.join(cmd.split())[:200]})"


def holder(port: int) -> str:
    pids = sorted(listeners(port))
    if not pids:
        return "a process this user cannot see"
    return ", ".join(describe(p) for p in pids)


def check_free(port: int, host: str = "127.0.0.1", key: str = "the server's port setting") -> None:
    """Raise PortTaken (naming the port and its holder) unless `port` can be bound now; `key`
    names the setting the port came from."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            raise PortTaken(
                f"port {port} on {host} is already in use by {holder(port)}: this job starts its "
                f"own server and talks only to it. Stop that process, pick another port "
                f"({key}), or set {key}: 0 for a free port at each launch"
            ) from None


def in_group(pids: set[int], pgid: int) -> set[int]:
    """The pids of `pids` whose process group is `pgid`."""
    out = set()
    for pid in pids:
        try:
            if os.getpgid(pid) == pgid:
                out.add(pid)
        except OSError:
            continue
    return out
