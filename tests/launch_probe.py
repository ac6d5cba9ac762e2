"""What a launched process sees of itself, as one JSON line; ``python -m
tests.launch_probe CODE [SLEEP_S]`` then exits with CODE."""

import json
import os
import random
import sys
import time

if __name__ == "__main__":
    me = {
        "pid": os.getpid(),
        "sid": os.getsid(0),
        "cwd": os.getcwd(),
        "argv": sys.argv[1:],
        "probe": os.environ.get("PROBE"),
        "leaked": os.environ.get("LAUNCHER_TEST_ONLY_IN_PARENT"),
        "random": random.random(),
        "stdin": sys.stdin.read(),
    }
    print(json.dumps(me), flush=True)
    if len(sys.argv) > 2:
        time.sleep(float(sys.argv[2]))
    sys.exit(int(sys.argv[1]))
