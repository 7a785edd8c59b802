"""The commands run on a run dir's checkpoints: export (to Hugging Face), generate, evaluate."""
