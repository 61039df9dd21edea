"""Reliability: the total-queue checker every crash, fault and fuzz campaign judges its runs
with (`checker.py`, pure) and the readers that feed it from a run's files (`sources.py`)."""
