"""Stop within seconds on Ctrl-C or SIGTERM, whatever is computing, and lose nothing.

Two halves:

- **In a job** (`stop_promptly`, entered by the in-process stages: training and the hf
  engine's regeneration, capture and benchmark). Python runs its signal handlers only between
  bytecodes of the main thread, so a KeyboardInterrupt waits for the torch op in flight, and a
  bf16 matmul on a CPU without native bf16 can take tens of seconds. Here the C-level handler
  (whichever thread the kernel picks, torch's OpenMP workers included) writes the signal's
  number to a wakeup pipe (`signal.set_wakeup_fd`), and a watcher thread blocked on that pipe
  wakes at once (torch ops release the GIL), logs what it stopped, runs the stage's callback
  (nothing slow) and ends the process with `os._exit(128 + signal)`. That is safe because every
  output is written to a temporary path and renamed into place (docs/output.md): a process that
  ends mid-write leaves only a temporary that the next run removes, never a half-written shard,
  checkpoint or draft.
- **In the snakemake process** (`forward_stop_signals`, the Snakefile's `onstart`). Snakemake's
  own SIGTERM handler is "graceful": it starts nothing new but waits for the running jobs, which
  can be hours of training. The handler installed here first sends SIGTERM to every process
  below snakemake (jobs, their servers, in whatever process group), then calls Snakemake's own
  handler, which then finds its jobs failed, removes their incomplete outputs and exits. A
  terminal's Ctrl-C reaches the jobs of the foreground group directly; forwarding it as well
  covers a SIGINT sent to snakemake's PID only. On a cluster the jobs are not descendants and
  Snakemake's executor plugin cancels them as before.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_promptly(name: str, on_stop: Callable[[str], None] | None = None) -> Iterator[None]:
    """Inside the block, SIGINT/SIGTERM end this process within a second (module doc).

    `on_stop(signal_name)` runs in the watcher before the exit (say where a rerun resumes).
    Call it from the main thread. On leaving, the handlers and the wakeup fd are restored and
    the watcher stops (a test may call a stage's main in its own process).
    """
    log = logging.getLogger(name)
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = {sig: signal.signal(sig, _note) for sig in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            data = os.read(read_fd, 1)
            if not data or data[0] == 0:  # closed, or the sentinel: the block has ended
                return
            if data[0] in STOP_SIGNALS:
                stop_now(log, name, data[0], on_stop)

    watcher = threading.Thread(target=watch, name="stop-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.write(write_fd, b"\0")
        watcher.join()
        os.close(read_fd)
        os.close(write_fd)


def _note(signo, frame) -> None:
    """The Python-level handler: nothing (the watcher acts on the wakeup fd's byte)."""


def stop_now(log, name: str, signo: int, on_stop) -> None:
    sig = signal.Signals(signo).name
    log.warning("%s: stopping at once (%s); outputs are written atomically", name, sig)
    try:
        if on_stop is not None:
            on_stop(sig)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        logging.shutdown()
        os._exit(128 + signo)


def terminate_descendants(sig: int = signal.SIGTERM) -> int:
    """Send `sig` to every process below this one; returns how many were signalled."""
    import psutil  # a dependency of snakemake; only the snakemake process calls this

    sent = 0
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for child in children:
        try:
            child.send_signal(sig)
            sent += 1
        except psutil.Error:
            pass
    return sent


def forward_stop_signals() -> None:
    """In the snakemake process: on SIGTERM or SIGINT, SIGTERM every descendant first, then
    run the handler that was there (Snakemake's graceful stop, Python's KeyboardInterrupt)."""
    for sig in STOP_SIGNALS:
        previous = signal.getsignal(sig)

        def handler(signo, frame, previous=previous):
            n = terminate_descendants()
            print(
                f"draftsmith: {signal.Signals(signo).name}: sent SIGTERM to {n} job process(es)",
                file=sys.stderr,
                flush=True,
            )
            if callable(previous):
                previous(signo, frame)
            elif previous == signal.SIG_DFL:
                raise SystemExit(128 + signo)

        signal.signal(sig, handler)
