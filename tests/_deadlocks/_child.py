"""The deadlock scripts' one way to wait for a forked child that may be stuck."""

import os
import signal
import sys
import time


def exited_within(pid: int, seconds: float = 15.0) -> bool:
    """Whether child ``pid`` exits within ``seconds``; if not, it writes its stacks
    (SIGUSR1, with faulthandler registered before the fork) and is killed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return True
        time.sleep(0.2)
    print(f"child {pid} stuck for {seconds:.0f} s; its stack:", file=sys.stderr)
    os.kill(pid, signal.SIGUSR1)
    time.sleep(1)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return False
