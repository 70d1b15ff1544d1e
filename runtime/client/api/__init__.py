"""OpenAI-compatible HTTP API of the attention client: app, protocol, prepare, chat_template,
logprobs, responses, streaming, server (see :mod:`.app`)."""
