"""One request becomes one job: a chat completion's body, a response's (converted to a chat
body) or a batch line's. The job's tenant is the request's; its priority class the body's
``priority`` (openai_api.py); a model that names an adapter asks for it, as in vLLM's server.
"""

from __future__ import annotations

from typing import Any

from edgeq.producer.client import ChatClient, ChatJob
from edgeq.resources.model_names import ModelNames
from edgeq.resources.openai_api import ChatCompletionRequest


class ModelNotServed(LookupError):
    """The body's ``model`` is none of the names served here; the message lists them."""

    def __init__(self, model: str, names: list[str]) -> None:
        super().__init__(
            f"the model {model!r} does not exist here; this gateway serves "
            f"{', '.join(names)} (EDGEQ_MODEL, EDGEQ_GATEWAY_MODEL_ALIASES, adapters)"
        )


async def submit(
    client: ChatClient,
    models: ModelNames,
    body: ChatCompletionRequest,
    tenant: str | None,
    *,
    idempotency_key: str | None = None,
    key_name: str | None = None,
) -> tuple[ChatJob, dict[str, Any]]:
    """Enqueue the body's job for ``tenant``: the job, and the edgeq fields it was sent with
    (less its messages). Raises ModelNotServed, UnsupportedField (a field edgeq cannot
    honour) or what ChatClient refuses (an EdgeqError: a full queue, Redis away, an
    ``idempotency_key`` given to another request). With ``idempotency_key``, the same request
    sent again gets the first one's job (ChatClient.submit). ``key_name``: the name of the API
    key it came with (its own limits and ledger rows)."""
    names = await models.names()
    if body.model not in names:
        raise ModelNotServed(body.model, names)
    fields = body.edgeq_fields()
    if tenant is not None:
        fields["tenant"] = tenant
    if key_name is not None:
        fields["key_name"] = key_name
    if body.model in await models.adapters():  # as vLLM's server: an adapter is a model
        fields["adapter"] = body.model
    job = await client.submit(fields.pop("messages"), idempotency_key=idempotency_key, **fields)
    return job, fields
