"""EaaS: Expert-as-a-Service."""

__version__ = "0.1.0"
