"""Consumer side: one process per GPU running batches on an engine runtime (SPEC §6)."""
