"""The real-server helper the engine tests and the served experiment start servers with
(`tests.engines.real_servers.running`): a server that dies at start is reported at once with its
log (not as a server that never answered by the deadline)."""

from __future__ import annotations

import sys

import pytest

from tests.engines.real_servers import ServerFailed, running


def test_a_server_that_exits_at_start_is_reported_with_its_exit_code_and_log(tmp_path):
    def build(port: int) -> list[str]:
        return [sys.executable, "-c", f"print('no model at port {port}'); raise SystemExit(3)"]

    with pytest.raises(ServerFailed, match=r"exited 3: no model at port \d+"):
        with running(build, tmp_path / "server.log", start_s=5):
            pytest.fail("a dead server was reported ready")
