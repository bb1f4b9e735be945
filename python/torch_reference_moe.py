#!/usr/bin/python3
"""DeepSeek-V3's (and V2's) MoE layer in PyTorch autograd, float64: the independent
reference the C++ layer (src/model/moe.cpp) is compared with
(tests/model/test_moe.cpp, `MoeTorchReference`).

Written from DeepSeek-V3's inference/model.py (`Gate`, `Expert`, `MoE`) and
Hugging Face's `DeepseekV3MoE`, not from laga's code: the gate is
sigmoid(x W_g^T); the bias (e_score_correction_bias) is added for the
selection only; with n_group > 1 each group scores as the sum of its two
largest biased scores and only the topk_group best groups stay (the others'
experts filled with -inf); the k best biased scores pick the experts; the
weights are the UNBIASED scores gathered there, divided by their sum when
normalised, times routed_scaling_factor; each selected expert's SwiGLU
w2(silu(w1 x) * w3 x) weighted and added, plus the shared experts' SwiGLU.
The backward is autograd's (the selection is piecewise constant). The v2_*
cases use DeepSeek-V2's gate instead (`gate_v2`: softmax, no bias, groups
scored by their maximum), written from Hugging Face's DeepSeek-V2 MoEGate.

    torch_reference_moe.py --out DIR [--check]

writes DIR/moe_<case>.safetensors for every case: the config (metadata
"config", Hugging Face's key names), every parameter under laga's names,
x, dout, out, dx and every gradient ("grad.<name>"), float64. --check also
runs torch.autograd.gradcheck on a small case.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402

V3 = dict(scoring_func="sigmoid", topk_method="noaux_tc")
CASES = {
    # E, k, I, shared, n_group, topk_group, scale, norm, N, D
    "grouped": dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=8,
                    n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    norm_topk_prob=True, tokens=24, dim=16, **V3),
    "ungrouped_unnormalised": dict(n_routed_experts=6, num_experts_per_tok=2,
                                   moe_intermediate_size=5, n_shared_experts=0, n_group=1,
                                   topk_group=1, routed_scaling_factor=1.5, norm_topk_prob=False,
                                   tokens=24, dim=16, **V3),
    # DeepSeek-V2's gates (softmax, no bias): V2's group_limited_greedy, whose
    # groups score their maximum, and V2-Lite's greedy, normalised or not.
    "v2_grouped": dict(n_routed_experts=16, num_experts_per_tok=3, moe_intermediate_size=6,
                       n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=16.0,
                       norm_topk_prob=False, tokens=40, dim=16, scoring_func="softmax",
                       topk_method="group_limited_greedy"),
    "v2_greedy": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=5,
                      n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.5,
                      norm_topk_prob=False, tokens=24, dim=16, scoring_func="softmax",
                      topk_method="greedy"),
    "v2_greedy_normalised": dict(n_routed_experts=8, num_experts_per_tok=3,
                                 moe_intermediate_size=5, n_shared_experts=0, n_group=1,
                                 topk_group=1, routed_scaling_factor=2.0, norm_topk_prob=True,
                                 tokens=24, dim=16, scoring_func="softmax", topk_method="greedy"),
}


def names(c):
    E, I, Ns = c["n_routed_experts"], c["moe_intermediate_size"], c["n_shared_experts"]
    D = c["dim"]
    shapes = {"gate.weight": (E, D), "gate.bias": (E,)}
    for e in range(E):
        shapes[f"experts.{e}.w1.weight"] = (I, D)
        shapes[f"experts.{e}.w2.weight"] = (D, I)
        shapes[f"experts.{e}.w3.weight"] = (I, D)
    if Ns > 0:
        shapes["shared_experts.w1.weight"] = (Ns * I, D)
        shapes["shared_experts.w2.weight"] = (D, Ns * I)
        shapes["shared_experts.w3.weight"] = (Ns * I, D)
    return shapes


def swiglu(x, w1, w2, w3):
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def gate(c, x, weight, bias):
    """(weights (N, k), indices (N, k)): DeepSeek-V3's Gate.forward, or for
    the V2 cases Hugging Face's DeepSeek-V2 MoEGate.forward."""
    if c["topk_method"] != "noaux_tc":
        return gate_v2(c, x, weight)
    scores = torch.sigmoid(F.linear(x, weight))
    original = scores
    scores = scores + bias  # selection only
    G = c["n_group"]
    if G > 1:
        grouped = scores.view(x.size(0), G, -1)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        keep = group_scores.topk(c["topk_group"], dim=-1)[1]
        mask = torch.ones(x.size(0), G, dtype=torch.bool).scatter_(1, keep, False)
        scores = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, c["num_experts_per_tok"], dim=-1)[1]
    weights = original.gather(1, indices)
    if c["norm_topk_prob"]:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * c["routed_scaling_factor"], indices


