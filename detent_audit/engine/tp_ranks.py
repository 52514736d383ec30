"""Tensor-parallel ranks as processes: rank 0 drives, ranks 1..N-1 follow its steps.

Rank 0 is the engine the caller holds (scheduler, sampling, the server and the signing). `RankProcesses`
starts the other ranks (spawned processes, each building the same engine with its own rank), joins them in a
`torch.distributed` group (gloo on a CPU, NCCL on CUDA) and tears them down. `ProcessRanks` is the
`RankGroup` of one rank: the ordered all-reduce as an all-gather of the partials then `ordered_sum`, or the
backend's own `all_reduce` (stock). `DrivenModel` wraps rank 0's `TensorParallelLM`: before each forward and
each logits computation it sends the step's inputs to the followers, which run `follow` until told to stop.

Failure: a follower that dies breaks the group's connections, so rank 0's next collective raises; a watcher
thread also notices a dead follower between steps. Either way the engine raises `RankFailed` from then on, and
every rank is stopped (SIGTERM, then SIGKILL) when rank 0 closes or exits. A follower dies with rank 0
(`PR_SET_PDEATHSIG`, and its blocked receive fails when rank 0's connection closes).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from detent_audit.engine.tensor_parallel import BACKEND, ORDERED, TensorParallelLM, ordered_sum
from detent_audit.enums import ExitCode
from detent_audit.errors import DetentError

if TYPE_CHECKING:
    from detent_audit.kernels import Kernels
    from detent_audit.kernels.attention import AttentionMetadata

COLLECTIVE_TIMEOUT_S = 600   # a collective that waits longer than this fails (a hung rank)
START_TIMEOUT_S = 600        # the followers have this long to build their engines and join


class RankFailed(DetentError):
    """A tensor-parallel rank died or a collective failed: the engine cannot compute any more."""

    exit_code = ExitCode.MISMATCH


@dataclass(frozen=True)
class ProcessRanks:
    """This process's one rank of a `torch.distributed` group of `size`."""

    size: int
    rank: int
    algorithm: str = ORDERED

    @property
    def local_ranks(self) -> tuple[int, ...]:
        return (self.rank,)

    def all_reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        (mine,) = partials
        if self.algorithm == BACKEND:
            out = mine.contiguous().clone()
            dist.all_reduce(out)
            return out
        return ordered_sum(self.all_gather([mine]))

    def all_gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        (mine,) = parts
        mine = mine.contiguous()
        gathered = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(gathered, mine)
        return gathered

    def send(self, message: tuple[Any, ...]) -> None:
        """Rank 0: the next command to every follower."""
        dist.broadcast_object_list([message], src=0)

    def receive(self) -> tuple[Any, ...]:
        """A follower: rank 0's next command."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class DrivenModel(torch.nn.Module):
    """Rank 0's model: `TensorParallelLM`'s interface, with every step's inputs sent to the followers
    first."""

    def __init__(self, model: TensorParallelLM, group: ProcessRanks, alive: Callable[[], None]) -> None:
        super().__init__()
        self.inner, self.group, self.alive = model, group, alive
        self.config, self.embed_tokens, self.rope = model.config, model.embed_tokens, model.rope

    def new_kv_caches(self, num_blocks: int, block_size: int, device: torch.device | str) -> list:
        return self.inner.new_kv_caches(num_blocks, block_size, device)

    def gemm_shapes(self) -> list[tuple[int, int]]:
        return self.inner.gemm_shapes()

    def _collective(self, message: tuple[Any, ...], run: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.alive()
        try:
            self.group.send(message)
            return run()
        except RuntimeError as exc:  # gloo/NCCL: a peer closed its connection or timed out
            raise RankFailed(f"a tensor-parallel rank failed: {exc}",
                             remedy="restart the server; see the failed rank's log") from exc

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, ks: Kernels) -> torch.Tensor:
        return self._collective(("forward", input_ids, positions, meta),
                                lambda: self.inner(input_ids, positions, meta, kv_caches, ks))

    def compute_logits(self, hidden: torch.Tensor, ks: Kernels) -> torch.Tensor:
        return self._collective(("logits", hidden), lambda: self.inner.compute_logits(hidden, ks))


def follow(model: TensorParallelLM, group: ProcessRanks, kv_caches: list, ks: Kernels) -> None:
    """A follower's life: run each forward and logits computation rank 0 sends, until "stop"."""
    with torch.inference_mode():
        while True:
            message = group.receive()
            if message[0] == "stop":
                return
            if message[0] == "forward":
                _, input_ids, positions, meta = message
                model(input_ids, positions, meta, kv_caches, ks)
            elif message[0] == "logits":
                model.compute_logits(message[1], ks)
            else:
                raise RuntimeError(f"unknown command from rank 0: {message[0]!r}")


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent exits (rank 0 killed with SIGKILL leaves no follower)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def init_group(backend: str, init_method: str, rank: int, size: int) -> None:
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


def _follower_main(build: Callable[[int, str], None], rank: int, init_method: str) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when the group stops
    build(rank, init_method)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankProcesses:
    """Ranks 1..size-1 as spawned processes; each runs `build(rank, init_method)`, which builds its engine,
    joins the group (`init_group`) and runs `follow`. `build` must be picklable (a module-level function or a
    `functools.partial` of one)."""

    def __init__(self, size: int, build: Callable[[int, str], None]) -> None:
        self.size = size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.processes = [ctx.Process(target=_follower_main, args=(build, rank, self.init_method),
                                      name=f"detent-tp-rank{rank}", daemon=True) for rank in range(1, size)]
        for p in self.processes:
            p.start()
        self.failure: str | None = None
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="detent-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            for rank, p in enumerate(self.processes, start=1):
                if p.exitcode is not None:
                    self.failure = f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                    return

    def alive(self) -> None:
        """Raise `RankFailed` if a follower has died."""
        if self.failure is not None:
            raise RankFailed(self.failure, remedy="restart the server; see the failed rank's log")

    def close(self, group: ProcessRanks | None) -> None:
        """Stop every follower: "stop" if the group still works, then SIGTERM and SIGKILL for any left."""
        self._stop.set()
        if group is not None and self.failure is None:
            with contextlib.suppress(Exception):
                group.send(("stop",))
        for p in self.processes:
            p.join(timeout=10)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
