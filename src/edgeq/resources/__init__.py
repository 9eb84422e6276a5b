"""OpenAI's resources on the queue, with no HTTP in them: the wire format, the model names a
request may ask for, the one ``submit`` that turns a request into a job, webhooks, batches
(store, runner, the ``edgeq batch`` command) and responses (events, store, follower).

The gateway (``edgeq.gateway``) serves them over HTTP; ``edgeq batch`` runs them without it.
Nothing here imports FastAPI, Starlette or the gateway (tests/test_layout.py).
"""
