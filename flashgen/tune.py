"""Stage 5, tune: `flashgen tune` searches each kernel variant's launch configs on the GPU
it runs on, with Optuna, and writes the winners as data (flashgen/tuning_data.py) that the
next `flashgen build` embeds into the package's TUNED table.

* One Optuna study per (variant, sequence-length bucket, GPU model), named
  ``<variant>@<bucket>@<gpu-key-slug>``, in a persistent storage (default
  ``sqlite:///<repo>/.flashgen/tune.db``): an interrupted tune resumes where it stopped,
  and ``--trials N`` means N completed trials per study in total, over every run.
* The search space (flashgen/space.py) is the planner's feasible set for this GPU's real
  shared memory, times the kind's template knobs. The sampler (:class:`FeasibleSampler`,
  Optuna's TPE underneath) only ever proposes feasible points that have not been measured,
  so no infeasible config is launched and no trial is wasted on a repeat.
* Warm starts: the planner's config for this GPU (whose time is reported as "default"),
  the Gluon family's untuned config where the variant has a Gluon kernel here (forward or
  backward) and the spec's explicit tile are enqueued first, once.
* A trial checks the config's output against a float64 reference on fresh random inputs at
  a small shape (a wrong answer fails the trial, with the reason, and is never chosen),
  then times it with CUDA events (triton.testing.do_bench, median, L2 flushed) at a shape
  that fills the GPU: B*N = 16k tokens, H*d = 2048 (as `flashgen bench`'s training suite).
  Compile errors, out-of-resources and wrong answers fail the trial; the study goes on.
* A variant with mods is tuned as any other, under its own name: its check and timing call
  the package as a user does, `mods=(...)` with the mods' tensors and params, valued as a
  model passes them (bench.mods.call_inputs: documents of random lengths, prefixes of
  N/8..N/2 tokens, ...; a block-sparse kernel's speed depends on the mask), and the float64
  reference applies the same mods. A mask mod's backward searches `persistent_bwd` (its
  persistent Gluon form or a program per key block). Until it is tuned a variant with mods
  runs its base variant's tuned configs (its first warm start). Decode variants with mods
  are skipped (the decode measure makes no mod inputs yet).

The measurement is injectable: ``tune_study(..., measure=callable)``; the tests use a
synthetic cost on the CPU, and :func:`gpu_measure` (flashgen/measure.py, with the check and
the timing) is what `flashgen tune` uses. One study -- its storage, the sampler, the trial
loop and the confirmation round -- is flashgen/study.py; this module runs `flashgen tune`.
"""
from __future__ import annotations

import fnmatch
import importlib
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from . import __version__, families, planner_core, tuning_data
from .errors import FlashgenError
from .measure import Measure, TuneAborted, WrongAnswer, _fmt_config, _reason, gpu_measure
from .progress import Progress
from .space import TILE_PARAMS, Space, space_for
# one study's names (flashgen/study.py): those not used here stay importable from here
from .study import (ATTR_BEFORE, ATTR_CONFIRMED, ATTR_FAIL, ATTR_INFEASIBLE, ATTR_WARM,
                    CONFIRM_ROUNDS, CONFIRM_TOP, INTERRUPTED, SAMPLERS, StudyResult, _RECENT_S,
                    _before, _distance, _finished, _fmt_eta, _optuna, _trial_seconds, confirm,
                    default_storage, feasible_sampler, measured_keys, open_storage,
                    project_root, study_name, summarize, tune_study, unmeasured)

DEFAULT_TRIALS = 30
DEFAULT_BUDGET = 840.0     # seconds for a whole `flashgen tune` run (spec under 15 min)


MEASURED_KINDS = ("fwd", "bwd", "decode")


# ----------------------------------------------------------------------------------------
# `flashgen tune`
# ----------------------------------------------------------------------------------------

@dataclass
class GpuInfo:
    key: str
    name: str
    capability: tuple[int, int]
    sm_count: int
    sram_bytes: int

    def as_json(self) -> dict:
        return {"name": self.name, "capability": list(self.capability),
                "sm_count": self.sm_count, "key": self.key}


