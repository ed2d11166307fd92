"""The controls' mutations still find what they patch (no Ray, no Redis).

A mutation patches a name inside the product (``runtime._decide_turn.assess`` ...). When that name moves,
the patch fails inside the actor's worker process, where it shows up only as a control that no longer
fails its judge for the reason it claims. Each patch is applied here in a fresh interpreter (the test
process itself stays unpatched).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.faults.mutations import MUTATIONS

pytestmark = [pytest.mark.faults]

_APPLY = """
import sys
from tests.faults.mutations import MUTATIONS
patch, _ = MUTATIONS[sys.argv[1]]
patch()
"""


@pytest.mark.parametrize("name", sorted(n for n, (patch, _) in MUTATIONS.items() if patch is not None))
def test_each_mutation_patches_a_name_that_exists(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _APPLY, name], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
