"""``edgeq bench``: one seeded chat workload, run through edgeq's queue, straight on the engine,
or against an OpenAI-compatible server, measured the way ``vllm bench serve`` measures."""
