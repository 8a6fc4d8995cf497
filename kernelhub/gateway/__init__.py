"""The HTTP/WebSocket gateway: ``create_app(settings)`` builds it; nothing runs at import."""
