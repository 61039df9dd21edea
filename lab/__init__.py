"""The laboratory: what measures and attacks the product, never part of what it runs.
`bench/` holds the evaluation suite (`pipeline bench`), `reliability/` the kill, soak and
power-cut campaigns; `cli.py` the `bench` command, which `pipeline` loads only when it runs.
Its own third-party packages come with the `lab` extra (`bench/harness.py`'s LAB_INSTALL)."""

