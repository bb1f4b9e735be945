#!/usr/bin/python3
"""Kimi K3's gated NoPE MLA in laga_torch against the C++ forms (issue 55,
item 2; docs/mla-math.md, "Gated NoPE MLA").

Usage: test_torch_gated_nope.py LAGA WORKDIR [--sp 1,3]

Two configs, small dims (S 13 uneven over P 3, H 5 uneven):
  kimi   mla_use_nope + mla_use_output_gate with dr 4 kept but never
         rotated, q_lora_rank 7, and max_seq_len > original_seq_len (YaRN
         would be on were anything rotated: it must not be, scale (dn+dr)^-1/2);
  nope0  qk_rope_head_dim 0 (no rope part at all: q_pe / k_pe empty) with
         the gate, q_lora_rank 0.
For every package form (FORMS), and laga with q_latent + overlap on packed
documents, at each P, gloo ranks as processes:
  * out, dx and every parameter gradient (wg's included, summed over ranks)
    on laga's tape in float64 and on autograd's tape in float64 within
    1e-12 relative per tensor (|diff| / max |ref|) of `laga forward
    --backward --dtype float64` on the same safetensors; float32 on laga's
    tape within 1e-5 of `laga forward --dtype float32`;
  * every latent/absorbed form in float64 within 1e-12 of the package's own
    explicit at P 1 (absorption is exact without RoPE, mla-math.md);
  * the bytes laga's tape keeps for backward (float32, with the output; the
    gate's logits among them) equal `laga compare`'s flash closed form at
    the rank compare names, but absorbed at dr 0, whose values v_lat are the
    latent itself (B S C elements fewer than the C++ copy);
  * the gate weight loads under Kimi's name (g_proj.weight) as under wg.weight;
    a wg where the config has no gate is refused by `laga forward` and by
    load_state_dict in the same words, a gated config without it naming it;
  * on torch 2 with triton (TRITON_INTERPRET=1): laga_fused with attention
    flash runs the Triton kernel (counted: a fall-back to torch fails).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, HERE)
# Triton's CPU interpreter for the one fused check in the driver (set before
# laga_torch is imported: fused_triton reads it); the ranks run torch's code.
if "--worker" in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import safetensors_io  # noqa: E402
from torch_ranks import end_ranks, free_port, run_ranks  # noqa: E402
from torch_saved import saved_by  # noqa: E402

B, S = 2, 13
BASE = {"dim": 24, "n_heads": 5, "kv_lora_rank": 10, "qk_nope_head_dim": 8, "v_head_dim": 6,
        "original_seq_len": 8, "max_seq_len": 32, "rope_factor": 4.0, "mscale": 0.7,
        "beta_fast": 4.0, "beta_slow": 1.0}
CONFIGS = {"kimi": dict(BASE, qk_rope_head_dim=4, q_lora_rank=7, mla_use_nope=True,
                        mla_use_output_gate=True),
           "nope0": dict(BASE, qk_rope_head_dim=0, q_lora_rank=0, mla_use_output_gate=True)}
DOCS = [[0, 3, 9, 10, 13], [0, 6, 13]]
TOLS = {"float64": 1e-12, "float32": 1e-5}
RUNS = [("f64", torch.float64, "laga"), ("f32", torch.float32, "laga"),
        ("f64-autograd", torch.float64, "autograd")]


def cases(lt):
    out = [{"id": f"{c}-{f}", "cfg": c, "form": f, "opts": {}, "docs": None}
           for c in CONFIGS for f in lt.FORMS]
    out.append({"id": "kimi-laga-q-latent-overlap-packed", "cfg": "kimi", "form": "laga",
                "opts": {"q_latent": True, "overlap": True}, "docs": DOCS})
    return out


def shard(lt, P, r):
    return torch.tensor(lt.SpLayout.even(S, BASE["n_heads"], P, "contiguous").positions(r))


def worker(args):
    import torch.distributed as dist
    import laga_torch as lt
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}",
                            rank=args.rank, world_size=args.world)
    P, r = args.world, args.rank
    own = shard(lt, P, r)
    inp, _ = safetensors_io.load_file(os.path.join(args.dir, "input.safetensors"))
    kept = {}
    for case in cases(lt):
        w, _ = safetensors_io.load_file(os.path.join(args.dir, f"weights-{case['cfg']}.safetensors"))
        for tag, dtype, tape in RUNS:
            m = lt.MLA(lt.MLAConfig.from_json(CONFIGS[case["cfg"]]), form=case["form"],
                       attention="flash", flash_block=4, tape=tape, dtype=dtype, **case["opts"])
            m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
            x = torch.from_numpy(inp["x"]).to(dtype)[:, own].clone().requires_grad_()
            keep = saved_by(m, x)
            with torch.autograd.graph.saved_tensors_hooks(keep.add, lambda t: t):
                out = m(x, cu_seqlens=case["docs"], seq_len=S)
            keep.add_ctx(out)
            if tag == "f32":  # laga's tape: what it keeps, against compare's closed form
                kept[case["id"]] = sum(b for _, b in keep) + out.numel() * out.element_size()
            out.backward(torch.from_numpy(inp["dout"]).to(dtype)[:, own])
            res = {"out": out.detach(), "dx": x.grad}
            res.update({"grad." + n: p.grad for n, p in m.named_parameters()})
            safetensors_io.save_file({k: v.numpy() for k, v in res.items()}, os.path.join(
                args.dir, f"torch-{tag}-{case['id']}-P{P}-r{r}.safetensors"))
    with open(os.path.join(args.dir, f"kept-P{P}-r{r}.json"), "w") as f:
        json.dump(kept, f)
    end_ranks()


def assemble(lt, d, tag, case, P):
    parts = [safetensors_io.load_file(os.path.join(
        d, f"torch-{tag}-{case['id']}-P{P}-r{r}.safetensors"))[0] for r in range(P)]
    full = {}
    for k in ("out", "dx"):
        full[k] = np.zeros((B, S) + parts[0][k].shape[2:], parts[0][k].dtype)
        for r, p in enumerate(parts):
            full[k][:, shard(lt, P, r).numpy()] = p[k]
    for k in parts[0]:
        if k.startswith("grad."):
            full[k] = sum(p[k] for p in parts)
    return full


def rel(a, ref):
    a, ref = a.astype(np.float64), ref.astype(np.float64)
    if not np.isfinite(a).all():
        return float("inf")
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    d = float(np.abs(a - ref).max()) if a.size else 0.0
    return d / scale if scale > 0 else d


def run(cmd):
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                       timeout=120)
    if p.returncode != 0:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {p.returncode}\n{p.stderr}")


def triton_fused(lt, d):
    """laga_fused + flash on the Triton kernel (interpreted), float64, P 1,
    against the package's explicit: the calls counted."""
    import torch.distributed as dist
    from laga_torch import fused, fused_triton
    if not (fused_triton.importable() and fused_triton.interpreted()):
        return "Triton fused path: not run (no triton in this torch; the torch 2 twin runs it)"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    calls = {"forward": 0, "backward": 0}
    for name in calls:
        orig = getattr(fused_triton, name)

        def counted(*a, _o=orig, _n=name, **k):
            calls[_n] += 1
            return _o(*a, **k)
        setattr(fused_triton, name, counted)
    worst = 0.0
    inp, _ = safetensors_io.load_file(os.path.join(d, "input.safetensors"))
    for cfg in CONFIGS:
        w, _ = safetensors_io.load_file(os.path.join(d, f"weights-{cfg}.safetensors"))
        res = {}
        for form in ("explicit", "laga_fused"):
            m = lt.MLA(lt.MLAConfig.from_json(CONFIGS[cfg]), form=form, attention="flash",
                       dtype=torch.float64)
            m.load_state_dict({k: torch.from_numpy(v) for k, v in w.items()})
            x = torch.from_numpy(inp["x"]).clone().requires_grad_()
            out = m(x, seq_len=S)
            out.backward(torch.from_numpy(inp["dout"]))
            res[form] = {"out": out.detach().numpy(), "dx": x.grad.numpy(),
                         **{n: p.grad.numpy() for n, p in m.named_parameters()}}
        for k, ref in res["explicit"].items():
            e = rel(res["laga_fused"][k], ref)
            worst = max(worst, e)
            if not e <= 1e-12:
                sys.exit(f"FAIL: {cfg} laga_fused on Triton: {k} differs from explicit by {e:.3e}")
    if not (calls["forward"] and calls["backward"]):
        sys.exit(f"FAIL: laga_fused did not run the Triton kernel ({calls}); "
                 f"kernel_for chose {fused.kernel_for(torch.zeros(1, dtype=torch.float64))}")
    return f"Triton fused path (interpreted, float64): {calls} calls, within {worst:.1e} of explicit"