def require_cuda():
    import torch

    if not torch.cuda.is_available():
        raise FlashgenError(
            "flashgen tune times kernels on a CUDA GPU and this machine has none "
            "(torch.cuda.is_available() is False); run it on the GPU machine, where the "
            "results land in specs/tuning/<package>/ for `flashgen build` (`flashgen check` "
            "verifies kernels without a GPU)")
    return torch


def gpu_info(pkg, device) -> GpuInfo:
    import torch

    key, smem, sms = pkg._runtime.gpu_key(device)
    props = torch.cuda.get_device_properties(device)
    return GpuInfo(key=key, name=props.name, capability=(props.major, props.minor),
                   sm_count=sms, sram_bytes=smem)


def versions() -> dict:
    import torch
    import triton

    return {"triton": triton.__version__, "torch": torch.__version__.split("+")[0],
            "flashgen": __version__}


def select_variants(registry: Mapping, patterns: Sequence[str] | None, say) -> list[str]:
    """The variants to tune: all (or those matching `patterns`, fnmatch-style), of kinds
    the tuner can measure."""
    names = list(registry)
    if patterns:
        chosen = []
        for pattern in patterns:
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not hits:
                raise FlashgenError(f"--variants {pattern}: no such variant; the package has "
                                    f"{', '.join(names)}")
            chosen += [h for h in hits if h not in chosen]
        names = [n for n in names if n in chosen]
    out = []
    for n in names:
        kind = registry[n]["kind"]
        if kind not in MEASURED_KINDS:
            say(f"{n}: skipped, `flashgen tune` cannot measure {kind} kernels yet")
            continue
        if kind == "decode" and registry[n].get("mods"):
            # (the forward and backward with mods are measured with their mod inputs:
            # measure.Workload)
            say(f"{n}: skipped, the decode measure makes no mod inputs yet (a decode call's "
                "q_idx is its cache position; the variant runs its base variant's tuned "
                "config)")
            continue
        out.append(n)
    return out


def select_buckets(spec, buckets: Sequence[int] | None) -> list[int]:
    if not buckets:
        return list(spec.seqlen_buckets)
    bad = [b for b in buckets if b not in spec.seqlen_buckets]
    if bad:
        raise FlashgenError(f"--buckets {' '.join(map(str, bad))}: not among the spec's "
                            f"seqlen_buckets {list(spec.seqlen_buckets)}; dispatch keys on "
                            "those, so tune those (or add the bucket to the spec)")
    return sorted(set(buckets))


def _import_built(spec, folder: Path):
    from .build import build_spec

    build_spec(spec, folder)
    for name in [m for m in sys.modules if m == spec.package or m.startswith(spec.package + ".")]:
        del sys.modules[name]
    sys.path.insert(0, str(folder))
    importlib.invalidate_caches()
    try:
        return importlib.import_module(spec.package)
    finally:
        sys.path.remove(str(folder))


def _space(kind, facts, gpu: GpuInfo, mod_kinds=(), no_gluon: str | None = None) -> Space:
    """The variant's search space on this GPU; mod_kinds: the kinds of its mods (a mask mod
    makes the kernels block-sparse: no stream-K point, and the backward's persistent_bwd
    knob); no_gluon: why the package has no Gluon kernel for this variant (its registry's
    GLUON entry, e.g. mods reading a [q, kv] tile), None when it has one. The planner's
    tiles count the shared memory a mod's [q, kv] tile takes (the registry's score_bytes),
    as the package plans them."""
    from .variants import DTYPE_BYTES

    consumers = (families.fwd_consumer_counts(facts["head_dim"],
                                              bool(facts.get("dropout") or facts.get("mods")))
                 if kind == "fwd" else (families.CONSUMERS,))
    # tiles are planned for the larger of Q's and V's head dims, as the package plans them
    # (an MLA variant's V has its own: the Gluon forward's points count each, v_head_dim)
    plan_dim = max(facts["head_dim"], facts.get("v_head_dim") or 0)
    return space_for(kind, plan_dim, DTYPE_BYTES[facts["dtype"]], gpu.sram_bytes,
                     gpu.sm_count, gpu.capability,
                     gluon=no_gluon or gluon_here(kind, facts, gpu),
                     mask=facts.get("mask"), block_sparse="mask" in mod_kinds,
                     consumers=consumers, score_bytes=facts.get("score_bytes", 0),
                     v_head_dim=facts.get("v_head_dim"))



