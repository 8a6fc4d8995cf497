"""kernelhub: stateful, sandboxed IPython kernels for LLM agents."""

__version__ = "0.1.0"

# Bumped whenever the contract between kernelhub and the kernel image changes (the
# in-kernel package, the container command, mount points). The image carries it as the
# label ``org.kernelhub.protocol``; kernelhub refuses an image with another value.
KERNEL_PROTOCOL_VERSION = "1"
