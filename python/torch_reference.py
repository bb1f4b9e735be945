#!/usr/bin/python3
"""Independent PyTorch reference for the DeepSeek-V3 MLA attention block.

Written from the math in docs/mla-math.md (DeepSeek-V3 `inference/model.py`
semantics), not from the C++ code, so that the C++ block can be tested against
something that shares none of its bugs. Forward and backward run in float64
(backward by autograd); inputs are drawn in float32 and promoted, so the C++
fp32 run can consume bit-identical values.

Usage (Debian's python, which has torch 1.13):

    /usr/bin/python3 python/torch_reference.py --out DIR [--check]

writes DIR/case_<name>.safetensors for every case in CASES, reads each file
back and cross-checks `out` against a loop-based numpy implementation. With
--check it also runs torch.autograd.gradcheck on tiny configurations.

As a module: `mla_forward(params, x, cfg)` is the block, `make_params` and
`MLAConfig` build inputs, for reuse by a whole-model reference.
"""

import argparse
import dataclasses
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402  (sibling module, path set just above)


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

@dataclasses.dataclass
class MLAConfig:
    """Block configuration; field names are DeepSeek ModelArgs names.

    YaRN is on exactly when max_seq_len > original_seq_len (as in DeepSeek);
    rope_factor and mscale are ignored otherwise.
    """

    dim: int
    n_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    original_seq_len: int = 4096
    max_seq_len: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    norm_eps: float = 1e-6
    batch: int = 1
    seq: int = 1

    @property
    def yarn(self):
        return self.max_seq_len > self.original_seq_len

    def to_json(self):
        return json.dumps(dataclasses.asdict(self))


def as_config(cfg):
    """Accept an MLAConfig or a mapping of ModelArgs names (extra keys ignored)."""
    if isinstance(cfg, MLAConfig):
        return cfg
    names = {f.name for f in dataclasses.fields(MLAConfig)}
    return MLAConfig(**{k: v for k, v in dict(cfg).items() if k in names})


