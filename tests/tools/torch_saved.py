"""What a laga_torch module keeps for backward, in bytes (tools_torch_package)."""

import torch


class saved_by(set):
    """What autograd keeps for backward, in bytes, each storage once, less the
    parameters and the input shard (live before forward: the C++ closed form
    leaves them out too). add() is the pack hook (save_for_backward);
    add_ctx() adds what the graph's custom Functions keep as ctx attributes
    outside it (found by walking the graph: a tensor stashed at ctx.foo is
    memory kept all the same). fp32: {name: elements} of the fp32 tensors
    kept (a bf16 run keeps bf16, but flash's lse)."""

    def __init__(self, module, x):
        super().__init__()
        self.skip = {p.data_ptr() for p in module.parameters()} | {x.data_ptr()}
        self.fp32 = {}

    @staticmethod
    def _storage(t):
        # torch 2.x: untyped_storage (storage() warns there); 1.13: storage()
        return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()

    def add(self, t, name=None):
        st = self._storage(t)
        if st.data_ptr() not in self.skip:
            set.add(self, (st.data_ptr(), st.nbytes()))
            if name and t.dtype == torch.float32 and ("fp32", st.data_ptr()) not in self.skip:
                self.skip.add(("fp32", st.data_ptr()))
                self.fp32[name] = self.fp32.get(name, 0) + st.nbytes() // 4
        return t

    def add_ctx(self, out):
        """Every floating or bool tensor reachable from the ctx attributes of
        the custom Functions in out's graph (through lists, dicts and the
        package's own objects), but the index metadata (integer tensors:
        document starts, positions, key ranges) and the RoPE tables (Sp's
        cos and sin, (S, dr/2), built per call from the config)."""
        seen, nodes, stack = set(), set(), [out.grad_fn]
        while stack:
            n = stack.pop()
            if n is None or n in nodes:
                continue
            nodes.add(n)
            stack += [f for f, _ in n.next_functions]
            if isinstance(n, torch.autograd.function.BackwardCFunction):
                self._walk(vars(n), type(n).__name__, seen, 0)
                if hasattr(n, "run") and hasattr(n, "names"):  # laga's tape: saved by name
                    for t, name in zip(n.saved_tensors, ["x"] + n.run.names + n.names):
                        if t.is_floating_point():
                            self.add(t, name)
                        else:
                            self.fp32["(not floating) " + name] = t.numel()

    def _walk(self, obj, path, seen, depth):
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if (obj.is_floating_point() or obj.dtype == torch.bool) and \
                    not path.endswith((".cos", ".sin")):
                self.add(obj, path)
            return
        if isinstance(obj, dict):
            items = obj.items()
        elif isinstance(obj, (list, tuple)):
            items = enumerate(obj)
        elif type(obj).__module__.startswith("laga_torch"):
            items = vars(obj).items() if hasattr(obj, "__dict__") else ()
        else:
            return
        for k, v in items:
            self._walk(v, f"{path}.{k}", seen, depth + 1)
