"""tests/forking.py runs a script or module as a forked child the way a fresh interpreter would run it."""

import subprocess
import time
from pathlib import Path

import pytest

from forking import run_python

SCRIPT = """
import os, sys, warnings
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("ONLY"), len(os.environ))
warnings.warn("shown on stderr")
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 2])
def test_a_script_gets_its_argv_folder_and_environment_and_returns_its_exit_code(tmp_path, code):
    (tmp_path / "job").mkdir()
    (tmp_path / "script.py").write_text(SCRIPT)
    done = run_python([tmp_path / "script.py", code, "x"], cwd=tmp_path / "job", env={"ONLY": "1"}, timeout=60)
    assert done.returncode == code
    assert done.stdout == f"argv ['{code}', 'x'] cwd job env 1 1\n"
    assert "UserWarning: shown on stderr" in done.stderr and "to stderr" in done.stderr


def test_an_exception_is_a_traceback_and_exit_code_1_and_a_module_runs_as_main(tmp_path):
    (tmp_path / "broken.py").write_text("raise ValueError('planted')\n")
    broken = run_python([tmp_path / "broken.py"], cwd=tmp_path, env={}, timeout=60)
    assert broken.returncode == 1 and "ValueError: planted" in broken.stderr
    (tmp_path / "mod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    module = run_python(["-m", "mod", "a"], cwd=tmp_path, env={}, timeout=60)
    assert module.returncode == 0 and module.stdout == "__main__ ['a']\n"


def test_a_child_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    (tmp_path / "hang.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_python([tmp_path / "hang.py"], cwd=tmp_path, env={"PATH": ""}, timeout=3)
    assert time.monotonic() - start < 30
    grandchild = int(caught.value.output.strip())
    deadline = time.monotonic() + 10
    while running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(grandchild)  # killed with the child's process group


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan waits for whoever reaps it)."""
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
