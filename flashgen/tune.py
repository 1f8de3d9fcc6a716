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
the timing) is what `flashgen tune` uses.
"""
from __future__ import annotations

import datetime
import fnmatch
import importlib
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import __version__, families, planner_core, tuning_data
from .errors import FlashgenError
from .measure import Measure, TuneAborted, WrongAnswer, _fmt_config, _reason, gpu_measure
from .progress import Progress
from .space import TILE_PARAMS, Space, space_for

DEFAULT_TRIALS = 30
DEFAULT_BUDGET = 840.0     # seconds for a whole `flashgen tune` run (spec under 15 min)
SAMPLERS = ("tpe", "grid")

ATTR_FAIL = "fail_reason"
ATTR_INFEASIBLE = "infeasible"
ATTR_WARM = "warm_start"
ATTR_CONFIRMED = "confirmed"    # study attr: {"complete": n, "entries": [[config, ms, [ms...]]]}
# study attr: the config the package ran before this study (its first warm start: the
# tuning file's entry, else the untuned default -- on Hopper often the Gluon one)
ATTR_BEFORE = "before_config"
CONFIRM_TOP = 4                 # re-time this many best configs (and the default) at the end
CONFIRM_ROUNDS = 3
INTERRUPTED = "interrupted"


def _optuna():
    try:
        import optuna
    except ImportError:
        raise FlashgenError(
            "flashgen tune needs Optuna, which is not installed: pip install optuna "
            "(or pip install -e \".[tune]\")") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


# ----------------------------------------------------------------------------------------
# names and storage
# ----------------------------------------------------------------------------------------

def study_name(variant: str, bucket: int, gpu_key: str) -> str:
    return f"{variant}@{int(bucket)}@{tuning_data.slug(gpu_key)}"


def project_root(start: Path | None = None) -> Path:
    """The enclosing git checkout of `start` (default: cwd), else `start` itself."""
    start = Path.cwd() if start is None else Path(start)
    for folder in (start, *start.parents):
        if (folder / ".git").exists():
            return folder
    return start


def default_storage(root: Path | None = None) -> str:
    path = project_root(root) / ".flashgen" / "tune.db"
    return f"sqlite:///{path}"


def open_storage(url: str):
    """An Optuna storage from `url`: an RDB URL (sqlite:///path, postgresql://...) or the
    path of a journal file (JournalStorage, good for several processes on one disk)."""
    optuna = _optuna()
    if "://" not in url:
        from optuna.storages.journal import JournalFileBackend

        Path(url).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(url)))
    kwargs = {}
    if url.startswith("sqlite:///"):
        Path(url[len("sqlite:///"):]).parent.mkdir(parents=True, exist_ok=True)
        kwargs["engine_kwargs"] = {"connect_args": {"timeout": 60}}  # several workers
    try:
        return optuna.storages.RDBStorage(url, **kwargs)
    except Exception as e:  # a bad URL, a missing driver
        raise FlashgenError(f"cannot open the tuning storage {url!r}: {type(e).__name__}: "
                            f"{e}") from None


# ----------------------------------------------------------------------------------------
# the sampler: feasible, unmeasured points only
# ----------------------------------------------------------------------------------------

_RECENT_S = 30 * 60    # a RUNNING trial older than this is a dead process's, not a rival's


def measured_keys(study, space: Space, exclude_number: int | None = None) -> set:
    """Keys of the points the study has measured, is measuring (another worker's running
    trial) or ruled out; an interrupted trial does not count, so a resume retries it."""
    from optuna.trial import TrialState

    now = datetime.datetime.now()
    seen = set()
    for t in study.get_trials(deepcopy=False):
        if t.number == exclude_number or not t.params:
            continue
        if t.state == TrialState.FAIL and t.user_attrs.get(ATTR_FAIL) == INTERRUPTED:
            continue
        if t.state == TrialState.RUNNING:
            if t.datetime_start is None or (now - t.datetime_start).total_seconds() > _RECENT_S:
                continue
        elif t.state == TrialState.WAITING:
            continue
        seen.add(space.key(space.config(t.params)))
    return seen


def unmeasured(study, space: Space, exclude_number: int | None = None) -> list[dict]:
    """The feasible points not yet measured (nor being measured), planner's rank order."""
    seen = measured_keys(study, space, exclude_number)
    return [p for p in space.points() if space.key(p) not in seen]


def _distance(space: Space, a: Mapping, b: Mapping) -> float:
    """How far apart two points are: octaves for numbers, 1 per differing other value."""
    d = 0.0
    for n in space.names:
        x, y = a[n], b[n]
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            d += x != y
        else:
            d += abs(math.log2(max(x, 1e-9) / max(y, 1e-9)))
    return d


def feasible_sampler(space: Space, mode: str = "tpe", seed: int = 0,
                     n_startup_trials: int | None = None, redraws: int = 24,
                     explore: float = 0.2, spread: bool = True, n_ei_candidates: int = 24):
    """An Optuna sampler that proposes only feasible, not yet measured points of `space`.

    mode "tpe": Optuna's TPE proposes (multivariate, over the box of `space`); a proposal
    that is infeasible or already measured is redrawn, and after `redraws` misses the
    sampler takes an unmeasured point next to the best so far (or, with probability
    `explore`, a random one). Until TPE has `n_startup_trials` results (default: a tenth
    of the space, 3 to 10), points are spread over the feasible set, each as far as possible
    from those measured (ties at random). mode "grid": the next unmeasured point in the
    planner's rank order, so a full run is the exhaustive grid over the feasible set.
    (Measured on a synthetic cost model, benchmarks/tune_vs_grid.py --synthetic:
    multivariate TPE beat independent TPE, and a local search step around the best hurt.)"""
    _optuna()
    from optuna.samplers import BaseSampler, TPESampler
    from optuna.trial import TrialState

    if mode not in SAMPLERS:
        raise FlashgenError(f"unknown sampler {mode!r}; expected one of {', '.join(SAMPLERS)}")
    points = space.points()
    dists = space.distributions()
    startup = n_startup_trials if n_startup_trials is not None else min(10, max(3, len(points) // 10))

    class FeasibleSampler(BaseSampler):
        def __init__(self):
            self._rng = random.Random(seed)
            self._inner = (TPESampler(seed=seed, n_startup_trials=startup, multivariate=True,
                                      constant_liar=False, n_ei_candidates=n_ei_candidates)
                           if mode == "tpe" else None)

        def infer_relative_search_space(self, study, trial):
            return dict(dists)

        def sample_relative(self, study, trial, search_space):
            if not search_space or "fixed_params" in trial.system_attrs:
                return {}  # an enqueued warm start: its params are fixed
            seen = measured_keys(study, space, exclude_number=trial.number)
            remaining = [p for p in points if space.key(p) not in seen]
            if not remaining:
                return {}
            if self._inner is None:
                return dict(remaining[0])
            varying = {n: d for n, d in search_space.items() if not d.single()}
            for _ in range(redraws):
                params = self._inner.sample_relative(study, trial, varying) if varying else {}
                if not params:
                    # TPE's start-up phase: spread over the feasible set, each point as far
                    # as possible from those measured (ties at random)
                    if spread:
                        measured = [space.config(t.params) for t in study.get_trials(
                            deepcopy=False) if t.params and t.number != trial.number]
                        if measured:
                            far = {space.key(p): min(_distance(space, p, m) for m in measured)
                                   for p in remaining}
                            top = max(far.values())
                            remaining = [p for p in remaining if far[space.key(p)] == top]
                    break
                cfg = space.config({**{n: d.choices[0] for n, d in search_space.items()},
                                    **params})
                if space.check(cfg) is None and space.key(cfg) not in seen:
                    return cfg
            else:
                done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if done and self._rng.random() >= explore:
                    best = space.config(min(done, key=lambda t: t.value).params)
                    near = min(_distance(space, best, p) for p in remaining)
                    remaining = [p for p in remaining if _distance(space, best, p) == near]
            return dict(self._rng.choice(remaining))

        def sample_independent(self, study, trial, param_name, param_distribution):
            # only reached when the space is exhausted (the tune loop stops before that)
            return self._rng.choice(param_distribution.choices)

        def after_trial(self, study, trial, state, values):
            if self._inner is not None:
                self._inner.after_trial(study, trial, state, values)

    return FeasibleSampler()


# ----------------------------------------------------------------------------------------
# one study
# ----------------------------------------------------------------------------------------

@dataclass
class StudyResult:
    name: str
    variant: str = ""
    bucket: int = 0
    best_config: dict | None = None
    best_ms: float | None = None
    default_ms: float | None = None
    before_ms: float | None = None  # the config the package ran before (ATTR_BEFORE)
    complete: int = 0
    failed: int = 0
    pruned: int = 0
    space_size: int = 0
    stopped: str = ""
    confirmed: bool = False    # best_ms/default_ms are back-to-back re-timings (see confirm)
    failures: list = field(default_factory=list)   # (config, reason) of failed trials

    @property
    def speedup(self) -> float | None:
        if self.best_ms and self.default_ms:
            return self.default_ms / self.best_ms
        return None

    @property
    def gain(self) -> float | None:
        """What the study adds over what the package ran before it (1.0: it kept it)."""
        if self.best_ms and self.before_ms:
            return self.before_ms / self.best_ms
        return None


def _finished(study, space: Space) -> dict:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    failed = [t for t in trials if t.state == TrialState.FAIL
              and t.user_attrs.get(ATTR_FAIL) != INTERRUPTED]
    pruned = [t for t in trials if t.state == TrialState.PRUNED]
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    return dict(trials=trials, complete=complete, failed=failed, pruned=pruned, waiting=waiting)


def _trial_seconds(finished: dict) -> float:
    """The median time a measured trial of this study took (0 before any)."""
    times = sorted(t.user_attrs["measure_s"] for t in finished["complete"] + finished["failed"]
                   if "measure_s" in t.user_attrs)
    return times[len(times) // 2] if times else 0.0


def summarize(study, space: Space, *, variant: str = "", bucket: int = 0,
              stopped: str = "") -> StudyResult:
    """The study's state as a StudyResult: the best config and the default config's time,
    from the study's confirmation round when it is current (see `confirm`), else from the
    trials' own times."""
    f = _finished(study, space)
    result = StudyResult(name=study.study_name, variant=variant, bucket=bucket,
                         complete=len(f["complete"]), failed=len(f["failed"]),
                         pruned=len(f["pruned"]), space_size=len(space), stopped=stopped)
    result.failures = [(dict(t.params), t.user_attrs.get(ATTR_FAIL, "?")) for t in f["failed"]]
    confirmed = study.user_attrs.get(ATTR_CONFIRMED)
    timed = []  # (config, ms): the confirmation round's medians, else the trials' times
    if confirmed and confirmed.get("complete") == len(f["complete"]):
        timed = [(space.config(cfg), ms) for cfg, ms, _ in confirmed["entries"]
                 if ms is not None and space.check(space.config(cfg)) is None]
        result.confirmed = bool(timed)
    if not timed:
        trials = sorted(f["complete"], key=lambda t: t.number)
        timed = [(space.config(t.params), t.value) for t in trials]
    if timed:
        result.best_config, result.best_ms = min(timed, key=lambda e: e[1])  # first of ties

        def ms_of(cfg):
            return None if cfg is None else next(
                (ms for c, ms in timed if space.key(c) == space.key(cfg)), None)

        result.default_ms = ms_of(space.default())
        result.before_ms = ms_of(_before(study, space))
    return result


def _before(study, space: Space) -> dict | None:
    """The study's ATTR_BEFORE config (None when it has none or it no longer fits)."""
    raw = study.user_attrs.get(ATTR_BEFORE)
    if raw is None:
        return None
    try:
        cfg = space.config(raw)
    except (KeyError, ValueError, TypeError):
        return None
    return cfg if space.check(cfg) is None else None


def _fmt_eta(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s"


def tune_study(*, storage, name: str, space: Space, measure: Measure, n_trials: int,
               timeout: float | None = None, warm_starts: Sequence[tuple[str, Mapping]] = (),
               sampler: str = "tpe", seed: int = 0, progress: Callable[[str], None] | None = None,
               user_attrs: Mapping[str, Any] | None = None, max_failures: int | None = None,
               max_measured: int | None = None, label: str | None = None,
               n_startup_trials: int | None = None, confirm_top: int = CONFIRM_TOP,
               confirm_rounds: int = CONFIRM_ROUNDS,
               retime: Callable[[dict], float] | None = None,
               min_trials: int = 0,
               prepare: Callable[[list[dict]], Any] | None = None,
               batch: int = 1) -> StudyResult:
    """Create or resume the study `name` and run it until it has `n_trials` completed trials
    (counting those of earlier runs), `timeout` seconds pass, `max_failures` trials have
    failed (default n_trials), `max_measured` trials have been measured, or every feasible
    point has been measured. The timeout never stops a study before `min_trials` trials
    (so a budgeted run still measures each study's first warm start, the default).

    `measure(config)` returns milliseconds, or a WrongAnswer; an exception fails the trial
    with its message (KeyboardInterrupt and TuneAborted stop the study: the trial is marked
    interrupted and will be retried on resume). Points `space` rules out are never passed
    to `measure`; a trial that somehow holds one (e.g. enqueued by hand) is pruned with the
    reason and does not count.

    At the end the `confirm_top` fastest configs and the default are re-timed back to back,
    `confirm_rounds` times in rotating order, with `retime` (default: `measure.time` if the
    measure has one, else `measure`); the winner and the default's time are the medians of
    those re-timings. GPU times drift by several percent over minutes (clocks, heat), more
    than the differences between the best configs, so trials timed far apart are not
    compared directly. The round is stored on the study and redone only after new trials.

    With `prepare` (flashgen/ahead.py's compile-ahead pool), trials are asked `batch` at a
    time and `prepare(configs)` compiles the batch's kernels in parallel before they are
    measured one by one; each trial's measure_s includes its share of that wait. Trials of
    a batch left unmeasured when the study stops are marked interrupted (a resume retries
    their points)."""
    optuna = _optuna()
    from optuna.trial import TrialState

    say = progress or (lambda line: print(line, flush=True))
    label = label or name
    max_failures = n_trials if max_failures is None else max_failures
    study = optuna.create_study(
        storage=storage, study_name=name, direction="minimize", load_if_exists=True,
        sampler=feasible_sampler(space, sampler, seed, n_startup_trials=n_startup_trials))
    for key, value in (user_attrs or {}).items():
        if study.user_attrs.get(key) != value:
            study.set_user_attr(key, value)

    dists = space.distributions()
    for i, (tag, cfg) in enumerate(warm_starts):
        cfg = space.config(cfg)
        reason = space.check(cfg)
        if reason is not None:
            say(f"{label}: warm start {tag} {_fmt_config(cfg)} skipped: {reason}")
            continue
        if i == 0 and study.user_attrs.get(ATTR_BEFORE) is None:
            # _warm_starts puts what the package runs today first; a resumed study keeps
            # the first run's (a re-tune's own entry is not "before")
            study.set_user_attr(ATTR_BEFORE, dict(cfg))
        study.enqueue_trial(cfg, user_attrs={ATTR_WARM: tag}, skip_if_exists=True)

    started = time.monotonic()
    counted_here = 0
    stopped = ""
    batch = max(1, batch) if prepare is not None else 1
    pending: list = []    # (trial, config, seconds of compile-ahead) asked, not yet measured
    while True:
        f = _finished(study, space)
        done, failed = len(f["complete"]), len(f["failed"])
        if done >= n_trials:
            stopped = f"{n_trials} trials"
            break
        if max_measured is not None and done + failed >= max_measured:
            stopped = f"{max_measured} measured"
            break
        # a trial that would run past the timeout is not started: in a budgeted run the
        # time it would take goes to the studies after this one instead of being taken
        # from them (the first trials' times, compile included, are the estimate)
        if (timeout is not None and done + failed >= min_trials
                and time.monotonic() - started + _trial_seconds(f) > timeout):
            stopped = "timeout"
            break
        if failed >= max_failures:
            stopped = f"{failed} failures"
            break
        if not pending and not f["waiting"] and not unmeasured(study, space):
            stopped = "space exhausted"
            break

        if not pending:
            # as many trials as the batch, the trial count and the unmeasured points allow
            want = min(batch, n_trials - done,
                       batch if max_measured is None else max_measured - done - failed)
            if want > 1 and timeout is not None:
                # no more than the time left holds (the trials before min_trials always)
                per = _trial_seconds(f)
                left = timeout - (time.monotonic() - started)
                fit = int(left / per) if per > 0 else (want if left > 0 else 0)
                want = min(want, max(fit, min_trials - done - failed, 1))
            if want > 1:
                want = min(want, max(1, len(unmeasured(study, space))))
            asked = []
            while len(asked) < max(want, 1):
                trial = study.ask(dists)
                cfg = space.config(trial.params)
                reason = space.check(cfg)
                if reason is not None:
                    trial.set_user_attr(ATTR_INFEASIBLE, reason)
                    study.tell(trial, state=TrialState.PRUNED)
                    say(f"{label}: trial {trial.number} {_fmt_config(cfg)} pruned, "
                        f"infeasible: {reason}")
                    if want <= 1:
                        break
                    continue
                asked.append((trial, cfg))
            if not asked:
                continue
            share = 0.0
            if prepare is not None and len(asked) > 1:
                t0 = time.monotonic()
                prepare([dict(c) for _, c in asked])
                share = (time.monotonic() - t0) / len(asked)
            pending = [(t, c, share) for t, c in asked]
        trial, cfg, share = pending.pop(0)
        t0 = time.monotonic() - share
        value: Any = None
        try:
            value = measure(dict(cfg))
        except (KeyboardInterrupt, TuneAborted):
            for t in [trial] + [t for t, _, _ in pending]:
                t.set_user_attr(ATTR_FAIL, INTERRUPTED)
                study.tell(t, state=TrialState.FAIL)
            raise
        except Exception as e:  # compile errors, out of resources, launch failures...
            value = WrongAnswer(_reason(e))
            kind = "error"
        else:
            kind = "wrong answer"
            if not isinstance(value, WrongAnswer):
                try:
                    value = float(value)
                except (TypeError, ValueError):
                    value = WrongAnswer(f"measure returned {value!r}, not a time")
                    kind = "error"
                else:
                    if not (math.isfinite(value) and value > 0):
                        value = WrongAnswer(f"measure returned {value!r} ms")
                        kind = "error"
        trial.set_user_attr("measure_s", round(time.monotonic() - t0, 3))
        if isinstance(value, WrongAnswer):
            trial.set_user_attr(ATTR_FAIL, f"{kind}: {value.reason}")
            study.tell(trial, state=TrialState.FAIL)
            note = f"FAILED ({kind}: {value.reason[:120]})"
        else:
            study.tell(trial, value)
            note = f"{value:.4f} ms"
        counted_here += 1
        f = _finished(study, space)
        done = len(f["complete"])
        best = min(f["complete"], key=lambda t: (t.value, t.number)) if f["complete"] else None
        best_text = (f"best {best.value:.4f} ms [{_fmt_config(space.config(best.params))}]"
                     if best else "best -")
        per = (time.monotonic() - started) / counted_here
        eta = _fmt_eta(per * max(n_trials - done, 0))
        say(f"{label}: trial {done}/{n_trials} [{_fmt_config(cfg)}] {note}; {best_text}; "
            f"ETA {eta}")
    for t, _, _ in pending:  # asked and compiled, but the study stopped first
        t.set_user_attr(ATTR_FAIL, INTERRUPTED)
        study.tell(t, state=TrialState.FAIL)
    if confirm_top > 0:
        confirm(study, space, retime or getattr(measure, "time", measure), top=confirm_top,
                rounds=confirm_rounds, say=lambda line: say(f"{label}: {line}"))
    result = summarize(study, space, stopped=stopped)
    say(f"{label}: done ({stopped}): {result.complete} complete, {result.failed} failed"
        + (f", best {result.best_ms:.4f} ms [{_fmt_config(result.best_config)}]"
           if result.best_ms else "")
        + (f", before {result.before_ms:.4f} ms" if result.before_ms else "")
        + (f", planner's config {result.default_ms:.4f} ms" if result.default_ms else "")
        + (" (re-timed back to back)" if result.confirmed else ""))
    return result


def confirm(study, space: Space, retime: Callable[[dict], float], *, top: int = CONFIRM_TOP,
            rounds: int = CONFIRM_ROUNDS, say=None) -> dict | None:
    """Re-time the study's `top` fastest configs, the default config and the one the package
    ran before the study (ATTR_BEFORE) back to back, `rounds` times in rotating order, and
    store the (lower) medians on the study (ATTR_CONFIRMED).
    Skipped when the stored round already covers every completed trial."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    stored = study.user_attrs.get(ATTR_CONFIRMED)
    if not complete or (stored and stored.get("complete") == len(complete)):
        return stored
    ranked, keys = [], set()
    for t in sorted(complete, key=lambda t: (t.value, t.number)):
        cfg = space.config(t.params)
        if space.key(cfg) not in keys and len(ranked) < top:
            ranked.append(cfg)
            keys.add(space.key(cfg))
    default = space.default()
    with_default = space.key(default) not in keys and any(
        space.key(space.config(t.params)) == space.key(default) for t in complete)
    if with_default:
        ranked.append(default)
        keys.add(space.key(default))
    # and what the package ran before the study, so its gain is timed in the same round
    before = _before(study, space)
    with_before = before is not None and space.key(before) not in keys and any(
        space.key(space.config(t.params)) == space.key(before) for t in complete)
    if with_before:
        ranked.append(before)
    if len(ranked) < 2:  # one config: nothing to compare, its trial time stands
        return stored
    if say:
        fastest = len(ranked) - with_default - with_before
        say(f"re-timing the {fastest} fastest configs{' and the default' if with_default else ''}"
            f"{' and the one before' if with_before else ''}, {rounds} rounds back to back")
    times: list[list[float]] = [[] for _ in ranked]
    for r in range(rounds):
        for j in range(len(ranked)):
            i = (j + r) % len(ranked)
            try:
                times[i].append(float(retime(dict(ranked[i]))))
            except (KeyboardInterrupt, TuneAborted):
                raise
            except Exception:
                times[i].append(math.inf)
    entries = []
    for cfg, ts in zip(ranked, times):
        # the lower median: with the two rounds a budgeted run takes, the faster of the
        # two, so one slow round (a clock dip, a neighbour's burst) cannot make a config
        # look slower than it is -- the upper one did, and a slower winner replaced the
        # default of two mods studies on the H100 (docs/TUNING.md)
        med = sorted(ts)[(len(ts) - 1) // 2]
        entries.append([cfg, med if math.isfinite(med) else None,
                        [round(t, 6) if math.isfinite(t) else None for t in ts]])
    data = {"complete": len(complete), "entries": entries}
    study.set_user_attr(ATTR_CONFIRMED, data)
    return data


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
    # (an MLA variant's V has its own; its kernels are `tl` only, so no Gluon points)
    plan_dim = max(facts["head_dim"], facts.get("v_head_dim") or 0)
    return space_for(kind, plan_dim, DTYPE_BYTES[facts["dtype"]], gpu.sram_bytes,
                     gpu.sm_count, gpu.capability,
                     gluon=no_gluon or gluon_here(kind, facts, gpu),
                     mask=facts.get("mask"), block_sparse="mask" in mod_kinds,
                     consumers=consumers, score_bytes=facts.get("score_bytes", 0))



def gluon_here(kind, facts, gpu: GpuInfo) -> str | None:
    """Why this variant cannot run a Gluon kernel on this GPU with this Triton (None when
    it can, and the tuner then measures both families)."""
    import torch
    import triton

    reason = families.gluon_reason(kind, facts.get("dropout", False), facts["head_dim"],
                                   facts["dtype"])
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
                                             space.facts.head_dim, tuple(mod_kinds), bucket))
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
