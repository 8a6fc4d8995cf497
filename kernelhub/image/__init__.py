"""The kernel image: what every Docker sandbox runs, and how kernelhub builds and checks it.

This module holds only the constants of the contract between kernelhub and the image
(``kernel-image/Dockerfile``); the docker backend imports them, and a unit test checks
the Dockerfile against them. Importing it pulls in nothing heavy: the builder lives in
:mod:`kernelhub.image.build` (``build_image``, ``check_image``, ``ImageInfo``).

    build.py          build_image(): base -> wheels -> docker build; check_image(); ImageInfo
    base.py           the base image: find it, debootstrap and import it, probe its Python
    wheels.py         pip download of the pinned wheels for the base's platform, cached
    docker_errors.py  docker SDK errors -> kernelhub errors, for all of the above
    process.py        run a host command (pip, debootstrap), streaming its output
"""

from __future__ import annotations

from kernelhub import KERNEL_PROTOCOL_VERSION

#: The image kernelhub uses unless told otherwise (``KERNELHUB_DOCKER__IMAGE``).
DEFAULT_IMAGE = f"kernelhub/kernel:p{KERNEL_PROTOCOL_VERSION}"
#: The debootstrapped Debian base that ``kernelhub image build`` makes when none exists.
BASE_IMAGE = "kernelhub/base:bookworm"
BASE_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"

#: The one user the kernel runs as; fixed so bind-mounted directories can be chowned to it.
SANDBOX_USER = "sandbox"
SANDBOX_UID = 10001
SANDBOX_GID = 10001

KERNEL_VENV = "/opt/kernel"
KERNEL_PYTHON = "/opt/kernel/bin/python"
#: On ``PYTHONPATH``; holds the in-kernel package ``kernelhub_kernel``.
KERNEL_PACKAGE_ROOT = "/opt/kernelhub"
#: matplotlib's font cache, built at image build time; the supervisor copies it to
#: ``MPLCONFIGDIR`` (``/tmp/.matplotlib``) at start because the root fs is read-only.
MPLCONFIG_SEED = "/opt/kernelhub/mplconfig"
WORKSPACE = "/workspace"
RUN_DIR = "/run/kernelhub"
CONNECTION_FILE = "/run/kernelhub/kernel.json"
IPC_DIR = "/run/kernelhub/ipc"
#: The egress proxy's socket, put in the socket directory by the gateway.
EGRESS_SOCKET = "/run/kernelhub/ipc/egress.sock"
#: The operator's egress CA (mounted read-only when configured), and the bundle the
#: supervisor writes from it and the image's roots, which SSL_CERT_FILE names.
EGRESS_CA = "/run/kernelhub/egress-ca.pem"
TRUST_BUNDLE = "/tmp/.kernelhub/ca-bundle.pem"
#: The operator's wheelhouse, mounted read-only when configured (`pip install` in a cell).
WHEELHOUSE = "/opt/wheelhouse"

#: The container command (also the image's CMD); kernelhub passes it explicitly.
KERNEL_COMMAND: tuple[str, ...] = (
    KERNEL_PYTHON,
    "-m",
    "kernelhub_kernel.supervisor",
    "--connection-file",
    CONNECTION_FILE,
)

# Labels. Kernel images carry PROTOCOL, VERSION, MANAGED, PYTHON and ROLE=kernel; the
# debootstrapped base carries BASE=bookworm and ROLE=base (the kernel image inherits BASE,
# so lookups for the base also filter on ROLE).
LABEL_PROTOCOL = "org.kernelhub.protocol"
LABEL_VERSION = "org.kernelhub.version"
LABEL_MANAGED = "org.kernelhub.managed"
LABEL_PYTHON = "org.kernelhub.python"
LABEL_BASE = "org.kernelhub.base"
LABEL_ROLE = "org.kernelhub.role"

__all__ = [
    "BASE_IMAGE",
    "BASE_SUITE",
    "CONNECTION_FILE",
    "DEBIAN_MIRROR",
    "DEFAULT_IMAGE",
    "EGRESS_CA",
    "EGRESS_SOCKET",
    "IPC_DIR",
    "KERNEL_COMMAND",
    "KERNEL_PACKAGE_ROOT",
    "KERNEL_PYTHON",
    "KERNEL_VENV",
    "LABEL_BASE",
    "LABEL_MANAGED",
    "LABEL_PROTOCOL",
    "LABEL_PYTHON",
    "LABEL_ROLE",
    "LABEL_VERSION",
    "MPLCONFIG_SEED",
    "RUN_DIR",
    "SANDBOX_GID",
    "SANDBOX_UID",
    "SANDBOX_USER",
    "TRUST_BUNDLE",
    "WHEELHOUSE",
    "WORKSPACE",
]
