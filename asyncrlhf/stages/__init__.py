"""The offline stages of the seed workflow, one command each, and the evaluation they share with the
evaluator service:

    asyncrlhf sft       supervised fine-tuning (data, or best-of-n samples picked by the gold reward)
    asyncrlhf relabel   order preference pairs (given, or sampled) by the gold reward
    asyncrlhf train-rm  Bradley-Terry reward model, usable as a `model` reward scorer
    asyncrlhf generate  held-out completions from checkpoints (HF or vLLM backend)
    asyncrlhf eval      gold reward, win rate, KL and perplexity of those completions

`configs/pipeline_full.yaml` chains them with online RL (docs/pipeline.md).
"""
