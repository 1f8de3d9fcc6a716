"""racecheck's reports sorted into the kinds it also makes on a race-free control kernel,
and the rest.

racecheck does not model the two ways warp-specialised Gluon code orders shared memory
between partitions (selftest/control.py shows both on a kernel that is race-free by the
PTX memory model and always right):

* `startup`: a read at the kernel's entry against writes attributed to the kernel's `def`
  line and to its `gl.warp_specialize(` call, or to the `if` / `else` that holds the call
  (Triton's own hand-off of the partitions' state, which it attributes to the statement
  around the call): no line of ours in between;
* `handover`: a partition's shared-memory store against another's load that an mbarrier
  orders. Counted as this kind only when both source lines carry the same
  `# handover: BARRIER` marker, the author's claim (readable beside the code) that BARRIER
  orders them (a comment containing `handover: BARRIER`); an unmarked pair stays
  unexplained.

A report (one "Race reported between" block: one access and every access it races with)
is explained when each of its pairs is of a kind the control run showed on the same
machine; `flashgen selftest --sanitize` fails on any other. The source lines are read from
the files that ran. racecheck names a file by its base name only, and a variant's `tl` and
Gluon kernels share theirs (kernels/NAME.py, kernels/gluon/NAME.py): only Gluon files are
read (both kinds are warp specialisation's, which the `tl` kernels do not have here), and
every Gluon file of that name under the roots must agree.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_HEAD = re.compile(r"(Error|Warning): Race reported between (Read|Write) access at (\S+?)\+0x[0-9a-fA-F]+ in "
                   r"(\S+?):(\d+)")
_AND = re.compile(r"^\W*and (Read|Write) access at (\S+?)\+0x[0-9a-fA-F]+ in (\S+?):(\d+)")
_MARK = re.compile(r"#.*\bhandover:\s*(\w+)")
_DEF = re.compile(r"^\s*def \w+\(")
_BRANCH = re.compile(r"^\s*(if\b.*|elif\b.*|else\s*):\s*(#.*)?$")
_GLUON = re.compile(r"(?m)^from triton\.experimental import gluon$")
KINDS = ("startup", "handover")


@dataclass
class Report:
    """One racecheck error: its first access and the accesses it races with, each a
    (file base name, line)."""
    head: tuple
    others: list = field(default_factory=list)
    text: str = ""

    def pairs(self):
        return [(self.head, other) for other in self.others]


def reports(text: str) -> list[Report]:
    """The errors ("Error: Race reported between" blocks) of a racecheck log
    (--racecheck-report analysis); warnings are not failures and are skipped."""
    out, current = [], None
    for line in text.splitlines():
        head = _HEAD.search(line)
        if head:
            current = None
            if head.group(1) == "Error":
                current = Report((head.group(4), int(head.group(5))), text=line.strip())
                out.append(current)
            continue
        more = _AND.search(line)
        if more and current is not None:
            current.others.append((more.group(3), int(more.group(4))))
    return out


class Sources:
    """The lines of the kernel files that ran, by base name (racecheck's naming)."""

    def __init__(self, roots):
        self.roots = [Path(r) for r in roots if r]
        self._files = {}

    def lines(self, name: str) -> list[list[str]]:
        if name not in self._files:
            found = []
            for root in self.roots:
                paths = [root] if root.is_file() and root.name == name else (
                    root.rglob(name) if root.is_dir() else [])
                for path in paths:
                    text = path.read_text(encoding="utf-8", errors="replace")
                    if _GLUON.search(text):
                        found.append(text.splitlines())
            self._files[name] = found
        return self._files[name]

    def startup(self, where: tuple) -> list[bool]:
        """Whether (file, line) is a `startup` line in every file of that name: the `def`
        of a kernel, a `gl.warp_specialize(` call, or an `if` / `else` whose block holds
        one."""
        name, number = where
        out = []
        for f in self.lines(name):
            text = f[number - 1] if 0 < number <= len(f) else ""
            ok = bool(_DEF.match(text)) or "gl.warp_specialize(" in text
            if not ok and _BRANCH.match(text):
                depth = len(text) - len(text.lstrip())
                for below in f[number:]:
                    if below.strip() and len(below) - len(below.lstrip()) <= depth:
                        break
                    if "gl.warp_specialize(" in below:
                        ok = True
                        break
            out.append(ok)
        return out

    def line(self, where: tuple) -> list[str]:
        """The text of (file, line) in every file of that name (empty: not found)."""
        name, number = where
        return [f[number - 1] if 0 < number <= len(f) else "" for f in self.lines(name)]


def pair_kind(a: tuple, b: tuple, sources: Sources) -> str:
    """`startup`, `handover` or "" (unexplained) for two racing accesses."""
    ta, tb = sources.line(a), sources.line(b)
    if not ta or not tb or a[0] != b[0]:
        return ""

    if all(sources.startup(a)) and all(sources.startup(b)):
        return "startup"
    marks = {m.group(1) if m else None for m in map(_MARK.search, ta + tb)}
    if len(marks) == 1 and None not in marks:
        return "handover"
    return ""


def report_kinds(report: Report, sources: Sources) -> set:
    """The kinds of a report's pairs ("" among them: some pair is unexplained)."""
    return {pair_kind(a, b, sources) for a, b in report.pairs()} or {""}


@dataclass
class Triage:
    counts: dict          # kind -> reports of only that kind ("mixed" for both)
    unexplained: list     # the reports no kind explains (their first lines)
    control: set          # the kinds the control run showed

    def note(self) -> str:
        parts = [f"{n} {kind}" for kind, n in sorted(self.counts.items()) if n]
        shown = ", ".join(sorted(self.control)) or "none"
        text = (f"{sum(self.counts.values())} reports of kinds the race-free control kernel "
                f"also gets ({', '.join(parts) or 'none'}; the control showed: {shown})")
        if self.unexplained:
            text = f"{len(self.unexplained)} unexplained; " + text
        return text


def triage(log_text: str, control_text: str, roots, control_roots) -> Triage:
    """Sort a racecheck log's reports by kind, allowing only the kinds the control kernel's
    racecheck log (`control_text`) shows."""
    control = set()
    csources = Sources(control_roots)
    for rep in reports(control_text):
        control |= report_kinds(rep, csources) - {""}
    sources = Sources(roots)
    counts, unexplained = {}, []
    for rep in reports(log_text):
        kinds = report_kinds(rep, sources)
        if "" in kinds or not kinds <= control:
            unexplained.append(rep.text)
            continue
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
        counts[kind] = counts.get(kind, 0) + 1
    return Triage(counts, unexplained, control)
