"""deqzoo: the model zoo and pretrained-model hub for deep equilibrium models."""

__version__ = "0.1.0"
