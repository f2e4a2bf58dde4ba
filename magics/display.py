"""How a magic shows what it bound: a table of names, types and values.

Everything shown comes from user data (names, reprs), so every piece of text is
HTML-escaped. The plain-text form is the same table without markup, for terminals.
"""
import html

import torch

from minifunctorch.core.printing import type_string

from .stack import leaves


def describe_type(value) -> str:
    """``f32[4,3]`` for a tensor; a short description of a tuple/list/dict of tensors.

    >>> describe_type(torch.ones(4, 3))
    'f32[4,3]'
    >>> describe_type({"w": torch.ones(2), "b": torch.ones(())})
    'dict of 2 tensors'
    """
    if isinstance(value, torch.Tensor):
        return type_string(value.dtype, value.shape)
    if isinstance(value, (tuple, list, dict)):
        n = len(leaves(value))
        return f"{type(value).__name__} of {n} tensor{'s' if n != 1 else ''}"
    return type(value).__name__


class Results:
    """The names a magic bound and their values, shown as a table.

    >>> results = Results("%%grad --wrt x", {"dx": torch.tensor([2.0, 4.0])})
    >>> print(repr(results))
    %%grad --wrt x
    dx: f32[2] = tensor([2., 4.])
    >>> "<code>dx</code>" in results._repr_html_()
    True
    """

    def __init__(self, title: str, values: dict):
        self.title = title
        self.values = dict(values)

    def __repr__(self):
        lines = [self.title]
        for name, value in self.values.items():
            shown = repr(value)
            separator = "\n" if "\n" in shown else " "
            lines.append(f"{name}: {describe_type(value)} ={separator}{shown}")
        return "\n".join(lines)

    def _repr_html_(self):
        cell = '<td style="text-align:left">{}</td>'
        rows = "".join(
            "<tr>"
            + cell.format(f"<code>{html.escape(name)}</code>")
            + cell.format(f"<code>{html.escape(describe_type(value))}</code>")
            + cell.format(f'<pre style="margin:0">{html.escape(repr(value))}</pre>')
            + "</tr>"
            for name, value in self.values.items())
        header = "".join(f'<th style="text-align:left">{h}</th>' for h in ("name", "type", "value"))
        return (f'<div class="mft-results"><div><code>{html.escape(self.title)}</code></div>'
                f"<table><tr>{header}</tr>{rows}</table></div>")


class Heading:
    """A one-line heading (bold in HTML, escaped), e.g. above a forward and a backward program.

    >>> Heading("forward <fwd>")._repr_html_()
    '<b>forward &lt;fwd&gt;</b>'
    """

    def __init__(self, text: str):
        self.text = text

    def __repr__(self):
        return self.text

    def _repr_html_(self):
        return f"<b>{html.escape(self.text)}</b>"


class Source:
    """Python source shown as a code block (escaped), e.g. a program's generated code.

    >>> print(Source("\\ndef f(a):\\n    return a < 1")._repr_html_())
    <pre class="mft-source">def f(a):
        return a &lt; 1</pre>
    """

    def __init__(self, code: str):
        # no blank or whitespace-only lines around the code (FX ends its code with "    \n")
        self.code = "\n".join(line.rstrip() for line in code.strip().splitlines())

    def __repr__(self):
        return self.code

    def _repr_html_(self):
        return f'<pre class="mft-source">{html.escape(self.code)}</pre>'
