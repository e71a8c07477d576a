"""Shared caches' refusals, word for word, before any file is made, and their files' owner."""
from __future__ import annotations

import os
import sys

import pytest

from kvstate._errors import ValidationError
from kvstate._spec import CacheSpec
from kvstate._validate import MAX_BLOCKS
from kvstate.backends._shm import SharedCaches

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/dev/shm)")

SPEC = CacheSpec(2, 1, 4, 8, tp_size=2)


@pytest.mark.parametrize("args, kw, message", [
    (("spec", 4), {}, "SharedCaches: spec must be a CacheSpec"),
    ((SPEC, 0), {}, f"SharedCaches: num_blocks must be an int > 0 and <= {MAX_BLOCKS}, got 0"),
    ((SPEC, MAX_BLOCKS + 1), {},
     f"SharedCaches: num_blocks must be an int > 0 and <= {MAX_BLOCKS}, got {MAX_BLOCKS + 1}"),
    ((SPEC, 4), {"num_states": -1}, "SharedCaches: num_states must be an int >= 0, got -1"),
    ((SPEC, 4), {"num_states": 2}, "SharedCaches: num_states 2 with 0 state bytes a rank"),
])
def test_create_refuses_bad_arguments_and_makes_no_file(tmp_path, args, kw, message):
    with pytest.raises(ValidationError) as e:
        SharedCaches.create(*args, directory=tmp_path, **kw)
    assert str(e.value).startswith(message)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("paths", [{0: ""}, {"0": "f"}, {0: 5}, [("0", "f")]])
def test_attach_refuses_paths_that_name_no_rank_file(paths):
    with pytest.raises(ValidationError) as e:
        SharedCaches.attach(SPEC, 4, paths)
    assert str(e.value) == f"SharedCaches: paths must map each rank (an int) to its file, got {paths!r}"


def test_the_bounds_are_inclusive_and_the_owner_must_be_a_bool(tmp_path):
    with SharedCaches.create(SPEC, 1, ranks=[1], directory=tmp_path) as one:
        assert list(one.paths) == [1] and one.caches[1]["key"][0].shape[0] == 1  # only the ranks asked for
        with pytest.raises(ValidationError) as e:
            SharedCaches(SPEC, 1, one.paths, owner=1)
        assert str(e.value) == "SharedCaches: owner must be a bool, got 1"
        os.unlink(one.paths[1])  # removed by someone else: the owner's close still ends cleanly
    assert os.listdir(tmp_path) == []
    with SharedCaches.create(SPEC, 2, directory=tmp_path) as two:
        assert sorted(two.paths) == [0, 1]
