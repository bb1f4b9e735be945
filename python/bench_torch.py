#!/usr/bin/python3
"""Times attention forward and backward in PyTorch eager on the CPU, on the
shapes laga_bench measures, and prints JSON on stdout.

Run with Debian's interpreter (python3-torch 1.13, CPU):
    /usr/bin/python3 python/bench_torch.py --threads 2 --shapes '[{"name": "x",
        "B": 1, "Sq": 1024, "Sk": 1024, "Hq": 16, "Hk": 16, "dqk": 192,
        "dv": 128, "causal": true, "scale": 0.0722}]'
laga_bench --torch calls it and prints laga/PyTorch ratios from the same run.

Attention is written out (torch 1.13 has no scaled_dot_product_attention):
scores = scale q k^T, the bottom-right aligned causal mask of
kernels/attention.hpp, softmax, p v; tensors are (B, S, H, d) as in laga and
the shared key/value head (Hk = 1) is broadcast with expand, not copied.
Timings are medians of --repeats runs after --warmup, in milliseconds:
fwd_ms the forward, bwd_ms the backward alone (autograd from a fresh forward,
timed from .backward() to its end), fwdbwd_ms both.
"""

import argparse
import json
import statistics
import time

import torch


def attention(q, k, v, s):
    """q (B, Sq, Hq, dqk), k (B, Sk, Hk, dqk), v (B, Sk, Hk, dv) -> (B, Sq, Hq, dv)."""
    g = s["Hq"] // s["Hk"]
    qh = q.transpose(1, 2)  # (B, Hq, Sq, dqk)
    kh = k.transpose(1, 2)  # (B, Hk, Sk, dqk)
    vh = v.transpose(1, 2)
    if g > 1:
        B, Hk, Sk = kh.shape[0], kh.shape[1], kh.shape[2]
        kh = kh[:, :, None].expand(B, Hk, g, Sk, s["dqk"]).reshape(B, Hk * g, Sk, s["dqk"])
        vh = vh[:, :, None].expand(B, Hk, g, Sk, s["dv"]).reshape(B, Hk * g, Sk, s["dv"])
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * s["scale"]
    if s["causal"]:
        Sq, Sk = s["Sq"], s["Sk"]
        i = torch.arange(Sq)[:, None]
        j = torch.arange(Sk)[None, :]
        scores = scores.masked_fill(j > i + Sk - Sq, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    return torch.matmul(p, vh).transpose(1, 2)


def median_ms(fn, warmup, repeats):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench(s, warmup, repeats):
    torch.manual_seed(0)
    q = torch.randn(s["B"], s["Sq"], s["Hq"], s["dqk"], requires_grad=True)
    k = torch.randn(s["B"], s["Sk"], s["Hk"], s["dqk"], requires_grad=True)
    v = torch.randn(s["B"], s["Sk"], s["Hk"], s["dv"], requires_grad=True)
    dout = torch.randn(s["B"], s["Sq"], s["Hq"], s["dv"])

    def fwd():
        with torch.no_grad():
            attention(q, k, v, s)

    def fwdbwd():
        q.grad = k.grad = v.grad = None
        attention(q, k, v, s).backward(dout)

    bwd_times = []

    def bwd():
        q.grad = k.grad = v.grad = None
        o = attention(q, k, v, s)
        t0 = time.perf_counter()
        o.backward(dout)
        bwd_times.append((time.perf_counter() - t0) * 1e3)

    out = {"name": s["name"]}
    out["fwd_ms"] = median_ms(fwd, warmup, repeats)
    for _ in range(warmup + repeats):
        bwd()
    out["bwd_ms"] = statistics.median(bwd_times[warmup:])
    out["fwdbwd_ms"] = median_ms(fwdbwd, warmup, repeats)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--shapes", required=True, help="JSON list of shapes (see module doc)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = [bench(s, a.warmup, a.repeats) for s in json.loads(a.shapes)]
    print(json.dumps({"torch": torch.__version__, "threads": torch.get_num_threads(),
                      "results": results}))


if __name__ == "__main__":
    main()
