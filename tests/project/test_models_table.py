"""The README's supported-models table is the one `python -m stallfree.runtime.model.table`
writes from FAMILIES: adding a family (or changing what it runs with) means regenerating it."""

from __future__ import annotations

from pathlib import Path

from stallfree.runtime.model.arch import FAMILIES
from stallfree.runtime.model.table import END, START, models_table, update_readme

ROOT = Path(__file__).resolve().parents[2]


def test_the_readme_table_is_current():
    readme = (ROOT / "README.md").read_text()
    assert f"{START}\n{models_table()}\n{END}" in readme, (
        "run `python -m stallfree.runtime.model.table README.md` and commit the README"
    )


def test_the_table_has_a_row_per_family_and_one_for_the_fallback(tmp_path):
    table = models_table()
    for family in FAMILIES.values():
        assert f"| `{family.architecture}` |" in table
    assert "--model-impl transformers" in table.splitlines()[-1]
    page = tmp_path / "README.md"
    page.write_text(f"before\n{START}\nstale\n{END}\nafter\n")
    update_readme(page)
    assert page.read_text() == f"before\n{START}\n{models_table()}\n{END}\nafter\n"
