"""One Optuna study of `flashgen tune` (flashgen/tune.py runs one per variant and length
bucket): its name and storage, the sampler that proposes only feasible points not yet
measured, the trial loop (tune_study: ask, compile ahead, measure, tell; a budget's
timeout; interrupts) and the confirmation round that re-times the fastest configs back to
back (confirm). The measurement is a parameter: flashgen/measure.py's on a GPU, a synthetic
cost in the CPU tests."""
from __future__ import annotations

import datetime
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import tuning_data
from .errors import FlashgenError
from .measure import Measure, TuneAborted, WrongAnswer, _fmt_config, _reason
from .space import Space

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
