"""The part of kernelhub that runs inside the sandbox, next to the user's code.

It is put on ``PYTHONPATH`` (``/opt/kernelhub`` in the image, ``kernel-image/`` on the host
for the local backend) and imports only the standard library, ipykernel and ipykernel's own
dependencies, never ``kernelhub``: the sandbox does not have it, and whatever is imported
here is reachable from user code.

Modules:

* ``supervisor``: the sandbox's first process (PID 1 of the container). Starts the kernel,
  reaps zombies, and turns signals from the host into kernel actions: SIGINT interrupts the
  running cell, SIGHUP replaces the kernel with a fresh one, SIGTERM stops everything. Exits
  with the kernel's status when the kernel dies on its own.
* ``launch``: the kernel process: applies ``patches``, then runs ipykernel's ``IPKernelApp``.
* ``patches``: what a sandboxed kernel driven by an agent needs that stock ipykernel does
  not do: output that streams live, bounded stream messages, output attributed to the cell
  that produced it (threads, subprocesses), ``confirm()``, nothing written to the workspace.
* ``bounds``: every message the kernel sends cut to a size the host accepts, visibly.

``PROTOCOL_VERSION`` is the version of the contract between kernelhub and this package (the
command line, the signals, the environment it reads); kernelhub's
``KERNEL_PROTOCOL_VERSION`` must match it.
"""

PROTOCOL_VERSION = "1"
