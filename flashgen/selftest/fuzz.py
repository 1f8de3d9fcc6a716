"""`flashgen selftest --fuzz N`: seeded random cases against the float64 reference.

Fuzzing
-------
`generate(seed, n, device)` draws `n` cases (flashgen.selftest.cases.Case) from a
`random.Random` seeded with `seed`, so the same seed and device class give the same cases
on any machine. The first cases take every kind once (in a seed-shuffled order); the rest
are drawn by `KIND_WEIGHTS`: dense training calls (flash_attn_func, SDPA, the packed QKV
call), packed ragged batches with empty sequences, decoding on contiguous and paged caches
(random page tables, spare pages, new keys appended), DeepSeek's latent (MLA) decode,
score and sink mods, block-sparse mask mods, SDPA's attn_mask, and the ring call at world
size 1 (real pieces and the LSE merge). Every case draws its dtype, batch, heads and GQA
ratio (up to 8:1), head dims (64, 80, 96, 128, 192/128, 576/512, as the selftest
packages build them), lengths (N = 1 and odd lengths favoured, Nq != Nk), causal and
sliding-window bands, dropout, mods and their params, a softmax scale of its own or
sharper / flatter queries (0.25x to 2x), strided and misaligned inputs and caches, and
the kernel family (auto / gluon / tl). A case seeds its inputs and the dropout generator
from its own seed, so its reproducer replays the same numbers and the same keep mask.

On a CPU the shapes are tiny (Triton's interpreter: under a second a case on average,
N <= 48; 50 cases take ~35-70 s on 2 shared cores) and over half the cases force 16 x 16
or 32 x 32 tiles so that they still cross several blocks. On CUDA they are small to
moderate (N up to 1400, mostly shorter: two length buckets; at most 8M scores a case for
the float64 reference, which runs on the GPU) and use the package's own tuned or planned
tiles; the variants a run can reach are bounded by the selftest packages (mods at bf16
only), so each kernel compiles once per worker at most -- and `fuzz(..., workers=W)` deals
the cases to worker processes by kernel, so in practice once.

Tolerances are flashgen.selftest.kinds' (tests/conftest.py's, atol in units of the
output's RMS, gradients against the exact backward of the output the forward stored: why,
there).

`fuzz(n, seed, device, workers=1)` runs them and returns a `FuzzReport`: cases run,
passed, failures each with its one-line reproducer

    flashgen selftest --fuzz-case '<case json>'

(`reproducer`; `parse_reproducer` reads one back), cases skipped with their reasons, notes
(a Gluon case run as `tl` on a machine without Gluon is counted there) and seconds. A
kernel's exception is its case's failure. With `workers > 1` the cases run in spawned
processes (CUDA: spread over the visible GPUs); a worker that dies or hangs past
`case_timeout` fails the case it was running and a new one takes the rest of its cases.
On a GPU the kernels' compilation dominates a first run (Gluon kernels 5-40 s each): use
a worker per two or three cores; a run too long for one command splits into slices of
the same seed's cases (`start=`), which a warm Triton cache then shares.
"""
from __future__ import annotations

import collections
import random
import shlex
import time
from dataclasses import dataclass, field

from .cases import KINDS, Case, CaseResult
from .workers import run_here, run_workers

KIND_WEIGHTS = {"train": 24, "varlen": 12, "decode": 9, "paged_decode": 9, "mla_decode": 5,
                "mods": 10, "block_mask": 12, "attn_mask": 5, "ring_merge": 8}
assert set(KIND_WEIGHTS) == set(KINDS)

