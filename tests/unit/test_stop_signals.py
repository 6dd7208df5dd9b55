"""The worker's stop signals (dsrun.worker.StopFlag): the first signal counts; SIGTERM and SIGUSR1 are a
preemption, whose grace period ends a rank that has not saved by then (one line, exit code 143) unless the save
settled it; Ctrl-C starts none. Real signals to this process, its handlers restored afterwards; the rank's
``os._exit`` is caught."""
import os
import queue
import signal
import time

import pytest

from dsrun import worker
from dsrun.launcher.protocol import STOP_SIGNALS


@pytest.fixture
def exits(monkeypatch):
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    codes: queue.Queue = queue.Queue()
    monkeypatch.setattr(worker.os, "_exit", codes.put)
    yield codes
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_preempted_rank_that_does_not_save_within_its_grace_says_so_and_exits_143(exits, capsys):
    ctrl_c = worker.StopFlag(grace_s=0.2)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.4)
    assert (ctrl_c.signal, ctrl_c.since, exits.empty()) == (signal.SIGINT, None, True)  # no grace period
    ctrl_c.settle()
    ctrl_c.start_grace()  # (its watch ends)

    saved = worker.StopFlag(grace_s=0.2)
    os.kill(os.getpid(), signal.SIGTERM)
    saved.settle()  # the checkpoint was saved in time
    time.sleep(0.4)
    assert saved.signal == signal.SIGTERM and exits.empty()

    late = worker.StopFlag(grace_s=0.3)
    late.on_expiry = lambda: "[dsrun] rank 0: the record of where the run stood is written"
    os.kill(os.getpid(), signal.SIGUSR1)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal: the first one counts
    assert exits.get(timeout=10) == 143
    assert late.signal == signal.SIGUSR1
    assert capsys.readouterr().err == "[dsrun] rank 0: the record of where the run stood is written\n"
