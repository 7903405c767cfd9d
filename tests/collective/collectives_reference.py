"""PyTorch's own collectives on known inputs: the reference test_process_group.cpp compares with.

    /usr/bin/python3 collectives_reference.py OUT.json

Runs torch.distributed over Gloo at world size 3 (three forked processes). Each rank builds the
inputs below (the C++ test builds the same ones), runs each collective, and records its result,
flattened, as a list of numbers; a collective this PyTorch's Gloo lacks is recorded as the text
of its error instead. OUT.json: {"<rank>": {"<case>": [numbers] or "error text"}}. A case's
result on a rank where PyTorch leaves it unspecified (reduce, gather off the root) is omitted.
A test-only cross-check (Debian's python3-torch); nothing of ddp-cpp runs it in production.
"""
import datetime
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 3
ROOT = 1


def uneven(sender, receiver):
    """Rows that `sender` sends to `receiver` in the uneven all_to_all_single (some are 0)."""
    return (sender + receiver) % WORLD


def cases(rank):
    """name -> function running the collective and returning the result (None: unspecified)."""
    out = {}

    def reduce_case(op):
        def run():
            t = torch.arange(6, dtype=torch.float64) + 10 * rank
            dist.reduce(t, dst=ROOT, op=op)
            return t if rank == ROOT else None
        return run

    out["reduce_sum"] = reduce_case(dist.ReduceOp.SUM)
    out["reduce_max"] = reduce_case(dist.ReduceOp.MAX)
    out["reduce_min"] = reduce_case(dist.ReduceOp.MIN)

    def gather():
        t = torch.tensor([rank, rank * 100, -rank], dtype=torch.int64)
        outs = [torch.empty_like(t) for _ in range(WORLD)] if rank == ROOT else None
        dist.gather(t, gather_list=outs, dst=ROOT)
        return torch.cat(outs) if rank == ROOT else None
    out["gather"] = gather

    def scatter():
        t = torch.empty(4, dtype=torch.float32)
        ins = ([torch.arange(4, dtype=torch.float32) * (j + 1) + 0.5 for j in range(WORLD)]
               if rank == ROOT else None)
        dist.scatter(t, scatter_list=ins, src=ROOT)
        return t
    out["scatter"] = scatter

    def all_to_all_even():
        t = torch.arange(WORLD * 2, dtype=torch.float32) + 100 * rank
        o = torch.empty_like(t)
        dist.all_to_all_single(o, t)
        return o
    out["all_to_all_single"] = all_to_all_even

    def all_to_all_uneven():
        send = [uneven(rank, j) for j in range(WORLD)]
        recv = [uneven(i, rank) for i in range(WORLD)]
        t = torch.cat([rank * 1000 + j * 100 +
                       torch.arange(send[j] * 2, dtype=torch.float64).view(send[j], 2)
                       for j in range(WORLD)])
        o = torch.empty(sum(recv), 2, dtype=torch.float64)
        dist.all_to_all_single(o, t, output_split_sizes=recv, input_split_sizes=send)
        return o
    out["all_to_all_single_uneven"] = all_to_all_uneven

    def all_to_all_list():
        ins = [rank * 1000 + j * 100 + torch.arange((rank + 1) * (j + 1), dtype=torch.int32)
               for j in range(WORLD)]
        outs = [torch.empty((i + 1) * (rank + 1), dtype=torch.int32) for i in range(WORLD)]
        dist.all_to_all(outs, ins)
        return torch.cat(outs)
    out["all_to_all"] = all_to_all_list

    def all_gather_into_tensor():
        t = torch.arange(2, dtype=torch.float32) + rank
        o = torch.empty(WORLD * 2, dtype=torch.float32)
        dist.all_gather_into_tensor(o, t)
        return o
    out["all_gather_into_tensor"] = all_gather_into_tensor

    def reduce_scatter_tensor():
        t = torch.arange(WORLD * 2, dtype=torch.float32) + rank
        o = torch.empty(2, dtype=torch.float32)
        dist.reduce_scatter_tensor(o, t)
        return o
    out["reduce_scatter_tensor"] = reduce_scatter_tensor

    def send_recv():
        # A ring, two messages each way with two tags, received in the other order.
        nxt, prv = (rank + 1) % WORLD, (rank - 1) % WORLD
        a = torch.arange(3, dtype=torch.int64) + 10 * rank
        b = torch.arange(2, dtype=torch.float64) * 0.5 + rank
        sends = [dist.isend(a, nxt, tag=3), dist.isend(b, nxt, tag=5)]
        got_a = torch.empty(3, dtype=torch.int64)
        got_b = torch.empty(2, dtype=torch.float64)
        rb = dist.irecv(got_b, prv, tag=5)
        ra = dist.irecv(got_a, prv, tag=3)
        rb.wait()
        ra.wait()
        for w in sends:
            w.wait()
        return torch.cat([got_a.double(), got_b])
    out["send_recv"] = send_recv
    return out


def worker(rank, init_file, parts):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    results = {}
    for name, run in cases(rank).items():
        try:
            value = run()
        except Exception as e:  # this PyTorch's Gloo lacks it: recorded, not fatal
            results[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
            dist.barrier()  # a rank that failed before sending leaves no peer half-way
            continue
        if value is not None:
            results[name] = value.flatten().tolist()
    with open(parts[rank], "w") as f:
        json.dump(results, f)
    # Out without tearing down (powersgd_reference.py says why: Gloo's destructor and the GIL).
    dist.barrier()
    os._exit(0)


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        parts = [os.path.join(tmp, f"rank{r}.json") for r in range(WORLD)]
        mp.start_processes(worker, args=(os.path.join(tmp, "init"), parts), nprocs=WORLD,
                           start_method="fork")
        merged = {str(r): json.load(open(p)) for r, p in enumerate(parts)}
    with open(sys.argv[1], "w") as f:
        json.dump(merged, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
