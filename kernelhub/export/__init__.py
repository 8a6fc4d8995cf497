"""Exports of a session's history: a Jupyter notebook, and a static HTML rendering of it."""

from kernelhub.export.notebook import RERUN_SKIP_TAG, to_html, to_notebook

__all__ = ["RERUN_SKIP_TAG", "to_html", "to_notebook"]
