"""EaaS Kubernetes operator (kopf): ExpertPool and AttentionFleet."""