def refusals(lt, args):
    """The gate's weight where the config has none, and none where it has
    one: refused by `laga forward` and by load_state_dict, each a ValueError
    naming the key and the weight."""
    plain = {k: v for k, v in CONFIGS["nope0"].items() if k != "mla_use_output_gate"}
    path = os.path.join(args.dir, "nope0-no-gate.json")
    with open(path, "w") as f:
        json.dump(plain, f)
    gated = os.path.join(args.dir, "weights-nope0.safetensors")
    p = subprocess.run([args.laga, "forward", "--config", path, "--weights", gated, "--seq", "4"],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=60)
    if p.returncode != 2 or "mla_use_output_gate is false" not in p.stderr:
        sys.exit(f"FAIL: laga forward with the gate's weight and no gate: exit {p.returncode}, "
                 f"{p.stderr.strip()}")
    w = {k: torch.from_numpy(v) for k, v in safetensors_io.load_file(gated)[0].items()}
    for what, cfg, sd, words in (
            ("gated weights, no gate", plain, w, ("wg.weight", "mla_use_output_gate is false")),
            ("gated config, no wg", CONFIGS["nope0"],
             {k: v for k, v in w.items() if k != "wg.weight"},
             ("wg.weight", "g_proj.weight", "mla_use_output_gate"))):
        m = lt.MLA(lt.MLAConfig.from_json(cfg), dtype=torch.float64)
        try:
            m.load_state_dict(sd)
        except ValueError as e:
            if not all(t in str(e) for t in words):
                sys.exit(f"FAIL: {what}: the refusal does not name {words}: {e}")
            continue
        except Exception as e:  # noqa: BLE001: a raw exception is a failure to report
            sys.exit(f"FAIL: {what}: {type(e).__name__} (not a ValueError): {e}")
        sys.exit(f"FAIL: {what}: load_state_dict accepted it")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("laga")
    ap.add_argument("dir")
    ap.add_argument("--sp", default="1,3")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--port", type=int)
    args = ap.parse_args()
    import laga_torch as lt
    if args.worker:
        return worker(args)
    t0 = time.time()
    os.makedirs(args.dir, exist_ok=True)
    g = torch.Generator().manual_seed(55)
    for name, cfg in CONFIGS.items():
        with open(os.path.join(args.dir, f"{name}.json"), "w") as f:
            json.dump(cfg, f)
        m = lt.MLA(lt.MLAConfig.from_json(cfg), dtype=torch.float64)
        if "wg.weight" not in dict(m.named_parameters()):
            sys.exit(f"FAIL: {name}: mla_use_output_gate gave no wg.weight parameter")
        w = {}
        for n, p in m.named_parameters():  # norms 1 + 0.1 N so that ignoring one fails
            t = torch.randn(p.shape, generator=g, dtype=torch.float64)
            w[n] = (1 + 0.1 * t if "norm" in n else t / p.shape[-1] ** 0.5).numpy()
        safetensors_io.save_file(w, os.path.join(args.dir, f"weights-{name}.safetensors"))
        # Kimi's name for the gate (modeling_kimi_linear.py's g_proj) loads the same module.
        hf = {("g_proj.weight" if k == "wg.weight" else k): torch.from_numpy(v)
              for k, v in w.items()}
        m.load_state_dict(hf)
        if not torch.equal(m.wg.weight, torch.from_numpy(w["wg.weight"])):
            sys.exit(f"FAIL: {name}: g_proj.weight did not load into wg.weight")
    refusals(lt, args)
    inp = {"x": torch.randn(B, S, BASE["dim"], generator=g, dtype=torch.float64).numpy(),
           "dout": torch.randn(B, S, BASE["dim"], generator=g, dtype=torch.float64).numpy()}
    safetensors_io.save_file(inp, os.path.join(args.dir, "input.safetensors"))
    sps = [int(p) for p in args.sp.split(",")]

    def fail(msg):
        sys.exit(f"FAIL: {msg}")
    for P in sps:
        run_ranks(__file__, [args.laga, args.dir, "--worker"], P, 200, fail, "gated NoPE ranks")
    worst = {"float64": 0.0, "float32": 0.0, "explicit P1": 0.0}
    checked = 0
    ref_p1 = {}
    for P in sps:
        for case in cases(lt):
            for dt in TOLS:
                ref_path = os.path.join(args.dir, f"cxx-{dt}-{case['id']}-P{P}.safetensors")
                cmd = [args.laga, "forward", "--config",
                       os.path.join(args.dir, case["cfg"] + ".json"), "--weights",
                       os.path.join(args.dir, f"weights-{case['cfg']}.safetensors"), "--input",
                       os.path.join(args.dir, "input.safetensors"), "--backward", "--dtype", dt,
                       "--sp", str(P), "--attention", "flash", "--form", case["form"],
                       "--output", ref_path]
                if case["opts"].get("q_latent"):
                    cmd.append("--q-latent")
                if case["opts"].get("overlap"):
                    cmd += ["--overlap", "on"]
                if case["docs"]:
                    cmd += ["--doc-lens", "/".join(",".join(str(e - s) for s, e in zip(d, d[1:]))
                                                   for d in case["docs"])]
                run(cmd)
                ref, _ = safetensors_io.load_file(ref_path)
                for tag in [t for t, dtype, _ in RUNS if (dtype == torch.float64) ==
                            (dt == "float64")]:
                    mine = assemble(lt, args.dir, tag, case, P)
                    if set(mine) != set(ref):
                        fail(f"{case['id']} P {P} {tag}: torch gives {sorted(mine)}, C++ "
                             f"{sorted(ref)}")
                    for k in ref:
                        e = rel(mine[k], ref[k])
                        worst[dt] = max(worst[dt], e)
                        checked += 1
                        if not e <= TOLS[dt]:
                            fail(f"{case['id']} P {P} {tag}: {k} differs from `laga forward` "
                                 f"by {e:.3e} relative (> {TOLS[dt]})")
                    if tag != "f64":
                        continue
                    key = (case["cfg"], bool(case["docs"]))
                    if case["form"] == "explicit" and P == sps[0] and not case["opts"]:
                        ref_p1[key] = mine
                    elif key in ref_p1:  # the package's latent forms against its explicit
                        for k, v in ref_p1[key].items():
                            e = rel(mine[k], v)
                            worst["explicit P1"] = max(worst["explicit P1"], e)
                            if not e <= 1e-12:
                                fail(f"{case['id']} P {P}: {k} differs from the package's "
                                     f"explicit at P {sps[0]} by {e:.3e} (> 1e-12)")
    # What laga's tape keeps for backward (float32, with the output) against
    # `laga compare`'s closed form (flash), at the rank compare names: the
    # gate's logits (B L H dv) included on both sides.
    n_kept = 0
    for P in sps:
        per_rank = [json.load(open(os.path.join(args.dir, f"kept-P{P}-r{r}.json")))
                    for r in range(P)]
        for cfg in CONFIGS:
            cmd = [args.laga, "compare", "--config", os.path.join(args.dir, cfg + ".json"),
                   "--batch", str(B), "--seq", str(S), "--sp", str(P), "--count-only",
                   "--forms", ",".join(lt.FORMS), "--attention", "flash", "--json", "-"]
            if CONFIGS[cfg]["q_lora_rank"]:
                cmd += ["--q-latent", "--overlap", "both"]
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               timeout=120)
            if p.returncode != 0:
                fail(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr}")
            forms = {f["form"]: f for f in json.loads(p.stdout)["forms"]}
            for case in [c for c in cases(lt) if c["cfg"] == cfg and not c["docs"]]:
                f = forms[case["form"]]
                got = per_rank[f["peak_rank"]][case["id"]]
                want = f["predicted_saved_after_forward_bytes"]
                if case["form"] == "absorbed" and CONFIGS[cfg]["qk_rope_head_dim"] == 0:
                    # absorbed's values v_lat = lat[..., :C].contiguous() (tape.py)
                    # are lat itself at dr 0, one storage: the C++ copy, B S C
                    # float32 elements, is not kept
                    want -= B * S * CONFIGS[cfg]["kv_lora_rank"] * 4
                if got != want:
                    fail(f"{case['id']} P {P}: rank {f['peak_rank']} keeps {got} bytes for "
                         f"backward (with the output), not {want} (the C++ closed form "
                         f"{f['predicted_saved_after_forward_bytes']})")
                n_kept += 1
    triton = triton_fused(lt, args.dir)
    print(f"ok: gated NoPE MLA (mla_use_nope dr 4, qk_rope_head_dim 0; output gate) in "
          f"laga_torch, {len(cases(lt))} cases at P {args.sp}, {checked} tensors against `laga "
          f"forward`: float64 within {worst['float64']:.1e} (<= 1e-12), float32 within "
          f"{worst['float32']:.1e} (<= 1e-5); every form within {worst['explicit P1']:.1e} of "
          f"explicit in float64; {n_kept} runs keep compare's closed form bytes; {triton}; torch {torch.__version__}, "
          f"{time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
