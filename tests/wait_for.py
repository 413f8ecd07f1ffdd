"""Waiting for a condition in the tests: another process's file, answer or state.
    python3 tests/wait_for.py FILE...   waits (up to 120 s) until every FILE is non-empty
"""
import os
import sys
import time


def wait_for(done, seconds=60, poll=0.1):
    """Calls `done` until it returns a true value or `seconds` pass; returns its last value."""
    deadline = time.monotonic() + seconds
    while True:
        value = done()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(poll)  # the poll interval: the condition has no event to wait on


if __name__ == "__main__":
    files = sys.argv[1:]
    if not wait_for(lambda: all(os.path.exists(f) and os.path.getsize(f) > 0 for f in files), seconds=120):
        sys.exit(f"not written within 120 s: {files}")