def param_shapes(cfg):
    """DeepSeek parameter names -> shapes ([out, in] for linear weights)."""
    cfg = as_config(cfg)
    d, h = cfg.dim, cfg.n_heads
    dqk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    shapes = {}
    if cfg.q_lora_rank == 0:
        shapes["wq.weight"] = (h * dqk, d)
    else:
        shapes["wq_a.weight"] = (cfg.q_lora_rank, d)
        shapes["q_norm.weight"] = (cfg.q_lora_rank,)
        shapes["wq_b.weight"] = (h * dqk, cfg.q_lora_rank)
    shapes["wkv_a.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, d)
    shapes["kv_norm.weight"] = (cfg.kv_lora_rank,)
    shapes["wkv_b.weight"] = (h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                              cfg.kv_lora_rank)
    shapes["wo.weight"] = (d, h * cfg.v_head_dim)
    return shapes


def make_params(cfg, generator):
    """Draw float32 parameters in param_shapes() order.

    Linear weights ~ N(0, 1/fan_in) keep every activation O(1), so errors are
    not hidden by tiny or saturated values. Norm weights are 1 + 0.1 N(0, 1):
    close to the usual init, yet far enough from 1 that ignoring them fails.
    """
    params = {}
    for name, shape in param_shapes(cfg).items():
        w = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.1 * w
        else:
            params[name] = w / math.sqrt(shape[1])
    return params


# --------------------------------------------------------------------------
# The block
# --------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """DeepSeek RMSNorm: no centering, no bias; weight scales each channel."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_freqs(cfg):
    """Per-pair rotary frequencies, float64 [dr/2], as precompute_freqs_cis.

    Under YaRN, pairs that turn fewer than beta_slow times over the original
    context are interpolated (frequency / factor: positions beyond the trained
    length then map to angles seen in training), pairs that turn more than
    beta_fast times are kept (they resolve local order), and a linear ramp
    blends the ones in between.
    """
    cfg = as_config(cfg)
    dr = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    freqs = 1.0 / base ** (torch.arange(0, dr, 2, dtype=torch.float64) / dr)
    if cfg.yarn:
        def correction_dim(num_rotations):
            # The pair index i whose wavelength fits num_rotations times into
            # original_seq_len, solved from 2*pi*base^(2i/dr) = L / num_rot.
            return (dr * math.log(cfg.original_seq_len / (num_rotations * 2 * math.pi))
                    / (2 * math.log(base)))

        low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(correction_dim(cfg.beta_slow)), dr - 1)
        if low == high:
            high += 0.001  # avoid 0/0; the ramp becomes a step
        ramp = ((torch.arange(dr // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        freqs = freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth
    return freqs


def rope_cos_sin(cfg, seq, dtype):
    """cos, sin of t * freq_i for t in [0, seq): [seq, dr/2] each.

    Angles are formed in float64 (t * freq loses digits in fp32 for long
    contexts) and only the cos/sin values are cast to the compute dtype.
    """
    t = torch.arange(seq, dtype=torch.float64)
    angles = torch.outer(t, rope_freqs(cfg))
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs (2i, 2i+1) of x [B, S, heads, dr].

    Same as DeepSeek's view_as_complex(x.view(..., -1, 2)) * freqs_cis:
    (a + ib)(cos + i sin) = (a cos - b sin) + i(a sin + b cos).
    Real arithmetic keeps autograd and gradcheck simple.
    """
    pairs = x.unflatten(-1, (x.shape[-1] // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c = cos[None, :, None, :]
    s = sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)


def softmax_scale(cfg):
    """(dn+dr)^-1/2, times mscale^2 under YaRN.

    YaRN's attention temperature: interpolated RoPE flattens the score
    distribution, and mscale = 0.1 * mscale_arg * ln(factor) + 1 on both
    q and k (hence squared) sharpens it back.
    """
    cfg = as_config(cfg)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.yarn:
        m = 0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1.0
        scale = scale * m * m
    return scale


def mla_forward(params, x, cfg):
    """MLA block forward. x [B, S, D] -> out [B, S, D], in x's dtype.

    params: dict of DeepSeek names (see param_shapes) -> tensors of x's dtype.
    Token s of x sits at global position s; the mask is causal.
    """
    cfg = as_config(cfg)
    bsz, seq, _ = x.shape
    h = cfg.n_heads
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    c_dim = cfg.kv_lora_rank

    # Queries: direct, or through a normalised low-rank bottleneck.
    if cfg.q_lora_rank == 0:
        q = x @ params["wq.weight"].T
    else:
        q_lat = rms_norm(x @ params["wq_a.weight"].T, params["q_norm.weight"], cfg.norm_eps)
        q = q_lat @ params["wq_b.weight"].T
    q = q.view(bsz, seq, h, dn + dr)                     # nope first per head
    q_nope, q_pe = q.split([dn, dr], dim=-1)

    # Keys/values come from one latent c per token (the thing MLA caches and
    # laga all-gathers) plus one positional key k_pe shared by all heads:
    # RoPE cannot be absorbed into W_UK, so it gets its own unshared path.
    kv_a = x @ params["wkv_a.weight"].T                  # [B, S, C + dr]
    c, k_pe = kv_a.split([c_dim, dr], dim=-1)
    c_hat = rms_norm(c, params["kv_norm.weight"], cfg.norm_eps)

    cos, sin = rope_cos_sin(cfg, seq, x.dtype)
    q_pe = apply_rope(q_pe, cos, sin)                    # [B, S, H, dr]
    k_pe = apply_rope(k_pe.unsqueeze(2), cos, sin)       # [B, S, 1, dr]

    kv = (c_hat @ params["wkv_b.weight"].T).view(bsz, seq, h, dn + dv)
    k_nope, v = kv.split([dn, dv], dim=-1)

    k = torch.cat([k_nope, k_pe.expand(bsz, seq, h, dr)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    scores = torch.einsum("bshd,bthd->bhst", q, k) * softmax_scale(cfg)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    o = torch.einsum("bhst,bthd->bshd", probs, v)        # [B, S, H, dv]
    return o.reshape(bsz, seq, h * dv) @ params["wo.weight"].T


# --------------------------------------------------------------------------
# Independent numpy cross-check (loops, complex RoPE, per-element YaRN)
# --------------------------------------------------------------------------

def numpy_mla_forward(params, x, cfg):
    """Second, deliberately different implementation of the same block.

    Token-by-token and head-by-head loops, RoPE through complex exponentials,
    YaRN frequencies element by element: it shares no code with mla_forward,
    so agreement to ~1e-15 means both follow the math, not a common slip.
    """
    cfg = as_config(cfg)
    p = {k: np.asarray(v, dtype=np.float64) for k, v in params.items()}
    x = np.asarray(x, dtype=np.float64)
    bsz, seq, dim = x.shape
    h = cfg.n_heads
    dn, dr, dv = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    c_dim = cfg.kv_lora_rank
    half = dr // 2

    yarn = cfg.max_seq_len > cfg.original_seq_len
    if yarn:
        def fcd(n):
            return (dr * math.log(cfg.original_seq_len / (n * 2 * math.pi))
                    / (2 * math.log(cfg.rope_theta)))
        lo = max(math.floor(fcd(cfg.beta_fast)), 0)
        hi = min(math.ceil(fcd(cfg.beta_slow)), dr - 1)
        if lo == hi:
            hi += 0.001
    freqs = []
    for i in range(half):
        f = cfg.rope_theta ** (-2.0 * i / dr)
        if yarn:
            r = min(max((i - lo) / (hi - lo), 0.0), 1.0)
            f = r * f / cfg.rope_factor + (1.0 - r) * f
        freqs.append(f)

    def rope(vec, t):
        z = vec[0::2] + 1j * vec[1::2]
        z = z * np.exp(1j * t * np.array(freqs))
        out = np.empty(dr)
        out[0::2], out[1::2] = z.real, z.imag
        return out

    def rmsn(vec, w):
        return vec / math.sqrt(float(np.mean(vec * vec)) + cfg.norm_eps) * w

    scale = 1.0 / math.sqrt(dn + dr)
    if yarn:
        scale *= (0.1 * cfg.mscale * math.log(cfg.rope_factor) + 1.0) ** 2

    out = np.zeros((bsz, seq, dim))
    for b in range(bsz):
        qs, ks, vs = [], [], []
        for t in range(seq):
            xt = x[b, t]
            if cfg.q_lora_rank == 0:
                qt = p["wq.weight"].dot(xt)
            else:
                qt = p["wq_b.weight"].dot(rmsn(p["wq_a.weight"].dot(xt), p["q_norm.weight"]))
            lat = p["wkv_a.weight"].dot(xt)
            c_hat = rmsn(lat[:c_dim], p["kv_norm.weight"])
            kpe = rope(lat[c_dim:], t)
            kvt = p["wkv_b.weight"].dot(c_hat)
            qh, kh, vh = [], [], []
            for j in range(h):
                qj = qt[j * (dn + dr):(j + 1) * (dn + dr)]
                kvj = kvt[j * (dn + dv):(j + 1) * (dn + dv)]
                qh.append(np.concatenate([qj[:dn], rope(qj[dn:], t)]))
                kh.append(np.concatenate([kvj[:dn], kpe]))
                vh.append(kvj[dn:])
            qs.append(qh)
            ks.append(kh)
            vs.append(vh)
        for t in range(seq):
            o = np.zeros(h * dv)
            for j in range(h):
                logits = [scale * float(qs[t][j].dot(ks[u][j])) for u in range(t + 1)]
                m = max(logits)
                w = [math.exp(z - m) for z in logits]
                total = sum(w)
                for u in range(t + 1):
                    o[j * dv:(j + 1) * dv] += (w[u] / total) * vs[u][j]
            out[b, t] = p["wo.weight"].dot(o)
    return out


# --------------------------------------------------------------------------
# Cases and file writing
# --------------------------------------------------------------------------

_SMALL = dict(dim=64, n_heads=4, kv_lora_rank=32,
              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)

# (a), (b) keep YaRN off with max_seq_len == original_seq_len but a
# non-trivial rope_factor/mscale, so an implementation that applies YaRN
# unconditionally fails. (c), (d) choose rope parameters whose correction
# range is strictly inside the dr/2 = 4 pairs with a fractional ramp value
# (c: smooth = [1, 1, 0.5, 0]; d: smooth = [1, 0.5, 0, 0]), so kept,
# blended and interpolated pairs are all exercised.
CASES = {
    "a": MLAConfig(**_SMALL, q_lora_rank=0, batch=2, seq=11,
                   rope_factor=40.0, original_seq_len=4096, max_seq_len=4096,
                   mscale=0.707),
    "b": MLAConfig(**_SMALL, q_lora_rank=24, batch=2, seq=11,
                   rope_factor=40.0, original_seq_len=4096, max_seq_len=4096,
                   mscale=0.707),
    "c": MLAConfig(**_SMALL, q_lora_rank=0, batch=2, seq=13,
                   rope_theta=10000.0, rope_factor=4.0, original_seq_len=4096,
                   max_seq_len=16384, beta_fast=32.0, beta_slow=1.0, mscale=0.707),
    "d": MLAConfig(**dict(_SMALL, n_heads=3), q_lora_rank=16, batch=1, seq=9,
                   rope_theta=500.0, rope_factor=8.0, original_seq_len=64,
                   max_seq_len=256, beta_fast=32.0, beta_slow=1.0, mscale=1.0),
}
SEEDS = {"a": 1001, "b": 1002, "c": 1003, "d": 1004}


def run_case(cfg, seed):
    """Draw inputs (float32), run forward + backward in float64.

    Draw order, all from one torch.Generator seeded with `seed`: parameters in
    param_shapes() order, then x [B, S, D], then dout [B, S, D].
    Returns (inputs32, results64): name -> tensor.
    """
    g = torch.Generator().manual_seed(seed)
    params32 = make_params(cfg, g)
    x32 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g, dtype=torch.float32)
    dout32 = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g, dtype=torch.float32)

    params = {k: v.double().requires_grad_() for k, v in params32.items()}
    x = x32.double().requires_grad_()
    out = mla_forward(params, x, cfg)
    out.backward(dout32.double())

    inputs = dict(params32, x=x32, dout=dout32)
    results = {"out": out.detach(), "dx": x.grad}
    results.update({"grad." + k: v.grad for k, v in params.items()})
    return inputs, results


def write_case(path, name, cfg, seed):
    inputs, results = run_case(cfg, seed)
    tensors = {k: v.numpy() for k, v in inputs.items()}
    # Round float64 results to F32 once, on write: the C++ fp32 run is
    # compared against these with a tolerance.
    tensors.update({k: v.numpy().astype(np.float32) for k, v in results.items()})
    metadata = {
        "config": cfg.to_json(),
        "case": name,
        "seed": str(seed),
        "producer": "python/torch_reference.py (torch %s, float64 compute)"
                    % torch.__version__,
    }
    safetensors_io.save_file(tensors, path, metadata)
    return inputs, results


def verify_file(path, inputs, results):
    """Read the file back; check round trip and the numpy cross-check.

    Returns max |out_torch64 - out_numpy64| over the case.
    """
    tensors, metadata = safetensors_io.load_file(path)
    cfg = as_config(json.loads(metadata["config"]))
    expected = set(inputs) | set(results)
    if set(tensors) != expected:
        raise AssertionError(f"{path}: tensors {sorted(tensors)} != {sorted(expected)}")
    for k, v in inputs.items():
        if tensors[k].dtype != np.float32 or not np.array_equal(tensors[k], v.numpy()):
            raise AssertionError(f"{path}: input {k} did not round-trip exactly")
    for k, v in results.items():
        if not np.array_equal(tensors[k], v.numpy().astype(np.float32)):
            raise AssertionError(f"{path}: result {k} did not round-trip exactly")
    for k, shape in param_shapes(cfg).items():
        if tensors[k].shape != shape or tensors["grad." + k].shape != shape:
            raise AssertionError(f"{path}: {k} has shape {tensors[k].shape}, want {shape}")

    # Independent recomputation from what the file holds (F32 inputs are the
    # exact values the float64 run used).
    params = {k: tensors[k] for k in param_shapes(cfg)}
    ref = numpy_mla_forward(params, tensors["x"], cfg)
    err = float(np.max(np.abs(ref - results["out"].numpy())))
    if not err <= 1e-10:
        raise AssertionError(f"{path}: numpy cross-check max|d out| = {err:.3e} > 1e-10")
    return err


# --------------------------------------------------------------------------
# gradcheck
# --------------------------------------------------------------------------

_TINY = dict(dim=6, n_heads=2, kv_lora_rank=4, qk_nope_head_dim=2,
             qk_rope_head_dim=4, v_head_dim=3, batch=2, seq=4)
CHECK_CASES = {
    "tiny_rq0": MLAConfig(**_TINY, q_lora_rank=0),
    "tiny_rq5_yarn": MLAConfig(**_TINY, q_lora_rank=5, rope_factor=4.0,
                               original_seq_len=4096, max_seq_len=8192,
                               mscale=0.707),
}


def gradcheck_case(cfg, seed=7):
    """Autograd backward of mla_forward vs central finite differences (float64)."""
    g = torch.Generator().manual_seed(seed)
    params = make_params(cfg, g)
    names = list(params)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim, generator=g, dtype=torch.float32)
    leaves = [x.double().requires_grad_()]
    leaves += [params[k].double().requires_grad_() for k in names]

    def f(x_, *ws):
        return mla_forward(dict(zip(names, ws)), x_, cfg)

    return torch.autograd.gradcheck(f, tuple(leaves), eps=1e-6, atol=1e-8, rtol=1e-6)


# --------------------------------------------------------------------------

def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for case_<name>.safetensors")
    parser.add_argument("--check", action="store_true",
                        help="also run torch.autograd.gradcheck on tiny configs")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # deterministic reductions; the cases are tiny
    os.makedirs(args.out, exist_ok=True)
    for name, cfg in CASES.items():
        path = os.path.join(args.out, f"case_{name}.safetensors")
        inputs, results = write_case(path, name, cfg, SEEDS[name])
        err = verify_file(path, inputs, results)
        print(f"{path}: {os.path.getsize(path)} bytes, {len(inputs) + len(results)} tensors, "
              f"q_lora_rank={cfg.q_lora_rank} yarn={'on' if cfg.yarn else 'off'} "
              f"H={cfg.n_heads} B={cfg.batch} S={cfg.seq}, "
              f"numpy cross-check max|d out| = {err:.2e}")

    if args.check:
        ok = True
        for name, cfg in CHECK_CASES.items():
            passed = gradcheck_case(cfg)
            ok = ok and passed
            print(f"gradcheck {name}: {'passed' if passed else 'FAILED'}")
        if not ok:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
