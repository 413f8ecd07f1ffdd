"""Running a list of test cases against one context: each case a function of the context;
a failure is printed with its traceback and the next case runs."""
import traceback


def run_cases(cases, ctx, passed="case {}: ok", failed="case {}: FAILED\n{}"):
    """Calls each case with `ctx`; prints `passed` or `failed` (formatted with the case's name,
    and the traceback) per case; returns how many passed."""
    count = 0
    for fn in cases:
        try:
            fn(ctx)
            count += 1
            print(passed.format(fn.__name__), flush=True)
        except Exception:
            print(failed.format(fn.__name__, traceback.format_exc()), flush=True)
    return count
