"""minifunctorch.magics: IPython cell magics for the transforms of ``minifunctorch.core``.

Load them in a notebook with ``%load_ext minifunctorch.magics``; then::

    %%grad --wrt x w                 # binds dx, dw
    ((x @ w - y) ** 2).mean()

    %%vmap --over x y                # per-example gradients: binds dw of shape (B, *w.shape)
    %%grad --wrt w
    ((x @ w - y) ** 2).mean()

The magics: ``%%grad``, ``%%vmap``, ``%%jvp``, ``%%jacobian``, ``%%hessian``, ``%%trace``
(cell magics; ``%%grad?`` shows the flags of one) and ``%tape`` (line magic: the tape stepper
of the last ``%%grad`` cell). Loading the extension also makes the engine's errors short in
every cell (``errors.py``).

NOTE [A thin adapter]
The magics hold no transform logic. A cell becomes a function (``cell.py``), each magic line
becomes a *stage* that wraps that function with one transform of ``minifunctorch.core``
(``stack.py``), and the IPython side (``extension.py``) parses flags, reads the inputs from
the notebook, binds and displays the results. Anything one can do with a magic, one can do
by writing the same function and calling ``minifunctorch.core`` (or ``torch.func``: that is
what ``--check`` does).

NOTE [Modelled on %%time]
Like IPython's ``%%time``, a magic transforms the cell (``shell.transform_cell``), compiles it
with ``shell.compile`` under a file name the shell knows (so tracebacks show ``Cell In[n]``
and the cell's lines), runs it and evaluates its last expression. Unlike ``%%time`` the cell
runs as the body of a function (NOTE [A cell is a function body] in ``cell.py``), because a
transform needs a function, and stacked magic lines compose (NOTE [Stacked magics compose]
in ``stack.py``).

NOTE [Lazy IPython import]
``import minifunctorch.magics`` does not import IPython: only ``extension.py`` does, and it is
imported when IPython loads the extension. ``cell.py``, ``stack.py`` and ``display.py`` work
without a shell (their doctests run without one).
"""

_MAGICS_CLASS = "TransformMagics"


def load_ipython_extension(ipython):
    """Register the magics with ``ipython`` (what ``%load_ext minifunctorch.magics`` calls).

    Loading twice is harmless: the magics already registered are kept, with their state
    (the tapes ``%tape`` shows).

    In a notebook::

        %load_ext minifunctorch.magics
        %%grad?                          # the flags of %%grad
        %unload_ext minifunctorch.magics
    """
    from .extension import TransformMagics, install

    install(ipython)  # short engine tracebacks, comments above a magic (extension.py)
    if _MAGICS_CLASS in ipython.magics_manager.registry:
        return
    ipython.register_magics(TransformMagics)


def unload_ipython_extension(ipython):
    """Remove the magics from ``ipython`` (what ``%unload_ext minifunctorch.magics`` calls)."""
    from .extension import uninstall

    uninstall(ipython)
    manager = ipython.magics_manager
    instance = manager.registry.pop(_MAGICS_CLASS, None)
    if instance is None:
        return
    for kind, functions in instance.magics.items():
        table = manager.magics.get(kind, {})
        for name, function in functions.items():
            if table.get(name) == function:  # only ours: never remove a magic someone else
                del table[name]               # registered under the same name since


__all__ = ["load_ipython_extension", "unload_ipython_extension"]
