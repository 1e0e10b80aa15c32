"""The rollout side: what turns prompts into a batch the trainers learn from.

- `prompts`: the prompt sources (JSONL/Parquet files, a resumable order)
- `generate`: how prompts become responses (the engines; the seam for user rollout functions)
- `rewards/`: graders of a response against its label (built-in and custom)
- `manager`: one step's flow: generate -> grade -> shape -> filter -> advantages
- `batch`: responses packed into a TrainBatch, and the step's rollout metrics
"""
