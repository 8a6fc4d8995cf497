"""Every message the kernel sends is bounded: one over the limit is cut, visibly.

``launch`` applies :func:`bound_messages` to jupyter_client's ``Session`` (pinned with the
image, like ipykernel) before the kernel starts.
"""

from typing import Any

# The largest message the kernel sends; the host refuses bigger frames (ZMQ MAXMSGSIZE,
# kernelhub.kernel.client.MAX_FRAME_BYTES, a little above this), so anything larger is
# cut here, where it can become a named truncation instead of a dropped connection.
MAX_MESSAGE_BYTES = 8 << 20
_TRUNCATED_KEY = "kernelhub_truncated"
_MAX_ITEMS = 1000
_MAX_DEPTH = 32


def bound_messages(session_class: Any, max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    """Cut every message over ``max_bytes`` before it is sent, with a visible marker.

    A display with 40 MB of metadata or ``raise Exception('x' * 20_000_000)`` would be one
    message the host has to receive and decode whole. Strings are cut to their head and
    tail around ``[... N bytes dropped ...]``, long lists and dicts keep their ends, a
    binary MIME entry that had to be cut is dropped (half an image renders as garbage),
    and ``content`` gets ``kernelhub_truncated`` with the original size. Messages under
    the limit (nearly all) cost one ``sum`` of frame lengths.
    """
    serialize = session_class.serialize

    def bounded_serialize(self: Any, msg: dict[str, Any], ident: Any = None) -> list[bytes]:
        frames = serialize(self, msg, ident)
        size = sum(len(f) for f in frames)
        content = msg.get("content")
        if size <= max_bytes or not isinstance(content, dict):
            return frames
        msg = dict(msg)
        msg["content"] = _shrink_content(content, max_bytes // 2, size)
        if msg.get("metadata"):
            msg["metadata"] = _shrink(msg["metadata"], max_bytes // 16)
        return serialize(self, msg, ident)

    session_class.serialize = bounded_serialize


def _shrink_content(content: dict[str, Any], budget: int, size: int) -> dict[str, Any]:
    import json

    cap = budget
    while True:
        out = _cap(content, cap, 0)
        data = out.get("data")
        if isinstance(data, dict) and isinstance(content.get("data"), dict):
            for key, value in list(data.items()):
                cut = value != content["data"].get(key)
                if cut and not (key.startswith("text/") or key.endswith("json")):
                    del data[key]
                    data.setdefault("text/plain", f"[{key} output dropped: over the message limit]")
        out[_TRUNCATED_KEY] = {"original_bytes": size, "limit_bytes": budget * 2}
        if len(json.dumps(out, default=str)) <= budget or cap <= 64:
            return out
        cap //= 4


def _cap(value: Any, cap: int, depth: int) -> Any:
    if isinstance(value, str):
        return _cut_text(value, cap)
    if depth >= _MAX_DEPTH:
        return "[... nested too deep ...]"
    if isinstance(value, dict):
        items = list(value.items())
        kept = {str(k)[:cap]: _cap(v, cap, depth + 1) for k, v in items[:_MAX_ITEMS]}
        if len(items) > _MAX_ITEMS:
            kept["..."] = f"[... {len(items) - _MAX_ITEMS} entries dropped ...]"
        return kept
    if isinstance(value, (list, tuple)):
        if len(value) > _MAX_ITEMS:
            half = _MAX_ITEMS // 2
            dropped = f"[... {len(value) - 2 * half} items dropped ...]"
            value = [*value[:half], dropped, *value[-half:]]
        return [_cap(v, cap, depth + 1) for v in value]
    return value


def _shrink(value: Any, budget: int) -> Any:
    return _cap(value, max(budget // 4, 64), 0)


def _cut_text(text: str, limit: int) -> str:
    if len(text) <= limit // 4:  # at most 4 UTF-8 bytes a character: fits
        return text
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    half = max(limit // 2 - 32, 0)
    head = raw[:half].decode("utf-8", "ignore")
    tail = raw[len(raw) - half :].decode("utf-8", "ignore")
    return f"{head}\n[... {len(raw) - 2 * half} bytes dropped ...]\n{tail}"
