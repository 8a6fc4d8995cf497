"""Snapshots on the host: opaque blobs bound to their owner by a MAC, and the calls that
make the kernel capture and restore itself. The host never opens a snapshot: it is data
made by untrusted code, only ever unpacked and loaded inside a fresh sandbox."""
