"""Ctrl-C leaves no process: SIGINT to `dgr up`'s process group (what a terminal's Ctrl-C sends)
stops the gateway, the workers and the tracker, and `dgr up` exits 0. Runs last: it stops the
session's swarm."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from conftest import alive, descendants, process_name, wait_until


@pytest.mark.shutdown
def test_ctrl_c_stops_dgr_up_and_leaves_no_process(swarm):
    for c in swarm.clients:
        c.close()  # no idle keep-alive connection left to the gateway
    children = descendants(swarm.proc.pid)
    names = {pid: process_name(pid) for pid in children}
    workers = [p for p, n in names.items() if " worker " in f" {n} "]
    trackers = [p for p, n in names.items() if " tracker " in f" {n} "]
    assert len(workers) == 2 and len(trackers) == 1, f"expected 2 workers and a tracker under dgr up, found {names}"

    os.killpg(swarm.proc.pid, signal.SIGINT)
    try:
        code = swarm.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"dgr up still runs 15 s after Ctrl-C; its log:\n{swarm.log.read_text()[-3000:]}") from None
    assert code == 0, f"dgr up exited {code} after Ctrl-C; its log:\n{swarm.log.read_text()[-3000:]}"
    still = lambda: [(p, names[p]) for p in children if alive(p)]  # noqa: E731
    try:
        wait_until("every process dgr up started to exit", lambda: not still(), timeout=5)
    except AssertionError:
        raise AssertionError(f"processes left 5 s after dgr up exited: {still()}") from None
