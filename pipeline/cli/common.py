"""What the commands share: their options' help texts, logging to stderr, the Ray check and
the default engine."""

from __future__ import annotations

import logging
import sys

import click

from pipeline.wire.textfiles import for_terminal

# What --shape-order says (`pipeline broker start` says it too).
SHAPE_ORDER_HELP = ("Which shape a consumer drains next: prefix (the one sharing the longest chain of prefixes "
                    "with the last, SPEC 4b; the default) or most-tokens (the design note's rule).")
# What --dispatch says (`pipeline broker start` says it too).
DISPATCH_HELP = ("The dispatch policy: sticky (the product's, default), or a baseline for comparison: fifo (oldest "
                 "item first across shapes), round-robin (across shapes), no-lanes (sticky, one queue per shape, "
                 "with the shape order and affinity set).")
# One storage tier (segment files), two places for it: `pipeline broker start` says it too.
STORAGE_HELP = ("Where the store's segment files live: disk (the data directory; durable, the default) or "
                "memory (the same files on tmpfs: in RAM, gone when the broker stops).")

# What --metrics-token-file says (`pipeline broker start` and `run-batch` say it too).
METRICS_TOKEN_HELP = ("A file (0600, yours) of one bearer token: the metrics are then served to any request with "
                      "`Authorization: Bearer TOKEN` (Prometheus: authorization.credentials_file), and only to those.")
# What `--engine-options` says (launch, run-batch and the consumer stage).
ENGINE_OPTIONS_HELP = ("The engine's options, KEY=VALUE,KEY=VALUE (repeatable; values as in TOML: 32, 0.9, true, "
                       "text), over the config file's [engine_options]: vllm takes model=DIR, "
                       "gpu_memory_utilization=0.9, ...")
# What --max-batch-tokens says (run-batch and `pipeline consumer start` say it too).
MAX_BATCH_TOKENS_HELP = "Consumer contract: padded tokens per batch (default 65536)."


class _TerminalFormatter(logging.Formatter):
    """Log lines with what a terminal would act on escaped (a path holding ESC or CR)."""

    def format(self, record: logging.LogRecord) -> str:
        return for_terminal(super().format(record))


def setup_logging(verbose: bool) -> None:
    """Log lines on stderr (the processes a run forks log the same way)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TerminalFormatter("%(asctime)s %(processName)s %(name)s %(levelname)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, handlers=[handler])


def check_ray(address: str) -> None:
    """Ray importable and something answering at `address`, before anything is made on disk;
    else a one-line error."""
    from pipeline.cluster.driver import ClusterError, check_address_answers, ray_module

    try:
        ray_module()
        check_address_answers(address)
    except ClusterError as exc:
        raise click.ClickException(str(exc)) from exc


def default_engine() -> str:
    """vllm where it is installed; elsewhere a one-line error saying how to get it."""
    from pipeline.consumer.engines.vllm import INSTALL_HINT, vllm_installed

    if vllm_installed():
        return "vllm"
    raise click.ClickException(f"run-batch runs vllm by default, and vLLM is not installed here: {INSTALL_HINT}; "
                               f"or pass --engine sim (made-up outputs)")
