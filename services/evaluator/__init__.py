"""The evaluator service: follows checkpoint events, scores each evaluated policy with the gold reward,
exports the results as metrics, appends them to `<run.dir>/eval/results.jsonl`, keeps the report current."""
