"""What a batch job is asked (the command line, parsed and checked: `JobSpec`) and what it
answered (`JobSummary`, the summary file's and OpenAI's batch object's counts)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.batchjob.tools import ToolCalling
from pipeline.batchjob.workload import PromptLimits
from pipeline.runtime.settings import LaunchSettings

OUTPUT_ORDERS = ("input", "completion")


@dataclass(slots=True)
class JobSpec:
    """What the user asked for (the command line, parsed and checked)."""

    input_path: str
    output_path: str
    model_dir: str
    served_model: str
    settings: LaunchSettings  # data_dir set
    data_dir_given: bool
    output_order: str = "input"
    error_file: str | None = None
    report_path: str | None = None
    summary_path: str | None = None
    overwrite: bool = False
    keep_data_dir: bool = False
    limits: PromptLimits = field(default_factory=PromptLimits)
    tool_calling: ToolCalling = field(default_factory=ToolCalling)
    chat_template: str | None = None  # --chat-template's text, over the model directory's
    input_scan: str | None = None  # a scan of the input kept beforehand (`prescan.py`): the service's
    node_dir: str | None = None  # the data directory of a node that serves already (the service's): run there


@dataclass(slots=True)
class JobSummary:
    """What a job answered, across its runs, and how this run went."""

    requests: int
    completed: int
    failed: int
    failed_by_status: dict[int, int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    run_wall_s: float
    run_answered: int
    paced_by: str
    output_written: bool

    def as_json(self) -> dict:
        """As OpenAI's batch object counts them (request_counts, usage), and this run."""
        return {
            "request_counts": {"total": self.requests, "completed": self.completed, "failed": self.failed},
            "failed_by_status": {str(k): v for k, v in self.failed_by_status.items()},
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                      "total_tokens": self.prompt_tokens + self.completion_tokens,
                      "cached_tokens": self.cached_tokens},
            "cached_share": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "this_run": {"wall_s": self.run_wall_s, "answered": self.run_answered,
                         "requests_per_s": self.run_answered / self.run_wall_s if self.run_wall_s > 0 else None,
                         "paced_by": self.paced_by},
            "output_written": self.output_written,
        }
