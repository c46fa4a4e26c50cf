"""``python -m lightning_fl.flower.submit APP SUPERLINK [flwr run options]``: ``flwr run --stream`` with an exit status.

``flwr run --stream`` returns 0 once the log stream ends, whether the ServerApp finished or failed (Flower's
ServerApp exits with its own code, e.g. 201 for an exception, which the CLI does not pass on). This command submits
the run (``flwr run APP SUPERLINK --format json`` plus the options given, e.g. ``--run-config``), streams its log
(``flwr log RUN SUPERLINK --stream``), reads its final status (``flwr ls SUPERLINK --run-id RUN``) and exits 0 only
for ``finished:completed``; a run that failed or was stopped ends with one line naming the run, its status and how
to see its log, and exit code 2 (also for a run the SuperLink refused to start).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from lightning_fl.flower.supernode import executable

STATUS_WAIT = 60.0  # seconds to wait, after the log stream ends, for the SuperLink to report the run finished


def _json(text: str) -> dict:
    """The JSON object in ``text`` (the CLI may print a line before it)."""
    start = text.find("{")
    try:
        return json.loads(text[start:]) if start >= 0 else {}
    except ValueError:
        return {}


def _last_line(*texts: str) -> str:
    lines = [line.strip() for text in texts for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def status(flwr: str, superlink: str, run_id: int) -> tuple[str, str]:
    """Run ``run_id``'s status (e.g. ``finished:failed``) and its details, as ``flwr ls`` reports them."""
    got = subprocess.run(
        [flwr, "ls", superlink, "--run-id", str(run_id), "--format", "json"], capture_output=True, text=True
    )
    runs = _json(got.stdout).get("runs") or [{}]
    return str(runs[0].get("status", "unknown")), str(runs[0].get("status-details", ""))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if len(args) < 2 or args[0].startswith("-") or args[1].startswith("-"):
        print("error: usage: python -m lightning_fl.flower.submit APP SUPERLINK [flwr run options]", file=sys.stderr)
        return 2
    flwr = executable("flwr")
    if flwr is None:
        print('error: flwr not found: pip install "lightning-fl[flower]" (flwr 1.42)', file=sys.stderr)
        return 2
    superlink = args[1]
    started = subprocess.run([flwr, "run", *args, "--format", "json"], capture_output=True, text=True)
    payload = _json(started.stdout)
    if started.returncode != 0 or not payload.get("success") or not payload.get("run-id"):
        print(f"error: the run did not start: {_last_line(started.stdout, started.stderr)}", file=sys.stderr)
        return 2
    run_id = int(payload["run-id"])
    print(f"run {run_id} started on {superlink}", flush=True)
    try:
        subprocess.run([flwr, "log", str(run_id), superlink, "--stream"])  # (its output: the run's log, as it comes)
    except KeyboardInterrupt:
        print(f"error: interrupted; run {run_id} goes on (flwr stop {run_id} {superlink} stops it)", file=sys.stderr)
        return 130
    deadline = time.monotonic() + STATUS_WAIT
    state, details = status(flwr, superlink, run_id)
    while not state.startswith("finished") and time.monotonic() < deadline:
        time.sleep(1.0)
        state, details = status(flwr, superlink, run_id)
    if state == "finished:completed":
        print(f"run {run_id} {state}", flush=True)
        return 0
    why = f" ({details})" if details else ""
    show = f"flwr log {run_id} {superlink} --show"
    print(f"error: run {run_id} did not complete: its status is {state}{why}; its log: {show}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
