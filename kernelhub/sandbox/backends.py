"""Pick and build the sandbox backend the settings ask for."""

from __future__ import annotations

from kernelhub.config import Settings
from kernelhub.errors import BackendUnavailableError
from kernelhub.sandbox.base import SandboxBackend


def make_backend(
    settings: Settings, *, instance: str = "default", gateway_id: str = ""
) -> SandboxBackend:
    """``auto``: docker when a daemon answers, else local with bubblewrap (else the
    unisolated local mode if, and only if, the settings allow it). ``gateway_id``: the
    identity from the data directory's lock (``kernelhub.datadir``)."""
    from kernelhub.sandbox.docker import DockerBackend, docker_available
    from kernelhub.sandbox.local import LocalBackend

    choice = settings.backend
    if choice == "auto":
        choice = "docker" if docker_available(settings.docker.base_url) else "local"
    if choice == "docker":
        return DockerBackend(
            image=settings.docker.image,
            run_dir=settings.run_dir,
            instance=instance,
            runtime=settings.docker.runtime,
            base_url=settings.docker.base_url,
            gateway_id=gateway_id,
            egress=settings.egress,
            run_dir_max_bytes=settings.docker.run_dir_max_bytes,
        )
    if choice == "local":
        return LocalBackend(
            run_dir=settings.run_dir,
            instance=instance,
            unisolated=settings.local.unisolated,
            gateway_id=gateway_id,
        )
    raise BackendUnavailableError(f"unknown backend {choice!r}; use auto, docker or local")
