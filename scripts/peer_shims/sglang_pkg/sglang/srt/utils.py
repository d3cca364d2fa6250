import os
import signal


def kill_process_tree(pid, *a, **k):
    from sglang.test import test_utils
    p = test_utils._LAUNCHED.pop(pid, None)
    if p is not None:
        p.stop()
    else:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
