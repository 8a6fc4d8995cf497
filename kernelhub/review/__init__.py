"""The review page: a static page (``static/``, no build step) that uses the same REST
and WebSocket API as any client, and the sign-in that turns a token into a cookie."""
