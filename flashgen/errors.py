"""Error types for flashgen.

Every error a user can cause is a :class:`FlashgenError`; the CLI prints
``str(e)`` and exits with status 2, without a traceback.  Anything else that
escapes is a bug in flashgen and keeps its traceback.
"""

from __future__ import annotations


class FlashgenError(Exception):
    """Base; CLI prints str(e) and exits 2 with no traceback."""


def _sentence(text: str) -> str:
    """Strip whitespace and one trailing period so that we can add our own."""
    text = text.strip()
    return text[:-1] if text.endswith(".") else text


class SpecError(FlashgenError):
    """A problem in a spec file, pinned to ``file:line`` and a dotted key.

    ``str(e)`` is one paragraph, e.g.::

        specs/gpt2.yaml:7: key 'head_dims': 72.5 is not an integer. Expected: a
        list of head dimensions, each a multiple of 8 from 16 to 256. Fix: write
        e.g. head_dims: [64, 128].

    ``line`` is 1-based, or None when no line applies (e.g. an unreadable
    file); the location is then printed as ``file:``.
    """

    def __init__(self, file: str, line: int | None, key: str, problem: str,
                 expected: str, fix: str):
        self.file = str(file)
        self.line = line
        self.key = key
        self.problem = problem
        self.expected = expected
        self.fix = fix
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return (f"{where}: key '{self.key}': {_sentence(self.problem)}. "
                f"Expected: {_sentence(self.expected)}. Fix: {_sentence(self.fix)}.")

    def __str__(self) -> str:
        return self._message()

    # Exception pickling re-calls __init__ with self.args, which here is the
    # single formatted message; rebuild from the fields instead so the error
    # survives multiprocessing (e.g. a parallel autotuner).
    def __reduce__(self):
        return (type(self), (self.file, self.line, self.key, self.problem,
                             self.expected, self.fix))
