"""Two packages of one model, A/B, paired rounds: new tokens a second of attnx.load(PKG).generate, 1 and 8 requests
of 32 new tokens, 4 rounds (stop 59: the buffer form served from the plans against the BufferForm pass before it).

    python ab_served.py BEFORE_PKG AFTER_PKG
"""
import json
import statistics
import sys
import time

import numpy as np

import attnx

pk = {"before (stop 58, BufferForm pass)": sys.argv[1], "after (served from the plans)": sys.argv[2]}
models = {k: attnx.load(v) for k, v in pk.items()}
rng = np.random.default_rng(0)
prompts = [[int(t) for t in rng.integers(100, 20000, n)] for n in (40, 17, 64, 9, 33, 25, 50, 12)]
res = {k: {1: [], 8: []} for k in pk}
tokens = {}
for _r in range(4):
    for k, m in models.items():
        for n in (1, 8):
            t = time.perf_counter()
            out = m.generate(prompts[:n], max_new_tokens=32)
            dt = time.perf_counter() - t
            res[k][n].append(32 * n / dt)
            tokens[(k, n)] = out
print(json.dumps({k: {n: {"best": max(v), "median": statistics.median(v)} for n, v in d.items()} for k, d in res.items()}, indent=1))
print("same tokens:", all(tokens[(list(pk)[0], n)] == tokens[(list(pk)[1], n)] for n in (1, 8)))
