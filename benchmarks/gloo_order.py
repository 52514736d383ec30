"""How gloo's all_reduce adds N ranks' partials on this CPU, against the ordered sum (rank order, float32).

Each rank's partial is a [T, 512] float32 tensor whose row 0 is the same at every T (ranks of odd index
scaled by 1000, so the order of the adds shows in the bits). Written: for each T, whether gloo's row 0 equals
its row 0 at T=1 (a row's bits independent of the message's size, i.e. of the batch), whether the ordered
sum's does, and whether gloo's row 0 equals the ordered sum's.

    python benchmarks/gloo_order.py 3 benchmarks/results/tp-cpu/gloo-order-3-ranks.txt
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from detent_audit.runtime.threads import set_threads

HIDDEN = 512
ROWS = (1, 2, 3, 5, 8, 16, 64)


def _partial(rank: int, rows: int) -> torch.Tensor:
    scale = 1000.0 if rank % 2 else 1.0
    p = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1000 * rows + rank)) * scale
    p[0] = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(7 + rank)) * scale
    return p


def run(rank: int, size: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=size)
    set_threads(1)
    rows0: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for t in ROWS:
        p = _partial(rank, t)
        parts = [torch.empty_like(p) for _ in range(size)]
        dist.all_gather(parts, p)
        summed = p.clone()
        dist.all_reduce(summed)
        ordered = parts[0].clone()
        for q in parts[1:]:
            ordered = ordered + q
        rows0[t] = (summed[0].clone(), ordered[0].clone())
    if rank == 0:
        gloo1, ordered1 = rows0[1]
        lines = [f"T={t}: gloo row 0 == gloo row 0 at T=1: {torch.equal(g, gloo1)} ({int((g != gloo1).sum())}"
                 f"/{HIDDEN} differ); ordered row 0 == ordered at T=1: {torch.equal(o, ordered1)}; gloo == "
                 f"ordered: {torch.equal(g, o)} ({int((g != o).sum())}/{HIDDEN} differ)"
                 for t, (g, o) in rows0.items()]
        with open(out, "w") as f:
            f.write(f"{size} ranks, gloo, torch {torch.__version__}\n" + "\n".join(lines) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    ranks, target = int(sys.argv[1]), sys.argv[2]
    init_file = os.path.abspath(f"{target}.init")
    if os.path.exists(init_file):
        os.remove(init_file)
    mp.spawn(run, args=(ranks, init_file, target), nprocs=ranks)
    if os.path.exists(init_file):  # gloo's file store may have removed it
        os.remove(init_file)