def gluon_here(kind, facts, gpu: GpuInfo) -> str | None:
    """Why this variant cannot run a Gluon kernel on this GPU with this Triton (None when
    it can, and the tuner then measures both families)."""
    import torch
    import triton

    reason = families.gluon_reason(kind, facts.get("dropout", False), facts["head_dim"],
                                   facts["dtype"], facts.get("v_head_dim"))
    if (reason is None and kind == "bwd" and not families.GLUON_BWD_LARGE_DEFAULT
            and families.large_bwd(facts["head_dim"], facts.get("v_head_dim"))):
        # (switched off where the package is used: families.LARGE_HEAD_DIM_BWD)
        reason = ("the large head dims' Gluon backward is switched off "
                  "(FLASHGEN_GLUON_BWD_LARGE=0)")
    if (reason is None and kind == "bwd" and not families.D512_BWD_ON
            and families.is_d512_bwd(facts["head_dim"], facts.get("v_head_dim"))):
        # (switched off where the package is used: a tuned entry would route calls to it)
        reason = f"the Q/K 512 Gluon backward is {families.D512_BWD_OFF_REASON}"
    if reason is None and kind == "bwd" and torch.are_deterministic_algorithms_enabled():
        # the package sends such a call to `tl` (runtime.gluon_backward_reason): a Gluon
        # point would time the planner's `tl` kernels under the Gluon family's name
        reason = ("torch.use_deterministic_algorithms(True): the Gluon backward adds dQ in "
                  "no fixed order, the `tl` backward serves these calls")
    if reason is None and tuple(gpu.capability) not in families.GLUON_CAPABILITIES:
        reason = f"sm{gpu.capability[0]}{gpu.capability[1]}: the Gluon kernels are for sm90"
    if reason is None and not families.triton_ok(triton.__version__):
        reason = f"Triton {triton.__version__}: the Gluon kernels are verified on {families.GLUON_TRITON}"
    return reason


