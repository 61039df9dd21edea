"""`pipeline serve`'s job options: run-batch's own click options, handed to every job as
given (paths made absolute, flags for vLLM's parser kept as typed), nothing else."""

from __future__ import annotations

import os

from pipeline.cli.batch import run_batch
from pipeline.cli.serve import JOB_OPTIONS, _job_args, serve


def test_the_job_options_are_run_batchs_own():
    mine = {param.name: param for param in serve.params}
    theirs = {param.name: param for param in run_batch.params}
    assert all(mine[name] is theirs[name] for name in JOB_OPTIONS)


def test_the_options_given_are_handed_to_every_job(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    ctx = serve.make_context("serve", ["--data-dir", "d", "--model", str(model), "--engine", "sim",
                                       "--producers", "2", "--set", "broker.max_age_s=3", "--set", "x=1", "-tp", "1",
                                       "--enable-auto-tool-choice", "--dtype", "bfloat16", "--port", "9"])
    args = _job_args(ctx, ctx.params)
    assert args == ["--model", os.path.abspath(model), "--engine", "sim", "--producers", "2",
                    "--enable-auto-tool-choice", "--set", "broker.max_age_s=3", "--set", "x=1",
                    "--tensor-parallel-size", "1", "--dtype", "bfloat16"]


def test_defaults_are_left_to_the_job():
    ctx = serve.make_context("serve", ["--data-dir", "d", "--model", "."])
    assert _job_args(ctx, ctx.params) == ["--model", os.path.abspath(".")]
