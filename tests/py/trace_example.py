# The h5py example of docs/trace-format.md, runnable: prints the first
# non-finite probe of the forward phase of a trace.h5. test_trace_writer.cpp
# runs it on a written trace and checks that the doc still quotes it verbatim.
# Usage: /usr/bin/python3 tests/py/trace_example.py TRACE.h5
import sys

import h5py
import numpy as np

with h5py.File(sys.argv[1], "r") as f:
    p = {name: column[()] for name, column in f["probes"].items()}
    bad = (p["phase"] == b"forward") & (p["nan_count"] + p["inf_count"] > 0)
    rows = np.flatnonzero(bad)
    if rows.size == 0:
        print("no non-finite forward probe")
    else:
        # Execution order: step, micro-batch, site order, rank, lowest index.
        keys = (p["first_nonfinite"][rows], p["rank"][rows], p["order"][rows],
                p["micro_batch"][rows], p["step"][rows])
        r = rows[np.lexsort(keys)[0]]
        print(f"step={p['step'][r]} micro_batch={p['micro_batch'][r]} "
              f"site={p['site'][r].decode()} head={p['head'][r]} "
              f"kind={p['first_kind'][r].decode()} index={p['first_index'][r].decode()}")
