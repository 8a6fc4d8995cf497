"""Every hardening choice for a sandbox container, in one pure function.

Read this file to know what a kernelhub container may and may not do. The unit test
``tests/unit/sandbox/test_docker_config.py`` pins each choice; the Docker posture test
checks from inside a live container that they are really in force.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from docker.models.containers import _create_container_args
from docker.types import LogConfig, Mount, Ulimit

from kernelhub.config import EgressSettings
from kernelhub.image import (
    CONNECTION_FILE,
    EGRESS_CA,
    IPC_DIR,
    KERNEL_PYTHON,
    SANDBOX_GID,
    SANDBOX_UID,
    TRUST_BUNDLE,
    WHEELHOUSE,
    WORKSPACE,
)
from kernelhub.kernel.connection import SessionDir
from kernelhub.sandbox.base import SandboxSpec
from kernelhub.sandbox.state import SANDBOX_PATH as STATE_PATH
from kernelhub.sandbox.state import spool_bytes

SHM_BYTES = 64 * 1024 * 1024
LOG_MAX_SIZE = "1m"  # the kernel's own output goes over ZeroMQ; the log only gets crashes


def create_args(config: dict[str, Any], api_version: str) -> dict[str, Any]:
    """``container_config``'s keyword arguments as the low-level
    ``APIClient.create_container`` takes them: the translation ``containers.create``
    makes, without the inspect it runs after (the caller inspects once, after start)."""
    return dict(_create_container_args({**config, "version": api_version}))


def container_config(
    spec: SandboxSpec,
    *,
    image: str,
    runtime: str,
    session_dir: SessionDir,
    instance: str,
    seccomp_profile: str,
    state_dir: Path | None = None,
    gateway: str = "",
    egress: EgressSettings | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``docker.from_env().containers.create``.

    ``seccomp_profile`` is the JSON text of kernelhub's own profile (Docker's default one
    lets code create AF_VSOCK sockets and use io_uring before Docker 25). ``state_dir``:
    the host's capped state directory; None where the host cannot mount one (a gateway in
    a container without CAP_SYS_ADMIN): then a tmpfs of Docker's, as capped, that dies with
    the container (crash recovery then has no checkpoints to restore from). ``egress``:
    the proxy's settings when the gateway serves it (see :func:`egress_config`).
    """
    limits = spec.limits
    tmpfs_opts = f"rw,nosuid,nodev,uid={SANDBOX_UID},gid={SANDBOX_GID},mode=0700"
    tmpfs = {
        WORKSPACE: f"{tmpfs_opts},size={limits.workspace_bytes}",
        "/tmp": f"{tmpfs_opts},size={limits.tmp_bytes}",
    }
    if state_dir is None:
        tmpfs[STATE_PATH] = f"{tmpfs_opts},noexec,size={limits.tmp_bytes}"
    egress_env, egress_mounts = egress_config(egress)
    return {
        "image": image,
        # -S: the supervisor needs only the stdlib; skipping site saves start-up time.
        "command": [
            KERNEL_PYTHON,
            "-S",
            "-m",
            "kernelhub_kernel.supervisor",
            "--connection-file",
            CONNECTION_FILE,
        ],
        "labels": spec.labels(instance, gateway),
        "hostname": "sandbox",
        # Never the HMAC key (nor any egress credential): the environment is visible in
        # `docker inspect`.
        "environment": {
            "KERNELHUB_SESSION": spec.session_id,
            # What the kernel keeps of a cell for a gateway that restarts mid-cell.
            "KERNELHUB_SPOOL_BYTES": str(spool_bytes(spec.limits.output_bytes)),
            **egress_env,
        },
        "user": f"{SANDBOX_UID}:{SANDBOX_GID}",
        "working_dir": WORKSPACE,
        # No network at all: not even a bridge; only the loopback interface exists.
        "network_mode": "none",
        "read_only": True,
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true", f"seccomp={seccomp_profile}"],
        "runtime": runtime,
        "ipc_mode": "private",
        "shm_size": SHM_BYTES,
        # Memory with no extra swap: memswap == mem.
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,
        "nano_cpus": int(limits.cpus * 1e9),
        "pids_limit": limits.pids,
        "ulimits": [
            Ulimit(name="core", soft=0, hard=0),
            Ulimit(name="nofile", soft=4096, hard=4096),
        ],
        "tmpfs": tmpfs,
        "mounts": [
            # A capped tmpfs on the host, as root (see DockerSandbox): sockets, not data.
            Mount(target=IPC_DIR, source=str(session_dir.ipc_dir), type="bind"),
            Mount(
                target=CONNECTION_FILE,
                source=str(session_dir.connection_file),
                type="bind",
                read_only=True,
            ),
            *egress_mounts,
            # Snapshots and checkpoints: outlives this container (see sandbox/state.py).
            *(
                [Mount(target=STATE_PATH, source=str(state_dir), type="bind")]
                if state_dir is not None
                else []
            ),
        ],
        "log_config": LogConfig(
            type=LogConfig.types.JSON,
            config={"max-size": LOG_MAX_SIZE, "max-file": "1"},
        ),
        # Our supervisor is PID 1 and reaps zombies; Docker's init would be a second one.
        "init": False,
        "stop_signal": "SIGTERM",
        "oom_score_adj": 500,  # under host memory pressure, sandboxes die before the host
        "detach": True,
    }


def egress_config(egress: EgressSettings | None) -> tuple[dict[str, str], list[Mount]]:
    """The environment and read-only mounts that give a sandbox the egress proxy.

    Still no network: ``HTTP_PROXY``/``HTTPS_PROXY`` name a loopback port that the
    sandbox's supervisor forwards to the gateway's Unix socket in the socket directory.
    The operator's CA (for the domains the proxy adds credentials to) and wheelhouse are
    mounted read-only; no secret is ever part of either."""
    if egress is None or not egress.enabled:
        return {}, []
    proxy = f"http://127.0.0.1:{egress.port}"
    env = {
        "KERNELHUB_EGRESS_PORT": str(egress.port),
        **{name: proxy for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy")},
        # The sandbox's own loopback servers are not the internet.
        "NO_PROXY": "localhost,127.0.0.1,::1",
        "no_proxy": "localhost,127.0.0.1,::1",
    }
    mounts = []
    if egress.ca_cert_file is not None:
        mounts.append(
            Mount(target=EGRESS_CA, source=str(egress.ca_cert_file), type="bind", read_only=True)
        )
        for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT"):
            env[name] = TRUST_BUNDLE
    if egress.wheelhouse is not None:
        mounts.append(
            Mount(target=WHEELHOUSE, source=str(egress.wheelhouse), type="bind", read_only=True)
        )
    if egress.index_url is not None:
        env["UV_INDEX_URL"] = egress.index_url
    return env, mounts