# what each selftest package builds (its spec; mods at bf16 only, to bound the kernels)
PACKAGE_FACTS = {
    "gpt2": dict(dims=[(64, 64)], dtypes=["fp16", "bf16", "fp32"], window=False,
                 dropout=True, gqa=False, decode=False),
    "llama": dict(dims=[(128, 128)], dtypes=["bf16", "fp16"], window=True, dropout=False,
                  gqa=True, decode=True),
    "selftest": dict(dims=[(80, 80), (96, 96)], dtypes=["bf16", "fp32"], window=True,
                     dropout=True, gqa=True, decode=True),
    "mla": dict(dims=[(192, 128)], dtypes=["bf16"], window=False, dropout=False, gqa=True,
                decode=True, causal_only=True),
    "mods": dict(dims=[(64, 64), (128, 128)], dtypes=["bf16"], window=False, dropout=False,
                 gqa=True, decode=True),
}
# the mods package's variants: mods -> the band mask they were built with (specs/mods.yaml)
SCORE_MODS = {("softcap",): True, ("alibi",): True, ("sink_logits",): True,
              ("relative_bias",): False}
MASK_MODS = {("document",): True, ("document", "softcap"): True, ("prefix_lm",): False,
             ("window_sinks",): False, ("softcap", "key_padding"): True}
# mods that see only positions (the seeded case set predates the ring's data-dependent
# masks and sinks, which tests/test_ring_masks.py covers; widening this changes the draws)
RING_MODS = {("softcap",): True, ("alibi",): True, ("relative_bias",): False,
             ("prefix_lm",): False, ("window_sinks",): False}
CUDA_MAX_N = 1400          # two length buckets (512, 1024) of the bundled specs
CUDA_MAX_SCORES = 8 << 20  # B * Hq * Nq * Nk: the float64 reference's scores, 64 MB
CPU_MAX_N = 48


