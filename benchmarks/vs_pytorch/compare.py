#!/usr/bin/env python3
"""Our DDP against PyTorch's, side by side, on identical work; the median ratio per model.

    benchmarks/vs_pytorch/compare.py                       # 5 pairs, 200 steps after 20 warm-up
    benchmarks/vs_pytorch/compare.py --pairs 1 --steps 20  # a quick check that it all runs
    benchmarks/vs_pytorch/compare.py --fsdp zero3          # our FSDP against PyTorch's (2.x)

The work (the README's comparison): the classic CNN and the 784-1024-1024-10 MLP on
Fashion-MNIST, global batch 128 over 2 ranks (64 each), SGD with momentum 0.9, 1 intra-op
thread per rank (OMP_NUM_THREADS=1), the same number of warm-up and timed steps.
  ours:   ddprun --standalone --nproc-per-node 2 ddp-bench train --backend B ...  (B per --backends)
  theirs: /usr/bin/python3 torch_ddp.py --nproc 2 ...  (python3-torch, DDP over Gloo)
  ceiling: ddprun ... ddp-bench train --no-ddp  (the same 2 ranks, each training alone on its
           shard, no gradient exchange: what any data-parallel training could reach here)
--device cuda runs both sides (and the ceiling) on the GPU, cuda:LOCAL_RANK, PyTorch over NCCL;
with --nproc 1 --backends auto it is DDP at world size 1 against PyTorch's, and the ceiling is
training without DDP (so each side's share of it is 1 / its DDP overhead).
--fsdp zero2|zero3 compares FSDP instead of DDP: ours is `ddp-bench train --fsdp`, theirs
`torch_ddp.py --fsdp` (FSDP1's FullyShardedDataParallel, SHARD_GRAD_OP / FULL_SHARD, a unit per
Linear/Conv2d layer as ours; --fsdp-api fully_shard for FSDP2, which PyTorch 2.6 does not run on
the CPU); the ceiling stays the same. It needs PyTorch 2.x (the trixie root's 2.6:
scripts/test-libtorch2.sh --shell env USE_LIBUV=0 python3 ... --build-dir /var/build/ddp-cpp).
Runs alternate (ours with each backend, then theirs, then the ceiling, for each model, --pairs
times), each in fresh processes, so drift on a shared machine hits every side alike. Reported
per model: the median samples/s of each side, the ratio of medians ours/PyTorch, the median of
the per-pair ratios, and each DDP's share of the ceiling (so a ratio can be read against the
most it could be). A run that fails (a backend this build lacks) is reported, not fatal.
Python 3 standard library only.
"""
import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def find_tool(build_dir, relative, name):
    path = os.path.join(build_dir, relative)
    if os.path.exists(path):
        return path
    found = shutil.which(name)
    if found:
        return found
    sys.exit(f"compare.py: {name} not found at {path} nor on PATH; build it "
             f"(DDP_BUILD_DIR={build_dir} scripts/build.sh --target ddprun {name}) or pass "
             f"--build-dir")