def gate_v2(c, x, weight):
    """DeepSeek-V2's MoEGate (modeling_deepseek.py): softmax scores in
    float32 there (float64 here); greedy: top-k of all experts;
    group_limited_greedy: a group scores its max, the topk_group best groups'
    experts stay (the others' scores 0.0, below every softmax score); then
    normalised by the sum when top_k > 1 and norm_topk_prob, else scaled."""
    scores = F.linear(x, weight).softmax(dim=-1)
    k = c["num_experts_per_tok"]
    if c["topk_method"] == "greedy":
        weights, indices = torch.topk(scores, k=k, dim=-1, sorted=True)
    else:
        G = c["n_group"]
        group_scores = scores.view(x.size(0), G, -1).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=c["topk_group"], dim=-1, sorted=True)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(x.size(0), G, scores.size(-1) // G).reshape(
            x.size(0), -1)
        tmp = scores.masked_fill(~score_mask.bool(), 0.0)
        weights, indices = torch.topk(tmp, k=k, dim=-1, sorted=True)
    if k > 1 and c["norm_topk_prob"]:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * c["routed_scaling_factor"]
    return weights, indices


def moe(c, x, p):
    weights, indices = gate(c, x, p["gate.weight"], p["gate.bias"].detach())
    y = torch.zeros_like(x)
    for e in range(c["n_routed_experts"]):
        rows, slot = torch.where(indices == e)
        if rows.numel() == 0:
            continue
        out = swiglu(x[rows], p[f"experts.{e}.w1.weight"], p[f"experts.{e}.w2.weight"],
                     p[f"experts.{e}.w3.weight"])
        y = y.index_add(0, rows, out * weights[rows, slot, None])
    if c["n_shared_experts"] > 0:
        y = y + swiglu(x, p["shared_experts.w1.weight"], p["shared_experts.w2.weight"],
                       p["shared_experts.w3.weight"])
    return y, indices


def make(c, seed):
    g = torch.Generator().manual_seed(seed)
    D, N = c["dim"], c["tokens"]

    def uniform(shape, a):
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1) * a

    p = {}
    for n, shape in names(c).items():
        a = 0.6 if n == "gate.weight" else 0.1 if n == "gate.bias" else 1.5 / shape[-1] ** 0.5
        p[n] = uniform(shape, a).requires_grad_(n != "gate.bias")
    if c["topk_method"] != "noaux_tc":  # V2's gate has no bias: laga reads zeros
        p["gate.bias"] = torch.zeros_like(p["gate.bias"])
    x = uniform((N, D), 1.0).requires_grad_(True)
    dout = uniform((N, D), 1.0)
    return p, x, dout


def write(out_dir, name, c, seed):
    p, x, dout = make(c, seed)
    y, indices = moe(c, x, p)
    y.backward(dout)
    tensors = {n: t.detach().numpy() for n, t in p.items()}
    tensors.update({"x": x.detach().numpy(), "dout": dout.numpy(), "out": y.detach().numpy(),
                    "dx": x.grad.numpy(), "indices": indices.numpy().astype(np.float64)})  # exact; laga reads floats
    for n, t in p.items():
        if n != "gate.bias":
            tensors["grad." + n] = t.grad.numpy()
    cfg = {k: v for k, v in c.items() if k not in ("tokens", "dim")}
    cfg.update({"hidden_size": c["dim"], "first_k_dense_replace": 0, "moe_layer_freq": 1})
    meta = {"config": json.dumps(cfg), "tokens": str(c["tokens"]), "dim": str(c["dim"]),
            "producer": f"python/torch_reference_moe.py (torch {torch.__version__}, float64)"}
    safetensors_io.save_file(tensors, os.path.join(out_dir, f"moe_{name}.safetensors"), meta)


def gradcheck(case="grouped"):
    c = dict(CASES[case], tokens=5, dim=6)
    p, x, _ = make(c, 3)
    order = [n for n in p if n != "gate.bias"]

    def f(x_, *ws):
        q = dict(zip(order, ws))
        q["gate.bias"] = p["gate.bias"]
        return moe(c, x_, q)[0]

    ok = torch.autograd.gradcheck(f, (x, *[p[n] for n in order]), eps=1e-6, atol=1e-8)
    if not ok:
        raise SystemExit("torch_reference_moe.py: gradcheck failed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", action="store_true", help="also torch.autograd.gradcheck")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    for i, (name, c) in enumerate(CASES.items()):
        write(a.out, name, c, 100 + i)
    if a.check:
        gradcheck()
        gradcheck("v2_grouped")
    print(f"torch_reference_moe.py: wrote {len(CASES)} cases to {a.out}")


if __name__ == "__main__":
    main()
