"""Imported at start-up by every Python process a test job starts (this directory is put
first on the job's PYTHONPATH by :func:`tests._procs.run_job`): SIGUSR1 makes the process
write every thread's stack to its stderr. A forked child (a DataLoader worker) inherits
the handler. When a job runs past its deadline, ``run_job`` signals each of its
processes, so a hang fails the test with the stacks of every process in it.
"""

import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
