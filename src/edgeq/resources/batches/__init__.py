"""OpenAI's Files and Batches on the queue: the store, the runner, ``edgeq batch``."""
