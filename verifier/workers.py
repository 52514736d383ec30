"""The verifier's worker processes, which never outlive it.

Each worker re-executes receipts with an engine of its own (a GB or more), so one left behind is costly. They
die with the verifier on every signal: when it is killed outright (SIGKILL), the kernel kills them (each asks
for it as it starts, Linux's `prctl(PR_SET_PDEATHSIG)`); on SIGTERM and SIGINT, the verifier ends them itself
before it exits (SIGTERM as an exit with status 143, SIGINT as KeyboardInterrupt). With no worker left, the
multiprocessing resource tracker sees its pipe close and exits too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from types import FrameType

PR_SET_PDEATHSIG = 1  # linux/prctl.h
JOIN_S = 5.0  # how long an ended worker is waited for before it is killed


def die_with_parent(parent_pid: int) -> None:
    """A worker's initializer: the kernel sends it SIGKILL when its parent ends; a worker whose parent has
    ended already (before the request took effect) exits at once."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


class Terminated(SystemExit):
    """SIGTERM arrived while workers ran: they are ended, and the verifier exits with 128 + SIGTERM."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise Terminated()


@contextmanager
def worker_pool(workers: int) -> Iterator[ProcessPoolExecutor]:
    """A pool of `workers` spawned processes (no fork of a process that holds torch's threads) that die with
    this one (module docstring). Leaving the block normally waits for the work submitted; leaving it by an
    exception (a signal's included) ends the workers first."""
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=die_with_parent, initargs=(os.getpid(),))
    previous = None
    if threading.current_thread() is threading.main_thread():  # handlers can only be set there
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield pool
    except BaseException:
        end_workers(pool)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def end_workers(pool: ProcessPoolExecutor) -> None:
    """Terminate every worker of `pool` (SIGTERM, then SIGKILL after `JOIN_S`), cancelling what is queued."""
    processes = list((getattr(pool, "_processes", None) or {}).values())  # the executor keeps no public list
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(JOIN_S)
        if process.is_alive():
            process.kill()
            process.join(JOIN_S)
