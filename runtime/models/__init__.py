"""Model adapters: Hugging Face MoE architectures, tiny default model, expert weight loading."""
