"""Ending a process whose work is done without the interpreter's teardown.

After a clean shutdown the interpreter still tears down every module it imported; for a process that imported
torch and transformers that is one to two seconds of garbage collection, and whoever waits for the process (the
trainer for its rollout worker, a user's Ctrl-C or a test for the server, a shell for a command) waits for it too.
The memory it would free goes back to the operating system anyway, so such a process ends here instead: the exit
hooks still run (the user's included) and the logs and standard streams are flushed.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
from typing import NoReturn


def exit_without_teardown(code: int) -> NoReturn:
    """Run the exit hooks, flush the logs and the standard streams, and end the process with ``code``."""
    atexit._run_exitfuncs()  # the hooks a normal exit runs, without the teardown that follows them
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing left to flush into it
            pass
    os._exit(code)
