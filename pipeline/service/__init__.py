"""The batch service (`pipeline serve`): OpenAI's Files and Batches API over this machine's
engine, each batch run by an executor (`runner.py`) that the scheduler drives."""
