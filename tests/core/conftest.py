"""The engine's tests exercise the fused kernels: compile (or load) them before the first test, so no test
silently runs the torch path while they compile in the background."""

from deqzoo.core import _kernels

_kernels.warm_up(block=True)
