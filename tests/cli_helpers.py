"""Running the project's CLIs as a user does, for the CLI tests: a subprocess, no traceback allowed."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*args, module="sandbox", cwd=ROOT, timeout=120):
    """`python -m <module> args...` from the project root; stderr must hold no traceback."""
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                       cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "Traceback" not in r.stderr, r.stderr
    return r


def one_error_line(r) -> str:
    """The single line a user error leaves on stderr (exit status 2)."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]
