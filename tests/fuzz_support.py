"""What the fuzz tests share: the daemon they fuzz, their budget, and the tally of cases tried (printed, and what
docs/security.md reports).

The budget is small in CI (a few seconds per fuzzer); GPUD_FUZZ_EXAMPLES raises it for a longer run, e.g.
`GPUD_FUZZ_EXAMPLES=1000 .venv/bin/python -m pytest -q -s tests/test_fuzz_*.py`. Hypothesis runs derandomized, so
a CI run tries the same cases every time.
"""
from __future__ import annotations

import collections
import os
from pathlib import Path

from hypothesis import HealthCheck, settings

from gpud.examples import write_example_repository
from tests.daemon_harness import Daemon, start_daemon

TOKEN = "fuzz-admin-token-0123456789abcdef"
EXAMPLES = int(os.environ.get("GPUD_FUZZ_EXAMPLES", "15"))


def fuzz_settings(max_examples: int = EXAMPLES) -> settings:
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True)


def start_fuzz_daemon(tmp: Path) -> Daemon:
    """The real daemon, model control open (explicit, every model loaded) behind an admin token, so that every
    route has something to do."""
    repo = tmp / "repo"
    write_example_repository(repo, ["mlp", "two_input"])
    token_file = tmp / "token"
    token_file.write_text(TOKEN)
    return start_daemon(repo, tmp, "--model-control-mode", "explicit", "--load-model", "*",
                        "--admin-token-file", str(token_file), "--allow-client-shm", "true", node=None)


def assert_clean_log(daemon: Daemon) -> None:
    """No traceback and no error logged: every fuzzed input was a client's mistake, answered as one."""
    log = daemon.log()
    assert "Traceback" not in log, log[-20000:]
    errors = [line for line in log.splitlines() if " ERROR " in line or " CRITICAL " in line]
    assert not errors, errors[:20]


class Tally:
    """Cases tried and their statuses (for raw HTTP: the first answer's), by fuzzer."""

    def __init__(self, name: str):
        self.name = name
        self.cases = 0
        self.statuses: collections.Counter = collections.Counter()

    def add(self, status) -> None:
        self.cases += 1
        self.statuses[status] += 1

    def report(self) -> str:
        by_status = ", ".join(f"{k}: {v}" for k, v in sorted(self.statuses.items(), key=lambda kv: str(kv[0])))
        return f"{self.name}: {self.cases} cases ({by_status})"
