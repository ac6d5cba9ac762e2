"""What a launched process sees of itself, as one JSON line; ``python -m
tests.launch_probe CODE [SLEEP_S]`` then exits with CODE. ``python -m
tests.launch_probe nest SLEEP_S`` starts a probe of its own (``7 SLEEP_S``) through a
Launcher, prints which zygote that used and the inner probe's line, then waits for it
and prints its exit code. ``python -m tests.launch_probe hold`` takes hivemind's
cross-process locks and waits to be killed; ``python -m tests.launch_probe locks``
prints which of them it could take within ``LOCK_WAIT_S``."""

import json
import os
import random
import sys
import time


def nest(sleep_s: str) -> None:
    from fusionllm.launcher import Launcher

    env = {**os.environ, "PROBE": "inner"}
    launcher = Launcher(env)
    inner = launcher.spawn(["7", sleep_s], module="tests.launch_probe", env=env, text_stdout=True)
    line = json.loads(inner.stdout.readline())
    netns = os.stat("/proc/self/ns/net").st_ino
    print(
        json.dumps({"own_zygote": launcher.zygote_pid, "inner": line, "ppid": os.getppid(), "netns": netns}), flush=True
    )
    print(json.dumps({"inner_code": inner.wait()}), flush=True)
    launcher.close()


LOCK_WAIT_S = 2.0


def _hivemind_locks() -> dict[str, object]:
    from hivemind.utils.asyncio import _AsyncContextWrapper
    from hivemind.utils.mpfuture import MPFuture, SharedBytes

    mpfuture = {"init": MPFuture._initialization_lock, "update": MPFuture._update_lock, "bytes": SharedBytes._lock}
    return {**mpfuture, "executor": _AsyncContextWrapper.EXECUTOR_LOCK}


if __name__ == "__main__" and sys.argv[1] == "nest":
    nest(sys.argv[2])
elif __name__ == "__main__" and sys.argv[1] == "hold":
    for lock in _hivemind_locks().values():
        lock.acquire()
    print(json.dumps({"held": os.getpid()}), flush=True)
    time.sleep(600)
elif __name__ == "__main__" and sys.argv[1] == "locks":
    print(json.dumps({k: lock.acquire(timeout=LOCK_WAIT_S) for k, lock in _hivemind_locks().items()}), flush=True)
elif __name__ == "__main__":
    me = {
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "argv": sys.argv[1:],
        "probe": os.environ.get("PROBE"),
        "leaked": os.environ.get("LAUNCHER_TEST_ONLY_IN_PARENT"),
        "random": random.random(),
        "stdin": sys.stdin.read(),
        "netns": os.stat("/proc/self/ns/net").st_ino,  # which network namespace it runs in
    }
    print(json.dumps(me), flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    sys.exit(int(sys.argv[1]))
