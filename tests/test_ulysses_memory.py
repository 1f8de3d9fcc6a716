"""Ulysses' memory a rank against one process's (issue 51's bar: <= 0.27 of one GPU's
peak at world 4), on the CPU: the peak bytes of live tensor storage over forward +
backward, inputs included, tracked by a TorchDispatchMode (the Triton interpreter's own
copies of kernel arguments are not counted: a GPU makes none). The single-process call
on the full sequence against rank 0 of strategy="ulysses" at world 4 (gloo), the query
heads in groups as "auto" picks them at long sequences. On the CPU the single call's
peak is a smaller multiple of its inputs than on a GPU (no Gluon buffers), so the bound
here is looser than the GPU bar; the code before the head groups measured 0.67."""
import json
import os
import sys
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPE = (512, 16, 4, 64)  # N, H_q, H_kv, d: big enough that fixed costs do not dominate


class LiveBytes:
    """A TorchDispatchMode factory: peak bytes of the storages that ops made, alive."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        tracker = self
        self.count, self.bytes, self.now, self.peak, self.off = {}, {}, 0, 0, 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not tracker.off:
                    for t in tree_flatten(out)[0]:
                        if isinstance(t, torch.Tensor):
                            tracker.track(t)
                return out

        self.mode = Mode()

    def track(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if not key:
            return
        if key not in self.count:
            self.count[key], self.bytes[key] = 0, storage.nbytes()
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        self.count[key] += 1
        weakref.finalize(t, self.drop, key)

    def drop(self, key):
        self.count[key] -= 1
        if not self.count[key]:
            self.now -= self.bytes.pop(key)
            del self.count[key]


def peak_bytes(rank, world, store, out):
    import torch.distributed as dist
    import triton.runtime.interpreter as interp

    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
    torch.set_num_threads(1)
    from generated import mods_attn as pkg

    live = LiveBytes()
    launch = interp.GridExecutor.__call__

    def quiet(self, *a, **k):
        live.off += 1
        try:
            return launch(self, *a, **k)
        finally:
            live.off -= 1

    interp.GridExecutor.__call__ = quiet
    n, h, hk, d = SHAPE
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, n, x, d, generator=g).bfloat16() for x in (h, hk, hk, h)]
    with live.mode:
        q, k, v, do = ((t.clone() for t in full) if world == 1 else
                       (pkg.shard(t, rank, world) for t in full))
        for t in (q, k, v):
            t.requires_grad_()
        if world == 1:
            o = pkg.flash_attn_func(q, k, v, causal=True)
        else:
            o = pkg.ring_flash_attn_func(q, k, v, causal=True, strategy="ulysses")
        o.backward(do)
    if rank == 0:
        Path(out).write_text(json.dumps(live.peak))


def _run(world, tmp_path):
    import subprocess

    out = tmp_path / f"peak{world}.json"
    code = ("import sys, torch.multiprocessing as mp; sys.path[:0] = sys.argv[1:3]; "
            "import test_ulysses_memory as t; w = int(sys.argv[3]); "
            "t.peak_bytes(0, 1, sys.argv[4], sys.argv[5]) if w == 1 else "
            "mp.spawn(t.peak_bytes, args=(w, sys.argv[4], sys.argv[5]), nprocs=w)")
    # "auto" groups at these sizes would be one: force a group per query head, as auto
    # picks at 256k tokens (64 MiB a head)
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
               FLASHGEN_CP_HEAD_GROUPS=str(SHAPE[1] // world))
    subprocess.run([sys.executable, "-c", code, str(ROOT), str(Path(__file__).parent),
                    str(world), str(tmp_path / f"store{world}"), str(out)],
                   env=env, check=True, timeout=900)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_ulysses_peak_memory_a_rank(tmp_path):
    one, rank = _run(1, tmp_path), _run(4, tmp_path)
    # measured: 0.42 (0.67 before the head groups and the shards-only saved state)
    assert rank <= 0.5 * one, (rank, one, rank / one)
