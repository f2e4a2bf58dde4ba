"""How a magic shows what it bound: a table of names, types and values; a program with the
notebook's names.

Everything shown comes from user data (names, reprs), so every piece of text is
HTML-escaped. The plain-text form is the same table without markup, for terminals.
"""
import html
import keyword

import torch

from minifunctorch.core import Program
from minifunctorch.core.printing import type_string

from .names import ENGINE_NAME
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


def _letters():
    """a, b, ..., z, ba, bb, ... as Program names its variables."""
    index = 0
    while True:
        name, n = "", index
        while True:
            name = chr(ord("a") + n % 26) + name
            n //= 26
            if n == 0:
                break
        yield f"{name}_" if keyword.iskeyword(name) else name
        index += 1


class NamedProgram(Program):
    """A program printed with the notebook's names for its inputs and its constants.

    ``Program`` names every variable a, b, c, ... in order of appearance. Here an input takes
    the name of the notebook variable it came from, and a constant the label of the notebook
    tensor it is (NOTE [Names the notebook gave] in names.py); the other variables keep
    letters, skipping the names already taken. Only the printing differs: it evaluates,
    exports and transforms as the program it shows.

    >>> import torch
    >>> from minifunctorch.core import label, trace
    >>> y = label(torch.ones(3), "y")
    >>> program = trace(lambda a, w: (a * w * y).sum())(torch.ones(3), torch.ones(3))
    >>> print(NamedProgram.of(program, {"x": torch.ones(3), "w": torch.ones(3)}))
    { lambda y:f32[3] ; x:f32[3] w:f32[3] .
      let a:f32[3] = mul x w
          b:f32[3] = mul a y
          c:f32[] = sum b dim=(0,) keepdim=False
      in (c,) }
    """

    @classmethod
    def of(cls, program, inputs: dict):
        """``program`` with ``inputs`` (notebook name -> value, in the order of the program's
        arguments) naming its inputs; an input made of several tensors keeps letters."""
        named = cls(program.inputs, program.constants, program.equations, program.outputs,
                    in_treedef=program.in_treedef, out_treedef=program.out_treedef,
                    static_leaves=program.static_leaves, device=program.device,
                    name=program.name)
        given = {}
        variables = iter(program.inputs)
        for name, value in inputs.items():
            count = len(leaves(value)) if isinstance(value, (tuple, list, dict)) else 1
            chunk = [next(variables, None) for _ in range(count)]
            if count == 1 and chunk[0] is not None and not ENGINE_NAME.match(name):
                given[chunk[0]] = name
        for variable, tensor in program.constants:
            name = getattr(tensor, "t_name", None)
            if name and name.isidentifier() and not ENGINE_NAME.match(name) \
                    and name not in given.values():
                given[variable] = name
        named.given = given
        return named

    def names(self) -> dict:
        given = getattr(self, "given", {})
        taken = set(given.values())
        letters = (name for name in _letters() if name not in taken)
        names = {}
        for variable in [*self.inputs, *(v for v, _ in self.constants),
                         *(eq.out for eq in self.equations)]:
            if variable not in names:
                names[variable] = given.get(variable) or next(letters)
        return names
