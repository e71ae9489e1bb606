import atexit, gc, time
_orig = gc.collect
stats = [0, 0.0]
auto = {"n": 0, "t": 0.0, "start": 0.0}
def _cb(phase, info):
    if phase == "start": auto["start"] = time.perf_counter()
    else: auto["n"] += 1; auto["t"] += time.perf_counter() - auto["start"]
gc.callbacks.append(_cb)
def _spy(*a, **k):
    t = time.perf_counter(); r = _orig(*a, **k); stats[0] += 1; stats[1] += time.perf_counter() - t; return r
gc.collect = _spy
atexit.register(lambda: print("\nGCSPY explicit", stats[0], round(stats[1], 2), "all collections", auto["n"], round(auto["t"], 2)))
