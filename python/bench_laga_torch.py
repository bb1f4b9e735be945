#!/usr/bin/python3
"""laga_torch per form at P 1 and 2 on this machine, beside `laga compare` on
the same config (a benchmark, not a test: it asserts nothing).

    /usr/bin/python3 python/bench_laga_torch.py --laga build/laga [--seq 512 --steps 5]
                                                [--seq-layout contiguous|zigzag]

Per form and P: the median wall time of forward+backward (float32, ranks as
processes on gloo, cores split between them), the C++ tool's step time from
`laga compare --attention eager` at the same shapes, and the bytes autograd
keeps for backward on the rank compare reports as its peak (saved_tensors_hooks;
parameters and the input shard left out, each storage once) beside the C++
closed form (compare's predicted_saved_after_forward_bytes, which also
counts the output). MLA keeps what the C++ tape keeps (laga_torch.tape), so
the ratio is 1 (tools_torch_package holds it equal at small shapes); the
column shows it at these (docs/pytorch.md).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

CONFIG = {"dim": 512, "n_heads": 8, "q_lora_rank": 0, "kv_lora_rank": 128,
          "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "max_seq_len": 4096}


def rank_main(a):
    import torch
    import torch.distributed as dist
    import laga_torch as lt
    P, r = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // P))
    dist.init_process_group("gloo")
    cfg = lt.MLAConfig.from_json(CONFIG)
    lay = lt.SpLayout.even(a.seq, cfg.n_heads, P, a.seq_layout)
    L = lay.seq_count[r]
    out = {}
    for form in lt.FORMS:
        torch.manual_seed(0)
        m = lt.MLA(cfg, form=form, attention="math", seq_layout=a.seq_layout)
        x = torch.randn(a.batch, L, cfg.dim, requires_grad=True)
        params = {p.data_ptr() for p in m.parameters()}
        saved = {}

        def pack(t):
            s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            if s.data_ptr() not in params and s.data_ptr() != x.data_ptr():
                saved[s.data_ptr()] = s.nbytes()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = m(x, seq_len=a.seq)
        y.sum().backward()
        times = []
        for _ in range(a.steps):
            dist.barrier()
            t0 = time.perf_counter()
            m(x, seq_len=a.seq).sum().backward()
            dist.barrier()
            times.append((time.perf_counter() - t0) * 1e3)
        out[form] = {"ms": statistics.median(times), "saved": sum(saved.values()),
                     "out": y.numel() * y.element_size()}
    with open(os.path.join(a.dir, f"bench-P{P}-r{r}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--laga", default="build/laga")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/bench_laga_torch")
    ap.add_argument("--seq-layout", default="contiguous", choices=("contiguous", "zigzag"),
                    help="the shards of both (MLA seq_layout, laga --seq-layout)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank:
        return rank_main(a)
    from laga_torch import FORMS  # every form of the package's registry
    os.makedirs(a.dir, exist_ok=True)
    cfg_path = os.path.join(a.dir, "config.json")
    json.dump(CONFIG, open(cfg_path, "w"))
    lscpu = subprocess.run(["lscpu"], stdout=subprocess.PIPE, text=True).stdout
    model = [l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")]
    print(f"# {' '.join(sys.argv)}\n# CPU: {model[0] if model else '?'}, {os.cpu_count()} cores; "
          f"config {CONFIG}, B {a.batch} S {a.seq}, {a.seq_layout} shards, float32, eager/math "
          "attention\n")
    print(f"{'form':12} {'P':>2} {'torch ms':>9} {'laga ms':>8}  {'torch saved B':>13} "
          f"{'C++ saved+out B':>15} {'ratio':>6}")
    for P in (1, 2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", "--seq", str(a.seq),
                                   "--batch", str(a.batch), "--steps", str(a.steps),
                                   "--dir", a.dir, "--seq-layout", a.seq_layout],
                                  env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(P),
                                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
                 for r in range(P)]
        if any(p.wait() for p in procs):
            sys.exit(f"bench: a rank at P {P} failed")
        torch_res = [json.load(open(os.path.join(a.dir, f"bench-P{P}-r{r}.json")))
                     for r in range(P)]
        c = subprocess.run([a.laga, "compare", "--config", cfg_path, "--seq", str(a.seq),
                            "--batch", str(a.batch), "--sp", str(P), "--forms", ",".join(FORMS),
                            "--attention", "eager", "--steps", str(a.steps),
                            "--seq-layout", a.seq_layout, "--json", "-"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                           check=True)
        cmp_forms = {f["form"]: f for f in json.loads(c.stdout)["forms"]}
        for form in FORMS:
            f = cmp_forms[form]
            mine = torch_res[f["peak_rank"]][form]
            ms = max(t[form]["ms"] for t in torch_res)
            torch_saved = mine["saved"] + mine["out"]
            print(f"{form:12} {P:>2} {ms:9.1f} {f['step_ms']:8.1f}  {torch_saved:13d} "
                  f"{f['predicted_saved_after_forward_bytes']:15d} "
                  f"{torch_saved / f['predicted_saved_after_forward_bytes']:6.2f}")


if __name__ == "__main__":
    main()
