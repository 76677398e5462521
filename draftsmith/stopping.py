"""Stop within seconds on Ctrl-C or SIGTERM, whatever is computing, and lose nothing.

Two halves:

- **In a job** (`stop_promptly`, called first thing by the in-process stages: training and the
  hf engine's regeneration, capture and benchmark). Python runs its signal handlers only between
  bytecodes, so a KeyboardInterrupt waits for the torch op in flight, and a bf16 matmul on a CPU
  without native bf16 can take tens of seconds. Here SIGINT and SIGTERM are blocked in the main
  thread (and so in every thread it starts later: torch's OpenMP pool, tqdm's monitor) and a
  watcher thread waits for them (`sigtimedwait`); torch ops release the GIL, so the watcher runs
  at once, logs what it stopped, runs the stage's callbacks (nothing slow) and ends the process
  with `os._exit(128 + signal)`. That is safe because every output is written to a temporary
  path and renamed into place (docs/output.md): a process that ends mid-write leaves only a
  temporary that the next run removes, never a half-written shard, checkpoint or draft.
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
    Enter it before torch starts any thread. On leaving, the watcher stops and the signal mask
    is restored (a test may call a stage's main in its own process).
    """
    log = logging.getLogger(name)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            info = signal.sigtimedwait(STOP_SIGNALS, 0.25)
            if info is not None:
                stop_now(log, name, info.si_signo, on_stop)

    watcher = threading.Thread(target=watch, name="stop-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


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
