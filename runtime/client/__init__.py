"""Attention client: scheduler (continuous batching), dispatch/combine, OpenAI-compatible API."""
