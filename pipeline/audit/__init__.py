"""The audit of a data directory (`pipeline tools check`): the total-queue checker
(`checker.py`, pure) and the readers that feed it from a run's files (`sources.py`). The
lab's campaigns (lab/reliability/) judge every run with the same two."""
