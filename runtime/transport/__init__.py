"""Transports that move activations between attention clients and expert servers."""
