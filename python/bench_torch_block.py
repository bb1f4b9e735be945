#!/usr/bin/env python3
"""Time one MLA block (explicit form, one rank) forward+backward in PyTorch eager.

The same block laga runs (DeepSeek-V3 attention math: wq, wkv_a, kv_norm,
wkv_b, wo; interleaved RoPE on q_pe and the shared k_pe; causal softmax),
written the way a PyTorch user would: matmuls, softmax, autograd. Used by
`laga_bench block --torch` for the laga/PyTorch ratio in the same run.
Default: prints one JSON object {"fwd_bwd_ms": median, "tokens_per_s": ...}.
--serve: runs the warm-up, prints {"ready": true, "torch": version}, then
runs one timed step per "step" line on stdin and prints {"ms": ...} for it,
until stdin closes (bench/torch_peer.hpp: laga and PyTorch steps alternate).
--autocast bf16: forward under torch.autocast("cpu", dtype=torch.bfloat16),
fp32 parameters, as a PyTorch user trains in bf16 on the CPU (the peer of
`laga_bench block_bf16 --torch`).
Run with Debian's /usr/bin/python3 (python3-torch 1.13, CPU: eager attention)
or an interpreter with PyTorch >= 2, where attention is
F.scaled_dot_product_attention(is_causal=True) (docs/performance.md says how
to make such a virtual environment; a bench tool only).
"""
import argparse
import json
import sys
import time

import torch

# PyTorch >= 2 has F.scaled_dot_product_attention: the peer a PyTorch 2 user
# would run. PyTorch 1.13 (Debian's) runs the eager matmul-softmax-matmul.
SDPA = getattr(torch.nn.functional, "scaled_dot_product_attention", None)


def rope(x, cos, sin):
    # x (..., S, h, dr): interleaved pairs (2i, 2i+1) rotated by pos * freq_i.
    xr = x.reshape(*x.shape[:-1], -1, 2)
    re, im = xr[..., 0], xr[..., 1]
    return torch.stack((re * cos - im * sin, re * sin + im * cos), dim=-1).flatten(-2)


def block(x, p, a, cos, sin):
    B, S, D = x.shape
    H, dn, dr, dv, C = a.heads, a.nope, a.rope, a.v, a.latent
    q = (x @ p["wq"].t()).view(B, S, H, dn + dr)
    q_nope, q_pe = q[..., :dn], rope(q[..., dn:], cos[:, None], sin[:, None])
    kv_a = x @ p["wkv_a"].t()
    c, k_pe = kv_a[..., :C], rope(kv_a[..., None, C:], cos[:, None], sin[:, None])
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * p["kv_norm"]
    kv = (c @ p["wkv_b"].t()).view(B, S, H, dn + dv)
    k = torch.cat((kv[..., :dn], k_pe.expand(B, S, H, dr)), -1)
    qh = torch.cat((q_nope, q_pe), -1).transpose(1, 2)
    if SDPA is not None:
        # PyTorch 2: its fused attention (a CPU flash kernel where it applies);
        # the default scale 1/sqrt(q's last dim) is (dn + dr) ** -0.5.
        o = SDPA(qh, k.transpose(1, 2), kv[..., dn:].transpose(1, 2), is_causal=True)
    else:
        scores = qh @ k.transpose(1, 2).transpose(-1, -2) * (dn + dr) ** -0.5
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        o = probs @ kv[..., dn:].transpose(1, 2)
    return o.transpose(1, 2).reshape(B, S, H * dv) @ p["wo"].t()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--latent", type=int, default=512)
    ap.add_argument("--nope", type=int, default=128)
    ap.add_argument("--rope", type=int, default=64)
    ap.add_argument("--v", type=int, default=128)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--autocast", choices=["none", "bf16"], default="none",
                    help="bf16: the forward under CPU bf16 autocast (fp32 parameters)")
    ap.add_argument("--serve", action="store_true",
                    help="after warm-up, one timed step per 'step' line on stdin")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    D, H = a.dim, a.heads

    def w(o, i):
        return (torch.randn(o, i, generator=g) / i ** 0.5).requires_grad_()

    p = {"wq": w(H * (a.nope + a.rope), D), "wkv_a": w(a.latent + a.rope, D),
         "kv_norm": torch.ones(a.latent, requires_grad=True),
         "wkv_b": w(H * (a.nope + a.v), a.latent), "wo": w(D, H * a.v)}
    x = torch.randn(a.batch, a.seq, D, generator=g, requires_grad=True)
    dout = torch.randn(a.batch, a.seq, D, generator=g)
    freqs = 1.0 / (1e4 ** (torch.arange(0, a.rope, 2, dtype=torch.float64) / a.rope))
    ang = torch.outer(torch.arange(a.seq, dtype=torch.float64), freqs)
    cos, sin = ang.cos().float(), ang.sin().float()

    def step():
        if a.autocast == "bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = block(x, p, a, cos, sin)
        else:
            out = block(x, p, a, cos, sin)
        out.backward(dout.to(out.dtype))

    def timed_step():
        t0 = time.perf_counter()
        step()
        return (time.perf_counter() - t0) * 1e3

    if a.serve:
        for _ in range(a.warmup):
            step()
        print(json.dumps({"ready": True, "torch": torch.__version__, "autocast": a.autocast}),
              flush=True)
        for line in sys.stdin:
            if line.strip() != "step":
                raise SystemExit(f"bench_torch_block.py --serve: unknown request {line!r}")
            print(json.dumps({"ms": timed_step()}), flush=True)
        return

    for _ in range(a.warmup):
        step()
    times = sorted(timed_step() for _ in range(a.repeats))
    med = times[len(times) // 2]
    print(json.dumps({"fwd_bwd_ms": med, "tokens_per_s": a.batch * a.seq / med * 1e3,
                      "torch": torch.__version__, "threads": a.threads, "autocast": a.autocast}))


if __name__ == "__main__":
    main()
