"""The tutorials' MNIST CNN."""