def run(cmd, timeout):
    """Runs `cmd` with 1 thread per process; returns (samples/s row or None, error text, stdout)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out_csv = os.path.join(tmp, "row.csv")
        cmd = cmd + ["--csv", out_csv]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout} s: {' '.join(cmd)}", ""
        if p.returncode != 0 or not os.path.exists(out_csv):
            tail = "\n".join((p.stdout + p.stderr).strip().splitlines()[-6:])
            return None, f"exit code {p.returncode}: {' '.join(cmd)}\n{tail}", p.stdout
        with open(out_csv) as f:
            rows = list(csv.DictReader(f))
        return rows[-1], "", p.stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=5, help="alternating rounds (ours, theirs)")
    p.add_argument("--steps", type=int, default=200, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps before them")
    p.add_argument("--models", default="classic-cnn,mlp-1024")
    p.add_argument("--backends", default="gloo,shm",
                   help="our side's backends, comma-separated (gloo, shm, auto)")
    p.add_argument("--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run")
    p.add_argument("--ours", choices=["ddp-bench", "user-program"], default="ddp-bench",
                   help="our side: ddp-bench train (instrumented), or benchmarks/user_program "
                        "(a program written as the README teaches: what a user's program gets "
                        "by default; --backends then only names the label)")
    p.add_argument("--build-dir", default=os.environ.get("DDP_BUILD_DIR",
                                                         os.path.join(ROOT, "build")))
    p.add_argument("--python", default="/usr/bin/python3", help="the python with torch")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP's gradient_as_bucket_view on both sides: ddp-bench's flag and "
                        "PyTorch's (user-program sets it either way, as the README's example)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where both sides train (cuda: PyTorch over NCCL, ours on its auto "
                   "backend, cpu:shm,cuda:nccl on a GPU, or the one named)")
    p.add_argument("--fsdp", choices=["zero2", "zero3"], default="",
                   help="FSDP instead of DDP on both sides: ddp-bench train --fsdp, and PyTorch's "
                        "FSDP (torch_ddp.py --fsdp; PyTorch 2.x)")
    p.add_argument("--fsdp-api", choices=["fsdp1", "fully_shard"], default="fsdp1",
                   help="with --fsdp, PyTorch's side: FSDP1's FullyShardedDataParallel, or "
                        "FSDP2's fully_shard (not on the CPU in PyTorch 2.6)")
    p.add_argument("--data-dir", default="", help="Fashion-MNIST folder (default: Debian's)")
    p.add_argument("--csv", default="vs_pytorch.csv", help="every run, one row each")
    p.add_argument("--summary-csv", default="", help="medians and ratios (default: "
                   "<csv>_summary.csv)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--no-ceiling", action="store_true",
                   help="skip the communication-free ceiling runs")
    a = p.parse_args()
    if a.fsdp and (a.ours == "user-program" or a.gradient_as_bucket_view):
        p.error("--fsdp takes neither --ours user-program nor --gradient-as-bucket-view")
    models = [m for m in a.models.split(",") if m]
    backends = [b for b in a.backends.split(",") if b]
    ddprun = find_tool(a.build_dir, "tools/ddprun/ddprun", "ddprun")
    bench = find_tool(a.build_dir, "tools/ddp_bench/ddp-bench", "ddp-bench")
    common = ["--batch-size", str(a.batch_size), "--steps", str(a.steps),
              "--warmup", str(a.warmup), "--device", a.device]
    if a.data_dir:
        common += ["--data-dir", a.data_dir]
    view = ["--gradient-as-bucket-view"] if a.gradient_as_bucket_view else []
    ours_fsdp = ["--fsdp", a.fsdp] if a.fsdp else []
    theirs_fsdp = ["--fsdp", a.fsdp, "--fsdp-api", a.fsdp_api] if a.fsdp else []
    ours_cmd = lambda model, backend: [
        ddprun, "--standalone", "--nproc-per-node", str(a.nproc), bench, "train",
        "--model", model, "--threads", "1", "--backend", backend, "--label", f"ours-{backend}"
    ] + view + ours_fsdp + common
    if a.ours == "user-program":
        user_program = find_tool(a.build_dir, "benchmarks/user_program", "user_program")
        ours_cmd = lambda model, backend: [
            ddprun, "--standalone", "--nproc-per-node", str(a.nproc), user_program,
            "--model", model, "--label", f"ours-{backend}"] + common
    ceiling_cmd = lambda model: [
        ddprun, "--standalone", "--nproc-per-node", str(a.nproc), bench, "train",
        "--model", model, "--threads", "1", "--no-ddp", "--label", "ceiling"] + common
    theirs_cmd = lambda model: [
        a.python, os.path.join(HERE, "torch_ddp.py"), "--nproc", str(a.nproc), "--model", model,
        "--threads", "1", "--label", "pytorch"] + view + theirs_fsdp + common

    print(f"# vs_pytorch: {', '.join(models)}; global batch {a.batch_size} over {a.nproc} "
          f"ranks x 1 thread on {a.device}; {a.steps} steps after {a.warmup} warm-up; {a.pairs} alternating "
          f"pair(s); ours on {', '.join(backends)}", flush=True)
    if a.fsdp:
        print(f"# FSDP ({a.fsdp}) on both sides instead of DDP: ours ddp-bench train --fsdp "
              f"{a.fsdp}, PyTorch's torch_ddp.py --fsdp {a.fsdp} --fsdp-api {a.fsdp_api}",
              flush=True)
    runs = []  # dicts: pair, model, side, samples_per_s (None when failed)
    errors = {}
    said = set()  # models whose PyTorch line (version, API, loss) is printed
    for pair in range(a.pairs):
        for model in models:
            jobs = [(f"ours-{b}", ours_cmd(model, b)) for b in backends]
            jobs.append(("pytorch", theirs_cmd(model)))
            if not a.no_ceiling:
                jobs.append(("ceiling", ceiling_cmd(model)))
            for side, cmd in jobs:
                row, err, out = run(cmd, a.timeout)
                if a.fsdp and side == "pytorch" and row and model not in said:
                    said.add(model)
                    print("  " + " ".join(l for l in out.splitlines() if l.startswith("# pytorch")),
                          flush=True)
                sps = float(row["samples_per_s"]) if row else None
                runs.append(dict(pair=pair + 1, model=model, side=side, samples_per_s=sps,
                                 step_ms=float(row["step_ms"]) if row else None))
                if a.fsdp and side != "ceiling":
                    runs[-1]["fsdp"] = a.fsdp
                if err:
                    errors.setdefault((model, side), err)
                print(f"  pair {pair + 1}/{a.pairs} {model:<12} {side:<12} "
                      + (f"{sps:9.1f} samples/s" if sps else "FAILED"), flush=True)

    with open(a.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["pair", "model", "side", "samples_per_s", "step_ms"]
                           + (["fsdp"] if a.fsdp else []), restval="")
        w.writeheader()
        w.writerows(runs)

    def values(model, side):
        return [r["samples_per_s"] for r in runs
                if r["model"] == model and r["side"] == side and r["samples_per_s"]]

    summary = []
    print("#\n# medians (samples/s); ratio = ours / PyTorch: of the medians, and the median "
          "of the per-pair ratios")
    print(f"  {'model':<12} {'ours':<10} {'ours':>10} {'pytorch':>10} {'ratio':>7} "
          f"{'pair ratio':>11}  runs")
    for model in models:
        theirs = values(model, "pytorch")
        for b in backends:
            side = f"ours-{b}"
            ours = values(model, side)
            pairs = {}
            for r in runs:
                if r["model"] == model and r["samples_per_s"]:
                    pairs.setdefault(r["pair"], {})[r["side"]] = r["samples_per_s"]
            pair_ratios = [v[side] / v["pytorch"] for v in pairs.values()
                           if side in v and "pytorch" in v]
            if ours and theirs:
                mo, mt = statistics.median(ours), statistics.median(theirs)
                rec = dict(model=model, backend=b, ours_samples_per_s=round(mo, 2),
                           pytorch_samples_per_s=round(mt, 2), ratio=round(mo / mt, 4),
                           median_pair_ratio=round(statistics.median(pair_ratios), 4),
                           runs=len(ours))
                print(f"  {model:<12} {b:<10} {mo:>10.1f} {mt:>10.1f} {mo / mt:>6.2f}x "
                      f"{rec['median_pair_ratio']:>10.2f}x  {len(ours)}")
            else:
                rec = dict(model=model, backend=b, ours_samples_per_s="",
                           pytorch_samples_per_s=round(statistics.median(theirs), 2)
                           if theirs else "", ratio="", median_pair_ratio="", runs=len(ours))
                mt = f"{statistics.median(theirs):.1f}" if theirs else "n/a"
                print(f"  {model:<12} {b:<10} {'n/a':>10} {mt:>10} {'-':>7} {'-':>11}  0")
            if a.fsdp:
                rec["fsdp"] = a.fsdp
            summary.append(rec)
    if not a.no_ceiling:
        print("#\n# the ceiling: the same ranks training alone, no gradient exchange "
              f"(samples/s); each {'FSDP' if a.fsdp else 'DDP'}'s share of it")
        for model in models:
            ceil = values(model, "ceiling")
            if not ceil:
                print(f"  {model:<12} ceiling n/a")
                continue
            mc = statistics.median(ceil)
            shares = []
            for side in [f"ours-{b}" for b in backends] + ["pytorch"]:
                v = values(model, side)
                if v:
                    shares.append(f"{side} {100 * statistics.median(v) / mc:.1f}%")
            theirs = values(model, "pytorch")
            best = f"; ceiling / pytorch = {mc / statistics.median(theirs):.2f}x" if theirs else ""
            print(f"  {model:<12} ceiling {mc:9.1f}: " + ", ".join(shares) + best)
            for rec in summary:
                if rec["model"] == model:
                    rec["ceiling_samples_per_s"] = round(mc, 2)
    for (model, side), err in errors.items():
        print(f"# {model} {side} failed: {err}")
    summary_csv = a.summary_csv or os.path.splitext(a.csv)[0] + "_summary.csv"
    with open(summary_csv, "w", newline="") as f:
        fields = list(dict.fromkeys(k for rec in summary for k in rec))
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(summary)
    print(f"# csv: {a.csv} (every run), {summary_csv} (medians and ratios)")
    # Success when every model has a ratio for at least one of our backends.
    return 0 if all(any(r["ratio"] != "" for r in summary if r["model"] == m)
                    for m in models) else 1


if __name__ == "__main__":
    sys.exit(main())
