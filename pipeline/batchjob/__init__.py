"""OpenAI Batch jobs (`pipeline run-batch`): a file of chat or completion requests in, one
response line per request out, run through the broker and consumers."""
