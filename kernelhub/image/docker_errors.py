"""Where docker SDK errors raised by the image code become kernelhub errors.

Every call into the docker SDK from :mod:`kernelhub.image` runs inside
:func:`docker_errors`, which re-raises with ``raise ... from exc``:

    requests ConnectionError, daemon unreachable  -> BackendUnavailableError
    docker.errors.ContainerError                  -> <error>, with the container's stderr
    docker.errors.APIError / BuildError / other   -> <error>  (ImageBuildError by default)
    requests timeouts and other transport errors  -> <error>
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import docker.errors
import requests.exceptions

from kernelhub.errors import BackendUnavailableError, ImageBuildError, ImageError


@contextmanager
def docker_errors(action: str, error: type[ImageError] = ImageBuildError) -> Iterator[None]:
    """Translate docker SDK and transport errors raised in the block; ``action`` says what
    was being done ("probing base image X") and starts the message."""
    try:
        yield
    except requests.exceptions.ConnectionError as exc:
        raise BackendUnavailableError(
            f"cannot reach the Docker daemon while {action}: {exc}; is it running, and is "
            "KERNELHUB_DOCKER__BASE_URL (or DOCKER_HOST) right?"
        ) from exc
    except docker.errors.ContainerError as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else ""
        raise error(
            f"{action} failed: the container exited with status {exc.exit_status}"
            + (f"\n{stderr.strip()}" if stderr.strip() else "")
        ) from exc
    except docker.errors.APIError as exc:
        detail = exc.explanation or str(exc)
        if isinstance(detail, bytes):
            detail = detail.decode(errors="replace")
        raise error(f"{action} failed: {detail}") from exc
    except docker.errors.BuildError as exc:
        raise error(f"{action} failed: {exc.msg}") from exc
    except docker.errors.DockerException as exc:
        if "connection" in str(exc).lower():
            raise BackendUnavailableError(
                f"cannot reach the Docker daemon while {action}: {exc}"
            ) from exc
        raise error(f"{action} failed: {exc}") from exc
    except requests.exceptions.RequestException as exc:
        raise error(f"{action} failed talking to the Docker daemon: {exc}") from exc
