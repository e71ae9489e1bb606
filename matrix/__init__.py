"""attnx.matrix: the parity / verify / bench / audit matrix of a plan, run on this machine (a process
pool) or across a Ray cluster, into one report (report.json and a case x host report.md).

By job: _plan (the plan file and its cases), _worker (one case in a process of its own, running
attnx's parity, verify, bench or audit code; the host it ran on), _content (files sent to nodes by their
sha256, checked there), _report (the report, rewritten atomically after every case), _run (the
driver and the local pool), _ray (the Ray executor; ray is imported only inside its functions).
"""

from __future__ import annotations

from attnx.matrix._plan import BENCH_SLOT, JOBS, CaseSpec, MatrixPlan, load_plan
from attnx.matrix._ray import RayExecutor
from attnx.matrix._report import FINISHED, SCHEMA, STATUSES, MatrixReport, markdown
from attnx.matrix._run import LocalExecutor, run_matrix

__all__ = [
    "BENCH_SLOT",
    "FINISHED",
    "JOBS",
    "SCHEMA",
    "STATUSES",
    "CaseSpec",
    "LocalExecutor",
    "MatrixPlan",
    "MatrixReport",
    "RayExecutor",
    "load_plan",
    "markdown",
    "run_matrix",
]