class _Draw:
    """The random choices of one case, for one device class."""

    def __init__(self, rng: random.Random, cuda: bool):
        self.r, self.cuda = rng, cuda

    def pick(self, weighted):
        """An item of a {item: weight} dict or a plain sequence."""
        if isinstance(weighted, dict):
            items = list(weighted)
            return self.r.choices(items, weights=[weighted[i] for i in items])[0]
        return self.r.choice(list(weighted))

    def chance(self, p: float) -> bool:
        return self.r.random() < p

    def length(self, low: int = 1) -> int:
        r = self.r
        if self.cuda:
            if r.random() < 0.15:
                n = r.choice([1, 59, 127, 128, 257, 1023, 1031, CUDA_MAX_N])
            else:
                n = self.pick({(1, 128): 45, (129, 512): 25, (513, CUDA_MAX_N): 15})
                n = r.randint(*n)
        else:
            n = (r.choice([1, 16, 17, 31, 33, CPU_MAX_N]) if r.random() < 0.25
                 else r.randint(1, 40))
        return max(n, low)

    def heads(self, gqa: bool) -> tuple[int, int]:
        ratio = self.pick({1: 3, 2: 2, 4: 3, 8: 2}) if gqa else 1
        h_kv = self.pick([1, 2, 4] if self.cuda else [1, 2])
        h_kv = min(h_kv, max(1, (16 if self.cuda else 8) // ratio))
        return ratio * h_kv, h_kv

    def batch(self) -> int:
        return self.pick({1: 4, 2: 3, 3: 2, 4: 1} if self.cuda else {1: 5, 2: 3, 3: 1})

    def family(self) -> str:
        return self.pick({"auto": 40, "gluon": 35, "tl": 25})

    def window(self, n: int, causal: bool) -> tuple:
        left = self.pick({-1: 1, self.r.randint(0, n): 3})
        right = 0 if causal else (self.r.randint(0, n) if left == -1 else
                                  self.pick({-1: 1, self.r.randint(0, n): 2}))
        return (left, right)

    def strided(self, allow_qkv: bool = True) -> str:
        choices = {"none": 50, "heads": 10, "pad": 10, "odd": 8, "bhnd": 12, "qkv": 10}
        if not allow_qkv:
            del choices["qkv"]
        return self.pick(choices)

    def dropout(self) -> float:
        return self.pick([0.1, 0.2, 0.3, 0.5]) if self.chance(0.4) else 0.0

    def mod_params(self, mods: tuple, n: int) -> dict:
        out = {}
        if "softcap" in mods:
            out["cap"] = self.pick([2.0, 5.0, 20.0, 50.0])
        if "relative_bias" in mods:
            out["max_distance"] = self.pick([4, 16, 128])
        if "window_sinks" in mods:
            out["sinks"] = self.r.randint(0, 8)
            out["window"] = self.r.randint(0, n)
        return out


def _fit(draw: _Draw, c: dict) -> dict:
    """Shrink a dense case until its reference fits: CUDA_MAX_SCORES scores; on a CPU at
    most 8 (batch x query heads) for the interpreter's sake."""
    if draw.cuda:
        while c["batch"] * c["h_q"] * c["n_q"] * c["n_k"] > CUDA_MAX_SCORES:
            if c["batch"] > 1:
                c["batch"] -= 1
            else:
                c["n_q"], c["n_k"] = max(1, c["n_q"] // 2), max(1, c["n_k"] // 2)
    else:
        while c["batch"] * c["h_q"] > 8 and c["batch"] > 1:
            c["batch"] -= 1
    return c


def _common(draw: _Draw, package: str) -> dict:
    facts = PACKAGE_FACTS[package]
    d, dv = draw.pick(facts["dims"])
    h_q, h_kv = draw.heads(facts["gqa"])
    c = dict(package=package, dtype=draw.pick(facts["dtypes"]), batch=draw.batch(),
             h_q=h_q, h_kv=h_kv, d=d, family=draw.family())
    if dv != d:
        c["dv"] = dv
    if not draw.cuda:
        c["tiles"] = draw.pick({16: 40, 32: 15, 0: 45})
    return c


def _sharpness(draw: _Draw, c: dict) -> dict:
    """Now and then a softmax scale of the call's own (0.25x to 2x 1/sqrt(d)) or larger
    or smaller queries: scores more peaked (the online softmax's running max moves more)
    or flatter. (Within the range where 16-bit roundings stay inside the dtype's
    tolerance; sharper softmaxes are a numerics study, not a correctness test.)"""
    options = dict(c.get("options", {}))
    if draw.chance(0.15):
        options["scale"] = round(draw.r.uniform(0.25, 2.0) / c["d"] ** 0.5, 5)
    if draw.chance(0.15):
        options["q_scale"] = draw.pick([0.25, 2.0])
    if options:
        c["options"] = options
    return c


def _band(draw: _Draw, c: dict, package: str, n: int, top_left: bool = False) -> None:
    facts = PACKAGE_FACTS[package]
    c["causal"] = True if facts.get("causal_only") else draw.chance(0.5)
    if facts["window"] and not top_left and draw.chance(0.35):
        c["window"] = draw.window(n, c["causal"])


def _train(draw: _Draw, kind: str) -> dict:
    """train, mods, block_mask, attn_mask and ring_merge: a dense forward and backward."""
    if kind == "train":
        package = draw.pick({"gpt2": 30, "llama": 20, "selftest": 40, "mla": 10})
    elif kind == "ring_merge":
        package = draw.pick({"gpt2": 25, "llama": 25, "selftest": 30, "mods": 20})
    else:
        package = "mods"
    facts = PACKAGE_FACTS[package]
    c = _common(draw, package)
    c["kind"] = kind
    ring = kind == "ring_merge"
    if ring:
        layout = draw.pick({"zigzag": 70, "contiguous": 30})
        n = draw.length(2 if layout == "zigzag" else 1)
        c["options"] = {**c.get("options", {}), "layout": layout,
                        "strategy": draw.pick(["ring", "allgather"])}
        if layout == "zigzag":
            n += n % 2
        c["n_q"] = c["n_k"] = n
    else:
        c["n_q"] = draw.length()
        c["n_k"] = c["n_q"] if draw.chance(0.6) else draw.length()
    apis = {"flash": 70, "sdpa": 20, "packed": 10} if kind == "train" else {"flash": 75, "sdpa": 25}
    if ring or kind in ("mods", "block_mask"):
        apis.pop("packed", None)
    c["api"] = "sdpa" if kind == "attn_mask" else draw.pick(apis)
    if kind in ("mods", "block_mask") or (ring and package == "mods"):
        table = {"mods": SCORE_MODS, "block_mask": MASK_MODS}.get(kind, RING_MODS)
        mods = draw.pick(list(table))
        c["mods"], c["causal"] = mods, table[mods]
        c["mod_params"] = draw.mod_params(mods, max(c["n_q"], c["n_k"]))
    elif kind == "attn_mask":
        c["options"] = {**c.get("options", {}), "mask": draw.pick(["bool", "float"])}
        if draw.chance(0.3):
            c["mods"] = ("softcap",)
            c["mod_params"] = draw.mod_params(("softcap",), c["n_k"])
    else:
        _band(draw, c, package, max(c["n_q"], c["n_k"]), top_left=c["api"] == "sdpa" and not ring)
    if c["api"] == "packed" and (c["h_q"] != c["h_kv"] or c.get("dv")):
        c["api"] = "flash"
    if c["api"] == "packed":
        c["n_k"] = c["n_q"]
    if facts["dropout"] and kind in ("train", "ring_merge"):
        c["dropout"] = draw.dropout()
        if ring and c["dropout"] and not draw.cuda:
            c["options"]["layout"] = "contiguous"  # (zig-zag needs N % 64 == 0: slow here)
    square = c["n_q"] == c["n_k"] and not c.get("dv")
    c["strided"] = draw.strided(allow_qkv=square and c["api"] != "packed")
    c["return_lse"] = draw.chance(0.85)
    c = _fit(draw, c)
    if ring and c["options"]["layout"] == "zigzag":
        # two chunks; under dropout each starts on a 32-column Philox block (N % 64 == 0)
        step = 64 if c.get("dropout") else 2
        c["n_q"] = c["n_k"] = max(step, c["n_q"] - c["n_q"] % step)
    return _sharpness(draw, c)


def _varlen(draw: _Draw) -> dict:
    package = draw.pick({"gpt2": 20, "llama": 20, "selftest": 45, "mods": 15})
    facts = PACKAGE_FACTS[package]
    c = _common(draw, package)
    c["kind"] = "varlen"
    c["batch"] = draw.r.randint(1, 8 if draw.cuda else 4)

    def one() -> int:
        return draw.pick({0: 2, 1: 1.5, draw.length(): 6.5})

    lq = [one() for _ in range(c["batch"])]
    lk = [n if draw.chance(0.6) else one() for n in lq]
    if not any(lq):  # (at least one query and one key in the batch)
        lq[0] = draw.length()
    if not any(lk):
        lk[0] = draw.length()
    if draw.cuda:
        while sum(a * b for a, b in zip(lq, lk)) * c["h_q"] > CUDA_MAX_SCORES:
            lq, lk = [n // 2 for n in lq], [n // 2 for n in lk]
            lq[0], lk[0] = max(lq[0], 1), max(lk[0], 1)
    c["seqlens_q"], c["seqlens_k"] = lq, lk
    c.pop("batch")
    if package == "mods" and draw.chance(0.8):
        table = draw.pick([SCORE_MODS, MASK_MODS])
        mods = draw.pick(list(table))
        c["mods"], c["causal"] = mods, table[mods]
        c["mod_params"] = draw.mod_params(mods, max(lq + lk))
    else:
        _band(draw, c, package, max(lq + lk))
    if facts["dropout"]:
        c["dropout"] = draw.dropout()
    if draw.chance(0.15):
        c["options"] = {**c.get("options", {}), "max_extra": draw.r.randint(1, 5)}
    c["strided"] = draw.strided(allow_qkv=lq == lk and not c.get("dv"))
    return _sharpness(draw, c)


def _decode(draw: _Draw, kind: str) -> dict:
    if kind == "mla_decode":
        package = "mla"
    else:
        package = draw.pick({"llama": 35, "selftest": 40, "mods": 25})
    c = _common(draw, package)
    c["kind"] = kind
    if kind == "mla_decode":
        latent_dims = draw.chance(0.7)
        c["d"], c["dv"] = (576, 512) if latent_dims else (192, 128)
        c["h_kv"] = 1 if latent_dims else draw.pick([1, 2])
        c["h_q"] = c["h_kv"] * draw.pick([1, 2, 4, 8, 16] + ([32, 64, 128] if draw.cuda else []))
        if latent_dims and draw.chance(0.8):
            c["options"] = {**c.get("options", {}), "latent": 1}
        c["causal"] = True
        if draw.chance(0.5):
            c["page_size"] = draw.pick([64, 16, 32, 128] if draw.cuda else [16, 32, 64])
    elif kind == "paged_decode":
        c["page_size"] = draw.pick([16, 32, 48, 64, 128, 256] if draw.cuda else [8, 16, 24, 32])
    c["batch"] = draw.r.randint(1, 8 if draw.cuda else 3)
    cap = draw.length() if draw.cuda else draw.r.randint(1, 64)
    if c.get("page_size"):
        cap = -(-cap // c["page_size"]) * c["page_size"]
    c["n_k"] = cap
    c["n_q"] = draw.pick({1: 6, 2: 2, 3: 1, 4: 1})
    c["n_new"] = min(cap, draw.pick({0: 4, 1: 4, draw.r.randint(2, 4): 2}))
    room = cap - c["n_new"]

    def length() -> int:
        return draw.pick({0: 1.5, room: 1.5, draw.r.randint(0, room): 7})

    c["seqlens_k"] = [length() for _ in range(c["batch"])]
    if draw.chance(0.1):
        c["seqlens_k"] = [c["seqlens_k"][0]] * c["batch"]
        c["options"] = {**c.get("options", {}), "int_lens": 1}
    if package == "mods" and draw.chance(0.6):
        table = draw.pick([SCORE_MODS, MASK_MODS])
        mods = draw.pick(list(table))
        c["mods"], c["causal"] = mods, table[mods]
        c["mod_params"] = draw.mod_params(mods, cap)
    elif kind != "mla_decode":
        _band(draw, c, package, cap)
    c["num_splits"] = draw.pick({0: 5, 1: 2, draw.r.randint(2, 5): 3})
    c["strided"] = draw.strided(allow_qkv=False)
    c["return_lse"] = draw.chance(0.85)
    return _sharpness(draw, c)


def generate(seed: int, n: int, device: str) -> list[Case]:
    """`n` cases from `seed` for `device` ("cpu": interpreter-sized shapes; "cuda", any
    index: GPU-sized). Deterministic: the same (seed, n, device class) always gives the
    same cases, and a longer run extends a shorter one."""
    cuda = str(device).startswith("cuda")
    rng = random.Random(f"flashgen-selftest-fuzz:{seed}:{'cuda' if cuda else 'cpu'}")
    first = list(KINDS)
    rng.shuffle(first)
    cases = []
    for i in range(n):
        kind = first[i] if i < len(first) else rng.choices(
            list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()))[0]
        draw = _Draw(random.Random(rng.getrandbits(64)), cuda)
        if kind == "varlen":
            fields = _varlen(draw)
        elif kind in ("decode", "paged_decode", "mla_decode"):
            fields = _decode(draw, kind)
        else:
            fields = _train(draw, kind)
        fields["seed"] = draw.r.randrange(1 << 31)
        cases.append(Case(**fields))
    return cases


# ----------------------------------------------------------------------------------------
# Reproducers and the report
# ----------------------------------------------------------------------------------------
def reproducer(case: Case) -> str:
    """The shell line that runs `case` again: flashgen selftest --fuzz-case '<json>'."""
    return f"flashgen selftest --fuzz-case '{case.to_json()}'"


def parse_reproducer(line: str) -> Case:
    """The case of a `reproducer` line (as a shell would split it)."""
    words = shlex.split(line)
    if "--fuzz-case" not in words or words.index("--fuzz-case") + 1 >= len(words):
        raise ValueError(f"not a reproducer line (no --fuzz-case JSON): {line!r}")
    return Case.from_json(words[words.index("--fuzz-case") + 1])


@dataclass
class Failure:
    case: Case
    message: str
    reproducer: str


@dataclass
class FuzzReport:
    """A fuzz run: every case's result in case order, and what they add up to."""
    seed: int
    device: str
    results: list[CaseResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def cases_run(self) -> int:
        return sum(not r.skipped for r in self.results)

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> list[Failure]:
        return [Failure(r.case, r.message, reproducer(r.case)) for r in self.results if r.failed]

    @property
    def skipped(self) -> list[tuple[Case, str]]:
        return [(r.case, r.skipped) for r in self.results if r.skipped]

    @property
    def notes(self) -> dict[str, int]:
        """How many cases ran other than asked (e.g. family gluon as tl), by reason."""
        return dict(collections.Counter(r.note for r in self.results if r.note))

    def coverage(self) -> dict[str, int]:
        """Cases run per kind."""
        return dict(collections.Counter(r.case.kind for r in self.results if not r.skipped))

    def summary(self) -> str:
        lines = [f"fuzz seed {self.seed} on {self.device}: {self.cases_run} cases run, "
                 f"{self.passed} passed, {len(self.failed)} failed, {len(self.skipped)} "
                 f"skipped in {self.seconds:.1f} s",
                 "  kinds: " + ", ".join(f"{k} {v}" for k, v in sorted(self.coverage().items()))]
        lines += [f"  note: {count} x {note}" for note, count in sorted(self.notes.items())]
        skips = collections.Counter(reason for _, reason in self.skipped)
        lines += [f"  skipped: {count} x {reason}" for reason, count in sorted(skips.items())]
        for f in self.failed:
            lines += [f"  FAIL {f.case.label()}: {f.message}", f"    {f.reproducer}"]
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Running: in process, or dealt to worker processes
# ----------------------------------------------------------------------------------------
def fuzz(n: int, seed: int, device: str, workers: int = 1, progress=None,
         ref_device=None, case_timeout: float | None = 900.0, start: int = 0) -> FuzzReport:
    """Generate `n` cases from `seed` for `device` and run them (see the module docstring).
    progress(done, total, result) is called after each case, in completion order.
    `start`: skip the seed's first `start` cases, so that a long run can be split into
    parts (fuzz(500, 0, d, start=500) runs cases 500..999 of fuzz(2000, 0, d))."""
    cases = generate(seed, start + n, device)[start:]
    return run_many(cases, device, workers=workers, progress=progress,
                    ref_device=ref_device, case_timeout=case_timeout, seed=seed)


def run_many(cases: list[Case], device: str, workers: int = 1, progress=None,
             ref_device=None, case_timeout: float | None = 900.0, seed: int = -1) -> FuzzReport:
    """Run `cases` on `device` (in this process, or in `workers` spawned processes) and
    report them in case order."""
    from .package import ensure_built

    start = time.perf_counter()
    ensure_built(sorted({c.package for c in cases}))  # once, before any worker imports
    if workers <= 1 or len(cases) <= 1:
        results = run_here(cases, device, ref_device, progress)
    else:
        results = run_workers(cases, device, ref_device, workers, progress, case_timeout)
    return FuzzReport(seed, str(device), results, time.perf_counter() - start)
