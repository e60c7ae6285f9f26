"""Names that left squareq.compiler in issue 59 (``open_source`` and ``Source``, now in squareq.sources) still import
from it for one release, with a FutureWarning naming the new import; the new import warns of nothing."""
import warnings

import pytest

import squareq.compiler
import squareq.sources


@pytest.mark.parametrize("name", ["open_source", "Source"])
def test_the_old_import_still_works_and_warns_once(name, monkeypatch):
    monkeypatch.setattr(squareq.compiler, "_warned", set())  # an earlier test may have used the old name
    with pytest.warns(FutureWarning, match=rf"from squareq\.sources import {name}") as caught:
        exec(f"from squareq.compiler import {name} as old", namespace := {})
    assert namespace["old"] is getattr(squareq.sources, name)
    assert [w.filename for w in caught if "squareq.sources" in str(w.message)] == ["<string>"]  # once, at the import
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        assert getattr(squareq.compiler, name) is getattr(squareq.sources, name)  # still works, quietly
    assert not again


@pytest.mark.parametrize("name", ["open_source", "Source"])
def test_the_new_import_does_not_warn(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(f"from squareq.sources import {name} as new", namespace := {})
        exec("from squareq.compiler import CompileOptions, compile_slab", {})  # the names that stayed: quiet
    assert namespace["new"] is getattr(squareq.sources, name)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], [str(w.message) for w in caught]


def test_other_missing_names_are_still_missing():
    """Negative control: the fallback hands out only the moved names."""
    with pytest.raises(ImportError, match="open_slab"):
        exec("from squareq.compiler import open_slab", {})
