#!/usr/bin/python3
"""A small MLA language model whose attention core is laga's, called the way
torchtitan calls a context-parallel inner attention (laga_torch.torchtitan,
docs/pytorch.md "torchtitan"): the model makes MLA's natural inputs itself
(queries with q_pe rotated, the normalised latent c_kv, k_pe rotated, wkv_b)
on packed [T, ...] tensors of this rank's tokens and hands them to
LatentCPAttention, which runs the form across the group.

    torchrun --nproc-per-node 2 python/examples/train_mla_torchtitan.py --form laga \
        --steps 20 --layout head-tail

--layout head-tail shards with torchtitan's head-tail permutation (rank r
holds chunks r and 2P-1-r of 2P), passed to prepare_cp_metadata as
torchtitan does. Every rank holds the whole model; the loss is the mean over
every token, each rank's gradient a partial sum (summed once per step).
The losses are the same at every P to rounding (--json writes them).
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import laga_torch as lt  # noqa: E402
from laga_torch import torchtitan as tt  # noqa: E402
from laga_torch.module import rope_tables  # noqa: E402

CONFIG = {"dim": 32, "n_heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
          "qk_rope_head_dim": 4, "v_head_dim": 8, "max_seq_len": 4096}


def rotate(x, cos, sin):
    """Interleaved-pair RoPE of x [T, heads, dr] by cos, sin [T, dr/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


class Attention(nn.Module):
    """DeepSeek's MLA projections (q_lora_rank 0) around laga's core."""

    def __init__(self, cfg, form):
        super().__init__()
        H, C, dn, dr, dv = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, \
            cfg.qk_rope_head_dim, cfg.v_head_dim
        self.cfg = cfg
        self.wq = nn.Linear(cfg.dim, H * (dn + dr), bias=False)
        self.wkv_a = nn.Linear(cfg.dim, C + dr, bias=False)
        self.kv_norm = nn.RMSNorm(C, eps=cfg.norm_eps) if hasattr(nn, "RMSNorm") else None
        self.kv_norm_w = None if self.kv_norm else nn.Parameter(torch.ones(C))
        self.wkv_b = nn.Linear(C, H * (dn + dv), bias=False)
        self.wo = nn.Linear(H * dv, cfg.dim, bias=False)
        self.core = tt.LatentCPAttention(cfg, form, reduce_dtype=torch.float64)

    def norm(self, c):
        if self.kv_norm is not None:
            return self.kv_norm(c)
        return c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * \
            self.kv_norm_w

    def forward(self, h_TD, trig, md):
        cfg = self.cfg
        T, H, C, dn = h_TD.shape[0], cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
        q = self.wq(h_TD).view(T, H, -1)
        q = torch.cat([q[..., :dn], rotate(q[..., dn:], *trig)], -1)
        kv = self.wkv_a(h_TD)
        c, k_pe = self.norm(kv[:, :C]), rotate(kv[:, None, C:], *trig)[:, 0]
        o_THV = self.core(q, c, k_pe, self.wkv_b.weight, attention_metadata=md)
        return self.wo(o_THV.reshape(T, -1))


class TinyLM(nn.Module):
    def __init__(self, cfg, vocab, layers, form):
        super().__init__()
        self.embed = nn.Embedding(vocab, cfg.dim)
        self.blocks = nn.ModuleList(Attention(cfg, form) for _ in range(layers))
        self.head = nn.Linear(cfg.dim, vocab, bias=False)

    def forward(self, tokens_T, trig, md):
        h = self.embed(tokens_T)
        for blk in self.blocks:
            h = h + blk(h, trig, md)
        return self.head(h)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--form", default="laga", choices=["laga", "laga_fused", "absorbed",
                                                        "laga2d", "ring_latent"])
    ap.add_argument("--layout", default="contiguous", choices=["contiguous", "head-tail"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seq", type=int, default=61)
    ap.add_argument("--docs", default="0,20,45", help="document starts (packed), then S")
    ap.add_argument("--json", help="rank 0 writes the per-step losses here")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    torch.set_default_dtype(torch.float64)
    cfg = lt.MLAConfig.from_json(CONFIG)
    torch.manual_seed(0)
    model = TinyLM(cfg, vocab=64, layers=2, form=args.form)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    S = args.seq
    cu = [int(v) for v in args.docs.split(",")] + [S]
    perm = None
    if args.layout == "head-tail":  # torchtitan's load-balancing permutation of the sequence
        perm = torch.tensor([tt._head_tail(S, P)])
    md = tt.LatentCPAttention.prepare_cp_metadata(tt.SequenceMetadata(cu_seqlens=cu),
                                                  permutation=perm)
    own = torch.tensor(lt.SpLayout.even(S, cfg.n_heads, P, md.seq_layout).positions(rank))
    # RoPE at each own token's position in its document
    start = torch.zeros(S, dtype=torch.long)
    for b, e in zip(cu, cu[1:]):
        start[b:e] = b
    cos, sin = rope_tables(cfg, S, torch.float64, "cpu")
    pos = (torch.arange(S) - start)[own]
    trig = (cos[pos], sin[pos])
    data = torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        first = torch.randint(0, 64, (1,), generator=data)
        seq = (first + torch.arange(S + 1)) % 64  # a learnable stream
        logits = model(seq[:-1][own], trig, md)
        loss = F.cross_entropy(logits, seq[1:][own], reduction="sum") / S
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)  # the ranks' partial sums: the whole sequence's gradient
        i = 0
        for p in model.parameters():
            p.grad.copy_(flat[i:i + p.numel()].view_as(p))
            i += p.numel()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
        if rank == 0:
            print(f"step {step:3d}  loss {total.item():.12f}", flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"P": P, "form": args.form, "layout": args.layout, "losses": losses}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
