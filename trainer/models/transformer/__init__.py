"""The Llama-style transformer family: the network, its shapes, tensor parallelism and the
Hugging Face families it reads and writes."""
