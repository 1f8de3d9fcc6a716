"""selftest's racecheck triage (flashgen/selftest/racecheck.py) on racecheck logs in the
format the H100 printed, against small stand-in kernel files: a report passes only as a
kind the control run also showed, and a hand-over only with both lines marked."""
import textwrap

import pytest

from flashgen.selftest import racecheck as R

KERNEL = textwrap.dedent("""\
    @gluon.jit
    def _producer(buf, full):
        buf.store(x)  # handover: full
        buf.store(y)
    @gluon.jit
    def _consumer(buf, full):
        a = buf.load(layout)  # [BLOCK_M]; handover: full
        b = buf.load(layout)  # handover: empty
    @gluon.jit
    def fwd_kernel(Q):
        gl.warp_specialize([
    def bwd_kernel(Q):
        if PERSISTENT:
            item_smem = gl.allocate_shared_memory(gl.int32, [2, 1], layout)
            gl.warp_specialize([
        else:
            x = 1
    from triton.experimental import gluon
    """)
CONTROL = textwrap.dedent("""\
    def _producer(buf):
        buf.store(v)  # handover: full
    def _consumer(buf):
        acc += buf.load(l)  # handover: full
    def control_kernel(d):
        gl.warp_specialize([
    from triton.experimental import gluon
    """)


def race(kind_a, line_a, pairs, name="fwd_k.py", level="Error"):
    text = (f"========= {level}: Race reported between {kind_a} access at k+0x120 in "
            f"{name}:{line_a}\n")
    for kind, line in pairs:
        text += f"=========     and {kind} access at k+0x9a0 in {name}:{line} [4 hazards]\n"
    return text + "========= \n"


CONTROL_LOG = (race("Write", 2, [("Read", 4)], "control.py")
               + race("Read", 5, [("Write", 5), ("Write", 6)], "control.py")
               + "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n")


@pytest.fixture
def roots(tmp_path):
    (tmp_path / "pkg" / "gluon").mkdir(parents=True)
    (tmp_path / "pkg" / "gluon" / "fwd_k.py").write_text(KERNEL)
    # the variant's `tl` kernel: the same base name, other lines (racecheck cannot tell
    # them apart by name; they are not Gluon, so they are not read)
    (tmp_path / "pkg" / "fwd_k.py").write_text("import triton\n" * 20)
    (tmp_path / "control.py").write_text(CONTROL)
    return [tmp_path / "pkg"], [tmp_path / "control.py"]


def test_reports_are_the_error_blocks_only():
    text = race("Read", 10, [("Write", 10), ("Write", 11)]) + race("Write", 3, [("Write", 3)],
                                                                   level="Warning")
    reps = R.reports(text)
    assert len(reps) == 1
    assert reps[0].head == ("fwd_k.py", 10)
    assert reps[0].others == [("fwd_k.py", 10), ("fwd_k.py", 11)]


def test_the_branch_around_warp_specialize_is_startup(roots):
    # Triton attributes the partitions' dispatch to the `if` that holds the call
    found = R.triage(race("Read", 12, [("Write", 12), ("Write", 13)]), CONTROL_LOG, *roots)
    assert found.counts == {"startup": 1} and not found.unexplained
    # an `else` whose block has no call, or a statement inside the block, is not
    for line in (16, 14):
        found = R.triage(race("Read", 12, [("Write", line)]), CONTROL_LOG, *roots)
        assert len(found.unexplained) == 1, line


def test_startup_and_marked_handovers_are_explained(roots):
    log = race("Read", 10, [("Write", 10), ("Write", 11)]) + race("Write", 3, [("Read", 7)])
    found = R.triage(log, CONTROL_LOG, *roots)
    assert found.control == {"startup", "handover"}
    assert found.counts == {"startup": 1, "handover": 1} and not found.unexplained
    assert "2 reports of kinds the race-free control kernel also gets" in found.note()


@pytest.mark.parametrize("pairs, why", [
    ((3, [("Read", 8)]), "the two lines name different barriers"),
    ((4, [("Read", 7)]), "the store is not marked"),
    ((3, [("Read", 2)]), "a def line against a marked store"),
    ((3, [("Read", 7), ("Read", 8)]), "one pair of the report is unexplained"),
    ((3, [("Read", 99)]), "a line past the file's end"),
])
def test_anything_else_stays_unexplained(roots, pairs, why):
    found = R.triage(race("Write", *pairs), CONTROL_LOG, *roots)
    assert len(found.unexplained) == 1, why
    assert found.note().startswith("1 unexplained")


def test_a_kind_the_control_did_not_show_explains_nothing(roots):
    # a sanitizer that models mbarriers would not flag the control's hand-over: then a
    # flagged hand-over of ours is a real finding
    control_startup_only = race("Read", 5, [("Write", 6)], "control.py")
    found = R.triage(race("Write", 3, [("Read", 7)]), control_startup_only, *roots)
    assert found.control == {"startup"} and len(found.unexplained) == 1


def test_unknown_files_are_unexplained(roots):
    found = R.triage(race("Write", 3, [("Read", 7)], name="other.py"), CONTROL_LOG, *roots)
    assert len(found.unexplained) == 1


def test_the_shipped_control_kernel_carries_its_markers():
    from pathlib import Path
    import flashgen.selftest as st
    text = (Path(st.__file__).parent / "control.py").read_text()
    marked = [ln for ln in text.splitlines() if "handover: full" in ln]
    assert len(marked) == 2 and ".store(" in marked[0] and ".load(" in marked[1]
