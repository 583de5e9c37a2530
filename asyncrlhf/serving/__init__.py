"""What the generator serves beside the training loop: the backend gate that schedules the loop's batches,
API requests and weight swaps (`gate`), and the OpenAI-compatible HTTP API (`openai`)."""
