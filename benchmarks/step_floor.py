"""The floor under any trainer's step on this CPU: the matrix products and attention that
one rank of the peer benchmark's Llama (``torchtitan_peer.py``) must compute per step, and
nothing else, timed alone.

    python benchmarks/step_floor.py --shape large --procs 2
    python benchmarks/step_floor.py --shape small --procs 2 --peer benchmarks/results/torchtitan_peer_n2_small.json

Every trainer of that model computes these products on the same shapes: per layer the
fused QKV, the attention output, the SwiGLU up/gate and down projections, and the output
layer once; each forward GEMM ``x @ W^T`` has two backward GEMMs (``dY @ W`` for the input,
``dY^T @ x`` for the weight; the first layer's input gradient included, since the
embedding's gradient is a scatter of it), and causal SDPA runs forward and backward.
Nothing else is timed: no norms, activations, RoPE, loss, collectives, optimizer or Python.

``--procs N`` runs N copies at once, one thread each (``OMP_NUM_THREADS=1``), as the peer
benchmark's N ranks share the box; each copy reports the median of ``--reps`` repetitions,
the floor is the slowest copy's. With ``--peer`` the floor is set beside that JSON's median
steps: ``floor / torchtitan`` approximates the smallest step ratio a trainer doing this
arithmetic in fp32 on this box could reach against torchtitan. Approximates: the products
run here back to back, not between a step's other work, and this box's speed drifts by
tens of percent from minute to minute, so set the floor beside steps timed in the same
minutes (``torchtitan_peer.py --floor`` does, once per round).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))

# The peer benchmark's two Llama shapes (torchtitan_peer.py takes them from here; this file
# imports nothing of the trainer, so its copies run without loading it).
SHAPES = {
    "small": dict(dim=256, layers=6, heads=16, ffn=768, vocab=2048, seq=512),
    "large": dict(dim=512, layers=8, heads=8, ffn=1536, vocab=2048, seq=1024),
}
MICRO_BATCH = 2


def gemms(shape: dict) -> list:
    """(name, rows, in, out, count): the forward products ``[rows, in] @ [in, out]`` of one step."""
    t, d, f, v, n = MICRO_BATCH * shape["seq"], shape["dim"], shape["ffn"], shape["vocab"], shape["layers"]
    return [("qkv", t, d, 3 * d, n), ("attention out", t, d, d, n), ("up + gate", t, d, 2 * f, n),
            ("down", t, f, d, n), ("output layer", t, d, v, 1)]


def time_one(fn, reps: int) -> float:
    fn()  # warm-up (allocation, kernel selection)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shape_name: str, reps: int) -> dict:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    shape = SHAPES[shape_name]
    rows = {}
    for name, t, k, m, count in gemms(shape):
        x, w, dy = torch.randn(t, k), torch.randn(m, k), torch.randn(t, m)
        forward = time_one(lambda: torch.mm(x, w.t()), reps)
        backward = time_one(lambda: (torch.mm(dy, w), torch.mm(dy.t(), x)), reps)
        rows[name] = dict(forward_s=forward * count, backward_s=backward * count, count=count)
    heads, seq = shape["heads"], shape["seq"]
    q, k, v = (torch.randn(MICRO_BATCH, heads, seq, shape["dim"] // heads, requires_grad=True) for _ in range(3))
    forward = time_one(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), reps)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def both():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(o, (q, k, v), grad)

    backward = max(time_one(both, reps) - forward, 0.0)
    rows["causal SDPA"] = dict(forward_s=forward * shape["layers"], backward_s=backward * shape["layers"],
                               count=shape["layers"])
    total = sum(r["forward_s"] + r["backward_s"] for r in rows.values())
    return dict(shape=shape_name, threads=torch.get_num_threads(), rows=rows, floor_s=total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="large")
    parser.add_argument("--procs", type=int, default=2, help="copies run at once (the peer benchmark's ranks)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--peer", default=None, help="a torchtitan_peer JSON of the same shape to set the floor beside")
    parser.add_argument("--out", default=None, help="write the result as JSON")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        print(json.dumps(measure(opts.shape, opts.reps)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, os.path.abspath(__file__), "--worker", "--shape", opts.shape, "--reps", str(opts.reps)]
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for _ in range(opts.procs)]
    results = []
    for w in workers:
        out, _ = w.communicate()
        if w.returncode != 0:
            raise RuntimeError(f"a worker failed ({w.returncode})")
        results.append(json.loads(out))
    slowest = max(results, key=lambda r: r["floor_s"])
    print(f"{opts.shape} shape, {opts.procs} copies at once, 1 thread each; ms per step (slowest copy):")
    print("| product | count | forward | backward |\n|---|---|---|---|")
    for name, row in slowest["rows"].items():
        print(f"| {name} | {row['count']} | {1000 * row['forward_s']:.1f} | {1000 * row['backward_s']:.1f} |")
    print(f"| **floor** | | | **{1000 * slowest['floor_s']:.1f}** |")
    record = dict(command=" ".join(["python", os.path.relpath(sys.argv[0])] + sys.argv[1:]),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), load_average=os.getloadavg(),
                  procs=opts.procs, floors_s=[r["floor_s"] for r in results], slowest=slowest)
    if opts.peer:
        with open(opts.peer) as f:
            peer = json.load(f)
        if peer["shape"] != opts.shape:
            raise SystemExit(f"{opts.peer} is the {peer['shape']} shape, not {opts.shape}: pass a file of this shape.")
        for name, s in peer["summary"].items():
            ratio = slowest["floor_s"] / s["median_step_s"]
            record[f"floor_over_{name}"] = ratio
            print(f"floor / {name}'s median step ({s['median_step_s']:.3f} s): {ratio:.2f}")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
