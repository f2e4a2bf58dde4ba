"""minifunctorch.widgets: ipywidgets views of core data.

``TapeStepper(tapes)`` steps through the backward pass of one or more tapes; the numbers it
shows come from ``tape_view``, a pure-Python view model.
"""
from .tape_stepper import TapePanel, TapeStepper, render_panel_html

__all__ = ["TapePanel", "TapeStepper", "render_panel_html"]
