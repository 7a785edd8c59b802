"""Parallelism: the plan that builds the device mesh and applies each technique to the model."""
