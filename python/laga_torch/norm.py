"""RMSNorm over the whole finite range (the C++ rule of src/kernels/rmsnorm.cpp,
docs/reliability.md "Non-finite values", carried to both ends of the range).

y = x rstd w, rstd = 1 / sqrt(mean(x^2) + eps). Summed as written, x^2
overflows for float32 rows near 1e19 (rstd 0, the row 0, nothing non-finite
to notice) and underflows for rows below about 1e-19, and 1 / max|x| (the C++
scale) overflows for tiny and subnormal maxima. So each row is divided by
c = max(m, sqrt(eps)), m its largest |x| (c = 1 for an all-zero row):

  xs = x / c (|xs| <= 1),  den = sqrt(mean(xs^2) + (sqrt(eps) / c)^2),
  xhat = xs / den,  rstd = (1 / c) / den,  y = xhat w,

where den lies in [1/sqrt(C), sqrt(2)]: no intermediate overflows, and what
underflows (xs^2 of entries far below the row's maximum, or below sqrt(eps)
when the eps term is 1) is below the sum's rounding. Backward is in xhat,
recomputed from x the same way (never x rstd^3, which underflows):
dx = (w dy - xhat mean(w dy xhat)) / den / c, dw = sum over rows of dy xhat.
A row holding inf or NaN gives a NaN row (as the C++ kernel's: non-finite
input stays visible). bf16 computes in float32 and rounds once at the end.
"""

import math

import torch


def _compute_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_parts(x, eps):
    """(xhat, den, c) of rows x (..., C) in the compute dtype: xhat = x rstd
    of order 1, rstd = 1 / (c den)."""
    xc = x.to(_compute_dtype(x.dtype))
    m = xc.detach().abs().amax(-1, keepdim=True) if xc.shape[-1] else \
        xc.new_zeros(xc.shape[:-1] + (1,))
    r_eps = math.sqrt(eps) if eps > 0 else 0.0
    c = torch.clamp(m, min=r_eps) if r_eps > 0 else m
    finite = torch.isfinite(m)
    c = torch.where((c > 0) & finite, c, torch.ones_like(c))  # an all-zero (or non-finite) row
    xs = xc / c
    den = torch.sqrt(xs.pow(2).mean(-1, keepdim=True) + (r_eps / c) ** 2)
    xhat = xs / den
    xhat = torch.where(finite, xhat, xhat.new_tensor(float("nan")))
    return xhat, den, c


def rms_norm(x, w, eps):
    """y = x rstd w of rows x (..., C), in x's dtype (differentiable, twice:
    autograd composes it)."""
    xhat, _, _ = rms_parts(x, eps)
    return (xhat * w.to(xhat.dtype)).to(x.dtype)


def rms_forward(x, w, eps):
    """(y, rstd) for laga's tape: rstd (..., 1) in x's dtype, as the C++ saves it."""
    xhat, den, c = rms_parts(x, eps)
    rstd = torch.where(torch.isfinite(xhat[..., :1]), (1 / c) / den,
                       den.new_tensor(float("nan")))
    return (xhat * w.to(xhat.dtype)).to(x.dtype), rstd.to(x.dtype)


def rms_backward(dy, x, w, eps, dw_sum=None):
    """(dx, dw) of y = x rstd w, from x itself (xhat recomputed, never x
    rstd^3). dw_sum: how the rows' terms dy xhat (..., C) are summed (the
    invariant mode's token tree, invariant.TokenTree.column_sum)."""
    xhat, den, c = rms_parts(x, eps)
    t = xhat.dtype
    g = dy.to(t) * w.to(t)
    k = (g * xhat).mean(-1, keepdim=True)
    dx = (g - xhat * k) / den / c
    if dw_sum is not None:
        dw = dw_sum(dy.to(t) * xhat)
    else:
        dw = (dy.to(t) * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(w.dtype)
