"""The reports under docs/ and the code they measure: the suite says which are stale."""
import subprocess
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_report_has_its_command_and_the_stale_ones_are_listed():
    """bench/reports.py lists every docs/ report with the command that regenerates it, and the
    reports older than their code.  The stale list is shown as a warning in the summary: a
    change to measured code reruns its reports in the same piece of work."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "reports.py")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reports = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
                     if p.name != "ARCHITECTURE.md")
    readme = (ROOT / "bench" / "README.md").read_text()
    for report in reports:  # every report has its row, the same in bench/README.md
        row = next((line for line in out.stdout.splitlines() if line.startswith(f"| {report} |")),
                   None)
        assert row is not None and "`python bench/" in row, report
        assert row in readme, f"bench/README.md lacks: {row}"
    if "stale report(s)" in out.stdout:
        warnings.warn(out.stdout[out.stdout.index("stale report(s)") - 3:].strip())
    else:
        assert "no stale report" in out.stdout or "no git history" in out.stdout, out.stdout
