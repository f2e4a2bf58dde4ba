"""The course as a student meets it: the stored chapters, read without running them.

Stored outputs show no absolute path and no engine frame; a cell that fails on purpose carries
nbval's tag and nothing visible; an exercise's solution is collapsed until asked for, and runs
(so nbval proves it passes its check); headings follow one style; chapter 1 states the
convention for level numbers that the tape stepper's labels use.
"""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
CHAPTERS = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))

# An absolute path (a POSIX one after a space, a quote or a line start, or a Windows drive),
# and what engine frames look like in a traceback.
ABSOLUTE_PATH = re.compile(r"""(?:^|[\s'"(])(?:/(?:home|root|tmp|usr|opt|work|var|Users)/"""
                           r"""|[A-Za-z]:\\\w)|site-packages""", re.M)
ENGINE_FRAME = re.compile(r"""File [^,\n]*\.py|(?:core|magics|widgets)/\w+\.py|Traceback \(most""")


def load(path):
    return json.loads(path.read_text())


def text_of(output) -> str:
    parts = [output.get("text", ""), output.get("evalue", ""), *output.get("traceback", [])]
    for value in output.get("data", {}).values():
        parts.append(value if isinstance(value, (str, list)) else json.dumps(value))
    return "\n".join(part if isinstance(part, str) else "".join(part) for part in parts)


def source(cell) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_stored_outputs_show_no_absolute_path_and_no_engine_frame(path):
    for index, cell in enumerate(load(path)["cells"]):
        for output in cell.get("outputs", []):
            shown = text_of(output)
            assert not ABSOLUTE_PATH.search(shown), (path.name, index, shown[:500])
            assert not ENGINE_FRAME.search(shown), (path.name, index, shown[:500])


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_cells_that_fail_on_purpose_carry_the_tag_only(path):
    for index, cell in enumerate(load(path)["cells"]):
        assert "NBVAL" not in source(cell), (path.name, index)
        tags = cell.get("metadata", {}).get("tags", [])
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        if errors:
            assert "raises-exception" in tags, (path.name, index)
            (error,) = errors
            # short: the student's line(s), then the error, which names the call and the fix
            assert len(error["traceback"]) <= 8, (path.name, index, error["traceback"])
            assert error["traceback"][0].startswith("Cell In["), error["traceback"]
            assert "Fix: " in error["evalue"], error["evalue"]


def test_every_chapter_but_the_tour_and_chapter_2_has_an_exercise():
    with_exercise = {path.name[:2] for path in CHAPTERS if exercise_cells(path)[1]}
    assert with_exercise >= {"01", "03", "04", "05", "06", "07", "08"}


def test_some_chapters_show_an_engine_error_on_purpose():
    failing = {path.name for path in CHAPTERS for cell in load(path)["cells"]
               if "raises-exception" in cell.get("metadata", {}).get("tags", [])}
    assert {"00_tour.ipynb", "03_interpreters.ipynb", "04_programs.ipynb"} <= failing


def exercise_cells(path):
    cells = load(path)["cells"]
    starts = [i for i, cell in enumerate(cells) if cell["cell_type"] == "markdown"
              and re.search(r"^## Exercise", source(cell), re.M)]
    return cells, starts


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_an_exercises_solution_is_collapsed_until_asked_for(path):
    cells, starts = exercise_cells(path)
    if not starts:
        pytest.skip("no exercise in this chapter")
    (start,) = starts
    heading = next(i for i in range(start, len(cells))
                   if re.search(r"^### Solution", source(cells[i]), re.M))
    student = [c for c in cells[start:heading] if c["cell_type"] == "code"]
    assert len(student) >= 2, "the exercise has the student's cell and a check that runs on it"
    assert not cells[heading].get("metadata", {}).get("jupyter", {}).get("source_hidden")
    solution = [i for i, c in enumerate(cells)
                if "solution" in c.get("metadata", {}).get("tags", [])]
    assert solution and min(solution) == heading + 1, "the solution follows its heading"
    for i in solution:
        meta = cells[i]["metadata"]
        assert meta["jupyter"]["source_hidden"] is True, (path.name, i)
        assert not {"skip-execution", "nbval-skip"} & set(meta["tags"])  # nbval runs it
    code = [i for i in solution if cells[i]["cell_type"] == "code"]
    assert code, "the reference solution is a code cell"
    after = cells[max(solution) + 1]
    assert after["cell_type"] == "code" and "solution" not in after["metadata"].get("tags", [])
    assert re.search(r"check_(against|primitive)", source(after)), "a check runs after it"


@pytest.mark.parametrize("path", CHAPTERS, ids=[p.name for p in CHAPTERS])
def test_headings_follow_one_style(path):
    cells = load(path)["cells"]
    number = int(path.name[:2])
    title = source(cells[0]).splitlines()[0]
    assert re.match(rf"# Chapter {number} · \S", title), title
    sections = [line for cell in cells if cell["cell_type"] == "markdown"
                for line in source(cell).splitlines() if line.startswith("## ")]
    style = re.compile(r"## (\d+ · \S|Exercise · [A-Z`]|Summary$|Where next$|Appendix · [A-Z])")
    assert [s for s in sections if not style.match(s)] == []
    numbers = [int(s[3:].split(" ")[0]) for s in sections if s[3].isdigit()]
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def test_chapter_1_is_short_and_states_the_level_convention():
    cells = load(NOTEBOOKS / "01_dispatchers.ipynb")["cells"]
    assert len(cells) <= 30
    intro = source(cells[0])
    assert "level 0" in intro and "outer" in intro and "inner" in intro
    stepper = [text_of(o) for c in cells for o in c.get("outputs", [])
               if "TapeStepper" in source(c)]
    assert any("Autograd1 tape · outer" in s and "Autograd2 tape · inner" in s for s in stepper)


def test_the_tour_says_where_a_magic_goes():
    tour = "\n".join(source(c) for c in load(NOTEBOOKS / "00_tour.ipynb")["cells"])
    assert "first line of its cell" in tour and "comment" in tour


GENERATORS = NOTEBOOKS.parent / "tools" / "notebooks"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_each_chapter_is_what_its_generator_writes(path, tmp_path):
    """tools/notebooks/README.md: the prose is fixed in the chapter's script, not in the
    notebook, so that the two stay the same. The script, run into a scratch file, writes the
    stored chapter's cells: the same kinds, sources and tags (outputs come from
    ``make notebooks``)."""
    script = GENERATORS / f"make_{path.stem}.py"
    written = tmp_path / path.name
    subprocess.run([sys.executable, str(script), str(written)], check=True,
                   capture_output=True, cwd=NOTEBOOKS.parent)

    def cells(notebook):
        return [(cell["cell_type"], "".join(cell["source"]),
                 sorted(cell.get("metadata", {}).get("tags", [])))
                for cell in load(notebook)["cells"]]
    assert cells(written) == cells(path), (
        f"{path.name} differs from what {script.name} writes: edit the script, run it, then "
        "`make notebooks`")
