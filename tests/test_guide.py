"""Every Python code block of the guide (docs/index.md, docs/guide/*.md) runs, as written, on the
rank count it shows: a block preceded by the line ``<!-- ranks: 2 -->`` under ``mpiexec -n 2``,
``<!-- ranks: 2 torchrun -->`` under ``torchrun --nproc-per-node 2``, any other on one process.
A ``text`` block right after a code block is what it prints, line by line (in any order: ranks
print at once), numbers included: each printed number must be the quoted one as written, unless
a line ``<!-- numbers: RULE -->`` between the two blocks says how far they may move, where the
platform moves them: ``within 2%`` (relative), ``within 0.5`` (absolute), ``round-off`` (a
number quoted below 1e-5 may be any number below 1e-5; the others as written) or ``any`` (timings).
The README's training loop is the guide's first, and the tuning page's table is the planner's
output."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
FENCE = re.compile(r"(<!-- ranks: (\d)( torchrun)? -->\n)?```python\n(.*?)```\n"
                   r"(\s*(<!-- numbers: ([^>]*?) -->\n)?\s*```text\n(.*?)```)?", re.S)
NUMBER = re.compile(r"-?\d+(\.\d+)?(e[-+]?\d+)?")


def _blocks():
    for page in PAGES:
        for k, m in enumerate(FENCE.finditer(page.read_text())):
            ranks, launcher = int(m.group(2) or 1), "torchrun" if m.group(3) else "mpiexec"
            yield pytest.param(m.group(4), ranks, launcher, m.group(8), m.group(7) or "exact",
                               id=f"{page.relative_to(ROOT / 'docs')}:{k + 1}:{ranks}rank"
                                  + ("-torchrun" if m.group(3) else ""))


def _pattern(line):
    """A printed line, numbers replaced by any number."""
    out, last = [], 0
    for m in NUMBER.finditer(line):
        out.append(re.escape(line[last:m.start()]) + "(" + NUMBER.pattern + ")")
        last = m.end()
    return "".join(out) + re.escape(line[last:])


def _numbers_agree(got, want, rule):
    """Whether the printed number ``got`` (a string) may stand for the quoted ``want`` under
    ``rule`` (see the module's docstring)."""
    g, w = float(got), float(want)
    if rule == "any" or got == want:
        return True
    if rule == "round-off" and abs(w) < 1e-5:
        return abs(g) < 1e-5
    found = re.fullmatch(r"within (\d+(?:\.\d+)?)(%?)", rule)
    if found:
        limit = float(found.group(1))
        return abs(g - w) <= (limit / 100 * abs(w) if found.group(2) else limit)
    return False


def _check_prints(got_lines, want_lines, rule):
    got = [line for line in got_lines.splitlines() if line.strip()]
    want = [line for line in want_lines.splitlines() if line.strip()]
    assert len(got) == len(want), (got, want)
    for g, w in zip(sorted(got), sorted(want)):  # the ranks' lines come in any order
        found = re.fullmatch(_pattern(w), g)
        assert found, (g, w)
        quoted = [m.group(0) for m in NUMBER.finditer(w)]
        printed = [found.group(1 + 3 * k) for k in range(len(quoted))]
        for p, q in zip(printed, quoted):
            assert _numbers_agree(p, q, rule), f"printed {p} where the guide says {q} ({rule}): {g!r}"


def test_a_quoted_number_that_moved_fails():
    """The check itself: an edited number fails it, a tolerance lets the platform move it."""
    _check_prints("test accuracy 96.39%", "test accuracy 96.39%", "exact")
    with pytest.raises(AssertionError, match="printed 96.32 where the guide says 96.39"):
        _check_prints("test accuracy 96.32%", "test accuracy 96.39%", "exact")
    _check_prints("test accuracy 96.32%", "test accuracy 96.39%", "within 0.1")
    with pytest.raises(AssertionError):
        _check_prints("test accuracy 95.32%", "test accuracy 96.39%", "within 0.1")
    _check_prints("difference 4.1e-08", "difference 3.0e-08", "round-off")
    with pytest.raises(AssertionError):
        _check_prints("difference 4.1e-03", "difference 3.0e-08", "round-off")
    _check_prints("took 7.2 ms", "took 3.1 ms", "any")


@pytest.mark.parametrize("code, ranks, launcher, prints, rule", list(_blocks()))
def test_guide_code_block_runs(code, ranks, launcher, prints, rule, tmp_path):
    script = tmp_path / "block.py"
    script.write_text(code)
    cmd = [sys.executable, str(script)]
    if launcher == "torchrun":
        # --no-python: torchrun starts a script under `python -u`, whose print writes a line
        # and its newline apart (see below); started as a program, the children buffer.
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(ranks), "--no-python", sys.executable, str(script)]
    elif ranks > 1:
        cmd = ["mpiexec", "-n", str(ranks)] + cmd
    # Unbuffered, print writes a line and its newline apart, and two ranks sharing the pipe
    # (torchrun's children do) can interleave them; buffered, each rank writes its lines whole.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if prints is not None:
        _check_prints(proc.stdout, prints, rule)


def test_the_readme_loop_is_the_guides_first():
    readme = FENCE.search((ROOT / "README.md").read_text())
    guide = FENCE.search((ROOT / "docs" / "guide" / "getting-started.md").read_text())
    assert readme is not None and guide is not None
    assert readme.group(4) == guide.group(4)
    assert readme.group(2) == guide.group(2) == "2"


def test_the_tuning_table_is_the_planners():
    page = (ROOT / "docs" / "guide" / "tuning.md").read_text()
    command = re.search(r"```console\n\$ (python -m layerbraid.tools.plan --table[^\n]*)\n", page)
    assert command is not None
    args = command.group(1).split()[3:]
    proc = subprocess.run([sys.executable, "-m", "layerbraid.tools.plan", *args],
                          capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() in page
