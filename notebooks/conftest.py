"""nbval settings for the course notebooks.

A widget's view (``application/vnd.jupyter.widget-view+json``) carries a random model id, so
nbval compares only its ``text/plain`` fallback, which the widgets make deterministic.
"""


def pytest_collectstart(collector):
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("application/vnd.jupyter.widget-view+json",)
