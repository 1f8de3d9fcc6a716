"""Every Gluon-family config of a forward study, timed, against the tuned winner.

`flashgen tune` gives each (variant, bucket) study a share of a time budget; this measures
the whole Gluon part of the same space (block_n x ring depth x pingpong x l2_share, what
fits in shared memory) with the tuner's own workload, then re-times the best of it and the
tuning file's winner back to back, so the ratio does not mix measurements minutes apart.

    python benchmarks/gluon_grid.py specs/llama.yaml fwd_causal_d128_bf16@4096 fwd_d128_bf16@16384
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("studies", nargs="+", help="variant@bucket")
    ap.add_argument("--rounds", type=int, default=5, help="back-to-back re-timing rounds")
    args = ap.parse_args(argv)

    import torch

    from flashgen.measure import _fmt_config
    from flashgen.spec import load_spec
    from flashgen.tune import _import_built, _space, gpu_info, gpu_measure

    spec = load_spec(args.spec)
    with tempfile.TemporaryDirectory(prefix="flashgen-grid-") as tmp:
        pkg = _import_built(spec, Path(tmp))
        device = torch.device("cuda", 0)
        gpu = gpu_info(pkg, device)
        registry = pkg._registry.VARIANTS
        print(f"# {gpu.key}")
        for study in args.studies:
            name, bucket = study.split("@")
            bucket = int(bucket)
            space = _space(registry[name]["kind"], registry[name], gpu)
            tuned = pkg._registry.TUNED.get(gpu.key, {}).get(name, {}).get(bucket)
            if tuned is None:
                print(f"{study}: no tuned entry for this GPU")
                continue
            tuned = space.config(tuned)
            points = [p for p in space.points() if p["family"] == "gluon"]
            workload = gpu_measure(pkg, name, bucket, device, spec=spec, default=space.default())
            try:
                times = []
                for p in points:
                    ms = workload(p)
                    if not isinstance(ms, float):  # a WrongAnswer: reported, never ranked
                        print(f"{study}: {ms} {_fmt_config(p)}", flush=True)
                        continue
                    times.append((ms, p))
                    print(f"{study}: {ms:.4f} ms {_fmt_config(p)}", flush=True)
                times.sort(key=lambda t: t[0])
                best = times[0][1]
                # back to back: the grid's best and the tuned winner, alternating
                a, b = [], []
                for _ in range(args.rounds):
                    a.append(workload(best))
                    b.append(workload(tuned))
                ma, mb = statistics.median(a), statistics.median(b)
                print(f"{study}: grid best {ma:.4f} ms [{_fmt_config(best)}], tuned {mb:.4f} ms "
                      f"[{_fmt_config(tuned)}]: tuned / best = {mb / ma:.3f} "
                      f"({len(points)} Gluon points)", flush=True)
            finally:
                workload.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