def parse_try(text: str) -> dict:
    """A `--try` config, "64x128w8s3" or "64x128w8s3:dq_tile=128x64w8s3,tma=1": a tile and
    optional knob values, the latter still strings (each space reads them, see _try_config)."""
    tile, _, knobs = text.partition(":")
    try:
        cfg: dict = dict(zip(TILE_PARAMS, planner_core.parse_tile(tile)))
    except ValueError as e:
        raise FlashgenError(f"--try {text!r}: {e}, optionally followed by :knob=value,...") from None
    for item in filter(None, (x.strip() for x in knobs.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name or not value:
            raise FlashgenError(f"--try {text!r}: knob setting {item!r} is not name=value")
        cfg[name] = value
    return cfg


def _try_config(space: Space, raw: Mapping) -> dict | None:
    """`raw` (from parse_try) as a point of `space`, or None when it names a knob this kind
    does not have or a value the knob does not take."""
    out = {}
    for name, value in raw.items():
        if name not in space.names:
            return None
        if isinstance(value, str):
            match = [c for c in space.choices(name) if str(c).lower() == value.lower() or
                     (isinstance(c, bool) and value.lower() in (("1", "true") if c else ("0", "false")))]
            if not match:
                return None
            value = match[0]
        out[name] = value
    return space.config(out)


def _warm_starts(spec, kind: str, space: Space, *, incumbent: Mapping | None = None,
                 tries: Sequence[Mapping] = (), variant: Mapping | None = None,
                 bucket: int | None = None, mod_kinds: Sequence[str] = (),
                 inherited: bool = False) -> list:
    """What a study measures first: the config the package runs today at this bucket
    ("tuned": the tuning file's entry as the runtime reads it, so a re-tune starts from the
    last winner and cannot end slower -- and a budgeted run, whose first phase measures
    only each study's first warm start, never writes a config it did not compare with what
    it replaces; with no entry, the Gluon default where the package runs it untuned), then
    the planner's config, the Gluon family's untuned config of this kind
    (where the space holds the family), the spec's explicit tile, the stored entry itself
    where the runtime reads it otherwise ("stored"), and the run's `--try` configs.

    An entry tuned before the `family` knob is run by the package as the Gluon default on a
    GPU and Triton the Gluon kernels run on, where families.gluon_by_default says so
    (runtime.launch_config); its "tuned" start is that config. A Gluon entry where the
    variant cannot run its Gluon kernel (space.facts.gluon) is run as the planner's `tl`
    config, and that is its "tuned" start.

    A variant with mods (`mod_kinds`: their kinds) that has no entry of its own runs its
    base variant's (`incumbent` with `inherited`, started as "base's tuned"), but not a
    Gluon one where its own Gluon kernel is not the default (as runtime.launch_config)."""
    v = variant or {}
    has_family = any(k.name == "family" for k in space.knobs)
    gluon_cfg = None
    if space.facts.gluon is None and has_family:
        # the Gluon family's untuned config of this kind (the backward's: 64 query rows a
        # step, 2 x 64 keys, a 2-deep ring): on Hopper the package's default launch where
        # families.gluon_by_default says so
        gluon_cfg = space.config(families.variant_gluon_default(
            {**v, "head_dim": space.facts.head_dim, "kind": kind, "mask": v.get("mask")},
            bucket))
    # (a variant with mods whose kinds the caller did not give: as `tl` by default)
    default = ((not v.get("mods") or bool(mod_kinds))
               and families.gluon_by_default(kind, bool(v.get("dropout")),
                                             space.facts.head_dim, tuple(mod_kinds), bucket,
                                             str(v.get("dtype", ""))))
    gluon_runs = gluon_cfg is not None and default
    if inherited and incumbent is not None and incumbent.get("family") == "gluon" and not default:
        incumbent = None  # the base variant's Gluon winner does not carry over
    current = stored = None
    if incumbent is not None:
        current = stored = space.config(incumbent)
        if "family" not in incumbent and gluon_runs:
            current = gluon_cfg
        elif current.get("family") == "gluon" and space.facts.gluon is not None:
            current = space.default()  # no Gluon kernel here: the planner's `tl` config runs
    starts = [("base's tuned" if inherited else "tuned", current)] if current is not None else []
    if gluon_runs and incumbent is None:
        # untuned, the package runs the Gluon default here: that is the first to measure
        starts.append(("gluon", gluon_cfg))
    starts.append(("planner", space.default()))
    if gluon_cfg is not None and not (gluon_runs and incumbent is None):
        starts.append(("gluon", gluon_cfg))
    explicit = getattr(spec.blocks, {"fwd": "forward", "bwd": "backward",
                                     "decode": "decode"}[kind], None)
    if explicit is not None:
        starts.append(("spec", {"block_m": explicit.block_m, "block_n": explicit.block_n,
                                "num_warps": explicit.num_warps,
                                "num_stages": explicit.num_stages}))
    if stored is not None and stored != current:
        starts.append(("stored", stored))
    for raw in tries:
        cfg = _try_config(space, raw)
        if cfg is not None:
            starts.append(("try", cfg))
    return starts


def _incumbent(incumbents: Mapping, name: str, facts: Mapping,
               bucket: int) -> tuple[dict | None, bool]:
    """(the tuning file's entry the package runs for `name` at `bucket`, whether it is its
    base variant's): a variant with mods and no entries of its own runs its base variant's
    (the variant without the mods; runtime.launch_config)."""
    if name in incumbents or not facts.get("mods"):
        return incumbents.get(name, {}).get(str(bucket)), False
    from .variants import Variant

    base = Variant(facts["kind"], facts["mask"], bool(facts.get("dropout")), facts["head_dim"],
                   facts["dtype"], (), facts.get("v_head_dim")).name
    entry = incumbents.get(base, {}).get(str(bucket))
    return entry, entry is not None


def _incumbents(spec, gpu_key: str) -> dict:
    """{variant: {bucket: entry}} of the spec's tuning file for this GPU ({} if none)."""
    path = tuning_data.tuning_path(spec, gpu_key)
    if not path.exists():
        return {}
    try:
        return tuning_data.read(path).get("configs", {})
    except (OSError, ValueError) as e:
        raise FlashgenError(f"{path}: cannot read the tuning file ({e}); restore it from git "
                            "or delete it to tune from scratch") from None


def format_summary(results: Sequence[StudyResult]) -> str:
    # "planner ms" / "vs planner": the planner's `tl` config, the study's fixed reference
    # (on Hopper the untuned package may run a Gluon default that is already faster)
    head = ("variant", "bucket", "planner ms", "before ms", "tuned ms", "vs planner",
            "vs before", "done/failed", "tuned config", "stopped")
    rows = [head]
    for r in results:
        rows.append((
            r.variant, str(r.bucket),
            f"{r.default_ms:.4f}" if r.default_ms else "-",
            f"{r.before_ms:.4f}" if r.before_ms else "-",
            f"{r.best_ms:.4f}" if r.best_ms else "-",
            f"{r.speedup:.3f}x" if r.speedup else "-",
            f"{r.gain:.3f}x" if r.gain else "-",
            f"{r.complete}/{r.failed}", _fmt_config(r.best_config), r.stopped or "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _gpu_names() -> list[str]:
    """The name of every visible GPU (one worker each)."""
    import torch

    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _visible_devices(n: int) -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        ids = [x.strip() for x in env.split(",") if x.strip()]
        return ids[:n]
    return [str(i) for i in range(n)]


def _spawn_workers(args: Sequence[str], n: int, say) -> int:
    """Run `flashgen tune <args> --worker-index i` on GPUs 0..n-1 (one process per GPU,
    CUDA_VISIBLE_DEVICES), all against the same storage; returns how many failed."""
    procs = []
    for i, dev in enumerate(_visible_devices(n)):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=dev, PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-m", "flashgen", "tune", *args, "--worker-index", str(i)]
        say(f"worker {i}: GPU {dev}")
        procs.append(subprocess.Popen(cmd, env=env))
    bad = 0
    try:
        for i, p in enumerate(procs):
            if p.wait() != 0:
                say(f"worker {i} exited with status {p.returncode}")
                bad += 1
    except KeyboardInterrupt:
        for p in procs:
            p.wait()
        raise
    return bad


class Budget:
    """A whole run's time budget (`--budget`), shared out between the studies still to
    run: each study gets the time left divided by the studies left, so a fast study's
    savings go to the later ones and the run ends near the budget (plus the last study's
    confirmation round)."""

    def __init__(self, seconds: float | None, studies: int):
        self.seconds, self.left = seconds, max(studies, 1)
        self.started = time.monotonic()

    def share(self) -> float | None:
        if self.seconds is None:
            return None
        remaining = self.seconds - (time.monotonic() - self.started)
        return max(remaining, 0.0) / max(self.left, 1)

    def spent(self) -> bool:
        return self.seconds is not None and time.monotonic() - self.started >= self.seconds

    def done(self) -> None:
        self.left -= 1


def _min_none(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return min(a, b)


def tune(spec_path, *, trials: int = DEFAULT_TRIALS, timeout: float | None = None,
         budget: float | None = None,
         storage: str | None = None, workers: int = 1, variants: Sequence[str] | None = None,
         buckets: Sequence[int] | None = None, sampler: str = "tpe", seed: int = 0,
         worker_index: int | None = None, say: Callable[[str], None] | None = None,
         write: bool = True, tries: Sequence[str] = (),
         compile_workers: int | None = None) -> list[StudyResult]:
    """`flashgen tune`: returns one StudyResult per (variant, bucket) tuned.
    `compile_workers`: processes that compile each batch of trials ahead of their
    measurement (flashgen/ahead.py; default ahead.default_workers(), 1 = none)."""
    from .spec import load_spec

    say = say or (lambda line: print(line, flush=True))
    if trials < 1:
        raise FlashgenError(f"--trials must be at least 1, got {trials}")
    if workers < 1:
        raise FlashgenError(f"--workers must be at least 1, got {workers}")
    if compile_workers is None:
        from .ahead import default_workers
        compile_workers = default_workers()
    if compile_workers < 1:
        raise FlashgenError(f"--compile-workers must be at least 1, got {compile_workers}")
    if sampler not in SAMPLERS:
        raise FlashgenError(f"--sampler {sampler}: expected one of {', '.join(SAMPLERS)}")
    tried = [parse_try(t) for t in tries]
    spec = load_spec(spec_path)
    torch = require_cuda()
    _optuna()
    url = storage or default_storage()
    store = open_storage(url)
    bucket_list = select_buckets(spec, buckets)
    prefix = f"[worker {worker_index}] " if worker_index is not None else ""
    log = (lambda line: say(prefix + line)) if prefix else say

    with tempfile.TemporaryDirectory(prefix="flashgen-tune-") as tmp:
        pkg = _import_built(spec, Path(tmp))
        device = torch.device("cuda", 0)
        gpu = gpu_info(pkg, device)
        registry = pkg._registry.VARIANTS
        names = select_variants(registry, variants, log)
        if not names:
            raise FlashgenError("nothing to tune: no variant of a kind `flashgen tune` measures")

        if worker_index is None and workers > 1:
            names_by_gpu = _gpu_names()
            count = len(names_by_gpu)
            if workers > count:
                say(f"--workers {workers}: this machine has {count} GPU(s); using {count} "
                    "worker(s), one per GPU")
                workers = count
            others = set(names_by_gpu[:workers])
            if len(others) > 1:
                raise FlashgenError(f"--workers needs identical GPUs, found {sorted(others)}: "
                                    "tune each model separately with CUDA_VISIBLE_DEVICES")
        failed_workers = 0
        spawned = worker_index is None and workers > 1
        if spawned:
            args = [str(spec_path), "--trials", str(trials), "--storage", url,
                    "--sampler", sampler, "--seed", str(seed), "--variants", *names,
                    "--buckets", *map(str, bucket_list)]
            if timeout is not None:
                args += ["--timeout", str(timeout)]
            if tries:
                args += ["--try", *tries]
            args += ["--budget", str(budget or 0), "--compile-workers", str(compile_workers)]
            say(f"tuning {len(names)} variants x {len(bucket_list)} buckets on {workers} "
                f"{gpu.name} GPUs ({gpu.key}), storage {url}")
            failed_workers = _spawn_workers(args, workers, say)
            say("workers done; this process re-times the winners and writes the results")
            # below, with timeout 0, no trial is added: the loop confirms and summarizes

        log(f"tuning {len(names)} variants x {len(bucket_list)} buckets on {gpu.name} "
            f"({gpu.key}, {gpu.sram_bytes} B shared memory per block), {trials} trials per "
            f"study, sampler {sampler}, storage {url}")
        results = []
        skipped = 0
        spaces = {}
        for name in names:
            try:
                spaces[name] = _space(registry[name]["kind"], registry[name], gpu,
                                      pkg._runtime.mod_kinds(name),
                                      pkg._registry.GLUON.get(name))
            except ValueError as e:
                log(f"{name}: skipped, no feasible config on this GPU: {e}")
        studies = [(name, bucket) for name in names if name in spaces for bucket in bucket_list]
        attrs = {"gpu_key": gpu.key, "spec": Path(spec.path).name, "spec_sha": spec.sha,
                 **{f"version_{k}": v for k, v in versions().items()}}

        incumbents = _incumbents(spec, gpu.key)

        def starts_for(name, bucket):
            entry, inherited = _incumbent(incumbents, name, registry[name], bucket)
            return _warm_starts(spec, registry[name]["kind"], spaces[name], incumbent=entry,
                                tries=tried, variant=registry[name], bucket=bucket,
                                mod_kinds=pkg._runtime.mod_kinds(name), inherited=inherited)

        ahead = None
        if compile_workers > 1 and not spawned:
            from .ahead import CompileAhead
            ahead = CompileAhead(Path(tmp), spec.package, spec.path, workers=compile_workers)
            log(f"compiling ahead in {compile_workers} processes, {compile_workers} trials "
                "a batch")

        try:
            def run_study(name, bucket, starts, **kw):
                facts, space = registry[name], spaces[name]
                measure = gpu_measure(pkg, name, bucket, device, spec=spec, default=space.default())
                if ahead is not None:
                    kw.update(prepare=ahead.preparer(name, bucket), batch=ahead.workers)
                try:
                    return tune_study(
                        storage=store, name=study_name(name, bucket, gpu.key), space=space,
                        measure=measure, n_trials=trials, warm_starts=starts, sampler=sampler,
                        seed=seed + (worker_index or 0), progress=log, label=f"{name}@{bucket}",
                        user_attrs={"variant": name, "bucket": bucket, "kind": facts["kind"],
                                    "space_size": len(space), **attrs}, **kw)
                finally:
                    measure.close()

            if budget is not None and not spawned and worker_index is None:
                # Phase 1: every study measures its default config first, so each variant and
                # bucket gets a default-vs-tuned row and the planner's choice is checked on
                # this GPU; at the long buckets a slow variant's single call can take longer
                # than an even share of the budget would give it. Phase 2 shares what is left.
                t0 = time.monotonic()
                for name, bucket in studies:
                    run_study(name, bucket, starts_for(name, bucket),
                              timeout=0, min_trials=1, confirm_top=0)
                log(f"defaults measured for {len(studies)} studies in "
                    f"{time.monotonic() - t0:.0f} s")
                budget = max(budget - (time.monotonic() - t0), 0.0)
            clock = Budget(budget, len(studies))
            # a bar with an ETA over the studies (stderr; one line per study when not a terminal)
            bar = Progress(len(studies), "flashgen tune") if worker_index is None else None
            winners: dict = {}   # (kind, bucket) -> best configs so far, newest first
            previous: dict = {}  # variant -> (bucket, best config) of its last study
            for name, bucket in studies:
                kind = registry[name]["kind"]
                if clock.spent():
                    # the run's time is up: a later study keeps what it has (its default, from
                    # phase 1; a rerun resumes it) and still gets its row and tuning entry
                    log(f"{name}@{bucket}: no more trials, the --budget is spent")
                    skipped += 1
                    starts, kw = [], dict(timeout=0, min_trials=0, confirm_top=0)
                else:
                    # what won nearby is the best first guess: the neighbouring bucket of this
                    # variant, then the same kind's other variants at this bucket
                    starts = starts_for(name, bucket)
                    if name in previous:
                        starts.append((f"best@{previous[name][0]}", previous[name][1]))
                    starts += [("best of " + v, c) for v, c in winners.get((kind, bucket), [])[:2]]
                    kw = dict(timeout=0 if spawned else _min_none(timeout, clock.share()),
                              # a budgeted run re-times fewer configs: the round is not free
                              confirm_top=(0 if worker_index is not None else
                                           CONFIRM_TOP if budget is None else 2),
                              confirm_rounds=CONFIRM_ROUNDS if budget is None else 2,
                              min_trials=1)
                try:
                    result = run_study(name, bucket, starts, **kw)
                finally:
                    clock.done()
                    if bar is not None:
                        bar.advance(f"{name}@{bucket}")
                result.variant, result.bucket = name, bucket
                results.append(result)
                if result.best_config is not None:
                    previous[name] = (bucket, result.best_config)
                    winners.setdefault((kind, bucket), []).insert(0, (name, result.best_config))
                if write and worker_index is None:
                    _write_results(spec, gpu, [result], say)
            if bar is not None:
                bar.close()
            if worker_index is None:
                say("")
                say(format_summary(results))
                if skipped:
                    say(f"{skipped} studies got no trials past their default: the --budget ran "
                        "out; run the same command again to tune them further")
            if failed_workers:
                raise FlashgenError(f"{failed_workers} of {workers} workers failed (see above); "
                                    "rerun the same command to resume")
            return results
        finally:
            if ahead is not None:  # (an interrupted or failed run too)
                log(f"compile-ahead: {ahead.seconds:.0f} s waiting for the workers")
                ahead.close()


def _write_results(spec, gpu: GpuInfo, results: Sequence[StudyResult], say) -> None:
    table: dict = {}
    for r in results:
        if r.best_config is None:
            continue
        table.setdefault(r.variant, {})[r.bucket] = tuning_data.entry(
            r.best_config, r.best_ms, r.default_ms)
    if not table:
        return
    path = tuning_data.tuning_path(spec, gpu.key)
    tuning_data.update(path, gpu=gpu.as_json(), versions=versions(), spec_sha=spec.sha,
                       results=table)
    say(f"wrote {path} ({', '.join(f'{v}@{b}' for v in table for b in table[v])}); "
        "run `flashgen build` to embed it")
