"""Campaigns that run the real commands under faults and judge every run with the product's
own checker (`pipeline.audit`): kills and crash points (`kills.py`, `runs.py`), the soak
(`soak.py`), power cuts on a real kernel (`powercuts.py`), all driven by `procs.py`; the
seeded I/O fault layers (`faults.py`); their figures (`timing.py`, pure)."""
